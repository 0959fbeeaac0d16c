# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""DDP through torchrun: 2 CPU processes on gloo, rank-sharded data, then a DDP resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_trainer_fixtures import weighted_dir  # noqa: F401 - fixture


def torchrun(args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "entroweight.workflows.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def _args(weighted_dir, tmp_path, out):
    mc = tmp_path / "tiny.yaml"
    mc.write_text("d_model: 32\nn_layers: 1\nn_heads: 2\nd_ff: 64\n")
    args = ["train", str(weighted_dir), "--model-config", str(mc), "--loss", "weighted_ce", "--out", str(out)]
    return args + ["--batch-size", "4", "--lr", "3e-3", "--log-every", "2", "--device", "cpu"]


def test_ddp_two_cpu_processes(weighted_dir, tmp_path):
    """Kept short for `make test` (one torchrun, 2 steps): the DDP path runs, both ranks step together."""
    out = tmp_path / "ck"
    r = torchrun([*_args(weighted_dir, tmp_path, out), "--steps", "2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 2 and state["position"] == 2
    assert "× 2" in r.stdout  # rank 0 reports the world size
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["tokens"] == 2 * 2 * 4 * 128  # both ranks' tokens


@pytest.mark.slow
def test_ddp_two_cpu_processes_train_and_resume(weighted_dir, tmp_path):
    out = tmp_path / "ck"
    args = [*_args(weighted_dir, tmp_path, out), "--steps", "6"]
    r = torchrun([*args, "--stop-at", "4"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 4 and state["position"] == 4
    r = torchrun([*args, "--resume"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2, 4, 6]
    assert rows[-1]["tokens"] == 6 * 2 * 4 * 128  # both ranks' tokens
    assert "× 2" in r.stdout  # rank 0 reports the world size; rank 1 stays quiet
    # resuming on another world size would change the data order: refused
    r = subprocess.run(
        [sys.executable, "-m", "entroweight.workflows.cli", *args, "--steps", "8", "--resume"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "same number" in r.stderr
