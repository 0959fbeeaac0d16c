# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""`train --resume` on data that changed since the checkpoint (a shard added, removed or rewritten) is
refused before anything is written, naming what changed, unless --allow-config-change."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from test_trainer_fixtures import TINY, make_weighted

from entroweight.trainers import TrainConfig, train
from entroweight.trainers.config import TrainError


def _add(d):
    first = sorted(d.glob("*.parquet"))[0]
    shutil.copyfile(first, d / "part-09999.parquet")
    return "added", "part-09999.parquet"


def _remove(d):
    last = sorted(d.glob("*.parquet"))[-1]
    last.unlink()
    return "removed", last.name


def _rewrite(d):
    first, second = sorted(d.glob("*.parquet"))[:2]
    shutil.copyfile(second, first)  # another shard's bytes under its name
    return "changed", first.name


@pytest.mark.parametrize("change", [_add, _remove, _rewrite], ids=["added", "removed", "changed"])
def test_resume_on_changed_data_is_refused_naming_the_change(tokenized_dir, tmp_path, change):
    data = make_weighted(tokenized_dir, tmp_path / "data", files=3)
    out = tmp_path / "ck"
    cfg = dict(data=str(data), out=str(out), model_config=TINY, loss="weighted_ce", steps=4, batch_size=4)
    train(TrainConfig(**cfg, stop_at=2, quiet=True))
    train(TrainConfig(**cfg, stop_at=3, resume=True, quiet=True))  # the same data: resumes
    kind, name = change(data)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(TrainError, match=rf"data that changed since the checkpoint \({kind} .*{name}"):
        train(TrainConfig(**cfg, resume=True, quiet=True))
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing written
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "entroweight.workflows.cli",
            "train",
            str(data),
            "--loss",
            "weighted_ce",
            "--model-config",
            str(_yaml(tmp_path)),
            "--out",
            str(out),
            "--steps",
            "4",
            "--batch-size",
            "4",
            "--resume",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and kind in r.stderr, r.stderr[
        -2000:
    ]
    result = train(TrainConfig(**cfg, resume=True, quiet=True), allow_config_change=True)
    assert result.step == 4
    recorded = json.loads((out / "config.json").read_text())["data_shards"]
    assert sorted(k.rsplit("/", 1)[1] for k in recorded) == sorted(p.name for p in data.glob("*.parquet"))


def _yaml(tmp_path):
    p = tmp_path / "tiny.yaml"
    p.write_text("".join(f"{k}: {v}\n" for k, v in TINY.items()))
    return p
