"""Engines: local, Beam and Ray give the same rows; runs resume, rerun incrementally, and report failures.

Small real inputs (the first 300 C4 documents split into files, plus a file of bad rows) keep each
engine run to seconds; Ray is started once for the in-process tests and once by a CLI subprocess.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from entroweight.pipelines import StageError, StageFailed, run_stage
from entroweight.pipelines.stage import STAGE_FILE, read_manifests
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.transforms.writer import TMP_MARK, sha256_file

N_CTX = 64
BAD_ROWS = ['{"text": "a good short document", "url": "u"}', "not json", '{"text": "   "}', '{"url": "x"}']


def c4_lines(c4_path: Path, n: int) -> list[str]:
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


def write_gz(path: Path, lines: list[str]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def lines(c4_path) -> list[str]:
    return c4_lines(c4_path, 400)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, lines) -> Path:
    """Three gz files of 100 C4 docs and one jsonl with rejects: 4 files, 304 docs, 3 rejected."""
    d = tmp_path_factory.mktemp("inputs")
    for i, name in enumerate("abc"):
        write_gz(d / f"{name}.jsonl.gz", lines[i * 100 : (i + 1) * 100])
    (d / "d.jsonl").write_text("\n".join(BAD_ROWS) + "\n")
    return d


def stage_for(src, tokenizer_dir, **kw) -> TokenizeStage:
    return TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=kw.pop("n_ctx", N_CTX), **kw)


def rows_hash(out: Path) -> str:
    """Canonical hash of all rows in the output: independent of shard order and file layout."""
    rows = []
    for f in sorted(out.glob("part-*.parquet")):
        rows += [json.dumps(r, sort_keys=True, default=str) for r in pq.read_table(f).to_pylist()]
    return hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()


def counts(out: Path) -> list[tuple]:
    return sorted(
        (
            tuple(i.key for i in m.inputs),
            m.shard,
            m.rows_out,
            m.docs_in,
            m.docs_out,
            tuple(sorted(m.rejected.items())),
            m.n_real_tokens,
        )
        for m in read_manifests(out)
    )


def assert_valid(out: Path) -> None:
    """Every manifest's files exist with their checksums; accounting holds; no temp file is left."""
    for m in read_manifests(out):
        assert sha256_file(out / m.output) == m.output_sha256
        if m.rejects_file:
            assert sha256_file(out / m.rejects_file) == m.rejects_sha256
        assert m.docs_in == m.docs_out + m.n_rejected, m.shard
        assert pq.read_metadata(out / m.output).num_rows == m.rows_out
    assert not [p for p in out.rglob("*") if TMP_MARK in p.name]
    assert not (out / ".engine").exists()


@pytest.fixture(scope="module")
def local_out(tmp_path_factory, inputs, tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("local")
    run_stage(stage_for(inputs, tokenizer_dir, shard_docs=50), out, progress=False)
    return out


@pytest.fixture(scope="module")
def ray_session():
    """One in-process Ray for this module's Ray runs (the Ray engine leaves a Ray it did not start running)."""
    from entroweight.pipelines.ray import start_ray

    ray, _ = start_ray(None)
    yield ray
    ray.shutdown()


def test_local_reference_accounting(local_out):
    assert_valid(local_out)
    ms = read_manifests(local_out)
    assert len(ms) == 7  # 3 files x 2 ranges of 50, plus the small jsonl (its 4 rows fit one range)
    assert sum(m.docs_in for m in ms) == 304
    assert sum(m.n_rejected for m in ms) == 3


@pytest.mark.parametrize(
    "engine,options",
    [
        ("beam", {}),
        ("beam", {"workers": 2}),  # multi_processing: two SDK worker processes
        ("ray", {"workers": 2}),
    ],
    ids=["beam", "beam-multiprocess", "ray"],
)
def test_engine_parity(engine, options, request, tmp_path, inputs, tokenizer_dir, local_out):
    if engine == "ray":
        request.getfixturevalue("ray_session")
    summary = run_stage(
        stage_for(inputs, tokenizer_dir, shard_docs=50), tmp_path, engine=engine, progress=False, **options
    )
    assert summary.shards_run == 7 and summary.docs_in == 304
    assert summary.docs_in == summary.docs_out + sum(summary.rejected.values())
    assert rows_hash(tmp_path) == rows_hash(local_out)
    assert counts(tmp_path) == counts(local_out)
    assert_valid(tmp_path)
    # identical bytes, not only rows: the parquet writer is deterministic on every engine
    for m in read_manifests(tmp_path):
        assert m.output_sha256 == sha256_file(local_out / m.output)


def test_beam_options_pick_the_runner():
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    from entroweight.pipelines.beam import build_runner

    runner, opts, threads = build_runner({}, None)
    assert isinstance(runner, FnApiRunner) and opts.get_all_options()["direct_running_mode"] == "in_memory"
    runner, opts, threads = build_runner({}, 2)
    assert opts.get_all_options()["direct_num_workers"] == 2 and threads == max(1, (os.cpu_count() or 1) // 2)
    runner, opts, _ = build_runner(
        {"runner": "DataflowRunner", "project": "p", "region": "europe-west4", "temp_location": "gs://b/t"}, 8
    )
    all_opts = opts.get_all_options()
    assert type(runner).__name__ == "DataflowRunner"
    assert (all_opts["project"], all_opts["region"], all_opts["max_num_workers"]) == ("p", "europe-west4", 8)


# ---------------------------------------------------------------- resume after SIGKILL


def cli(*args, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "entroweight.workflows.cli", *map(str, args)],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the kill reaches Beam's worker processes and the embedded Ray too
        **kw,
    )


@pytest.mark.parametrize("engine", ["local", "beam", "ray"])
def test_resume_after_sigkill(engine, tmp_path, inputs, tokenizer_dir, local_out):
    out = tmp_path / "out"
    args = [
        "tokenize",
        inputs,
        "--tokenizer",
        tokenizer_dir,
        "--n-ctx",
        N_CTX,
        "--shard-docs",
        50,
        "--out",
        out,
    ]
    # a pause between each shard's parquet and its manifest: the kill lands mid-run
    proc = cli(*args, "--engine", engine, env={"ENTROWEIGHT_TEST_SHARD_DELAY": "0.7"})
    deadline = time.monotonic() + 120
    while not (out.exists() and read_manifests(out)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # inside the next shard's window: parquet written, manifest not
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = read_manifests(out)
    assert 1 <= len(done) < 7, "the kill should land mid-run"
    # what a kill inside the parquet writer leaves: a half-written temp file
    (out / f"part-00006.parquet{TMP_MARK}deadbeef").write_bytes(b"PAR1 half")

    rerun = cli(*args, "--engine", engine)
    stdout, stderr = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, stderr
    run_now, already = map(int, re.search(r"(\d+) shard\(s\) run, (\d+) already done", stdout).groups())
    # Ray's workers may finish the shard they held after the driver died: its complete manifest counts
    assert run_now + already == 7 and already >= len(done)
    assert already == len(done) or engine == "ray"
    assert rows_hash(out) == rows_hash(local_out)
    assert counts(out) == counts(local_out)
    assert sorted(p.name for p in out.rglob("*part-*")) == sorted(p.name for p in local_out.rglob("*part-*"))
    assert_valid(out)


# ---------------------------------------------------------------- incremental reruns, config policy


def test_incremental_rerun_processes_only_the_new_file(tmp_path, lines, tokenizer_dir):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    write_gz(src / "2024-01.jsonl.gz", lines[:60])
    write_gz(src / "2024-02.jsonl.gz", lines[60:120])
    first = run_stage(stage_for(src, tokenizer_dir), out, engine="beam", progress=False)
    assert first.shards_run == 2
    before = {m.shard: (m.inputs[0].uri, m.output_sha256) for m in read_manifests(out)}
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*")}

    again = run_stage(stage_for(src, tokenizer_dir), out, engine="beam", progress=False)
    assert again.shards_run == 0 and again.shards_done_before == 2

    write_gz(src / "2024-03.jsonl.gz", lines[120:150])  # a new day's file arrives
    third = run_stage(stage_for(src, tokenizer_dir), out, engine="beam", progress=False)
    assert (third.shards_run, third.shards_done_before, third.docs_in) == (1, 2, 150)
    after = {m.shard: (m.inputs[0].uri, m.output_sha256) for m in read_manifests(out)}
    assert {k: after[k] for k in before} == before  # old shards keep their numbers and bytes
    assert after["part-00002"][0].endswith("2024-03.jsonl.gz")
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-*") if p.name in mtimes} == mtimes
    assert_valid(out)


def test_config_change_is_refused_then_overwritten(tmp_path, inputs, tokenizer_dir):
    from entroweight.workflows.cli.main import main

    out = tmp_path / "out"
    src = inputs / "a.jsonl.gz"
    base = ["tokenize", str(src), "--tokenizer", str(tokenizer_dir), "--out", str(out), "--engine", "beam"]
    ok = CliRunner().invoke(main, [*base, "--n-ctx", "64"])
    assert ok.exit_code == 0, ok.output
    refused = CliRunner().invoke(main, [*base, "--n-ctx", "32"])
    assert refused.exit_code == 2
    assert "n_ctx: 64 -> 32" in refused.output and "--overwrite" in refused.output
    assert json.loads((out / STAGE_FILE).read_text())["config"]["n_ctx"] == 64  # nothing mixed in
    with pytest.raises(StageError, match="another config"):
        run_stage(stage_for(src, tokenizer_dir, n_ctx=32), out, engine="ray")  # refused before Ray starts
    over = CliRunner().invoke(main, [*base, "--n-ctx", "32", "--overwrite"])
    assert over.exit_code == 0, over.output
    ms = read_manifests(out)
    assert len(ms) == 1 and json.loads((out / STAGE_FILE).read_text())["config"]["n_ctx"] == 32
    assert pq.read_metadata(out / ms[0].output).num_columns > 0
    assert pq.read_table(out / ms[0].output).column("input_ids")[0].as_py().__len__() == 32
    assert_valid(out)


# ---------------------------------------------------------------- a failing shard


@pytest.fixture(scope="module")
def with_truncated(tmp_path_factory, lines) -> Path:
    """Two good files around a truncated gzip (a download cut short)."""
    d = tmp_path_factory.mktemp("truncated")
    write_gz(d / "a.jsonl.gz", lines[:40])
    blob = gzip.compress(("\n".join(lines[40:140]) + "\n").encode())
    (d / "b.jsonl.gz").write_bytes(blob[: len(blob) // 2])
    write_gz(d / "c.jsonl.gz", lines[140:180])
    return d


def failure(engine, src, out, tokenizer_dir, **options) -> StageFailed:
    with pytest.raises(StageFailed) as info:
        run_stage(stage_for(src, tokenizer_dir), out, engine=engine, progress=False, **options)
    return info.value


def test_failing_shard_same_message_on_every_engine(tmp_path, with_truncated, tokenizer_dir, ray_session):
    errors = {}
    for engine in ("local", "beam", "ray"):
        out = tmp_path / engine
        err = failure(engine, with_truncated, out, tokenizer_dir)
        assert [f.shard for f in err.failures] == ["part-00001"]
        errors[engine] = str(err)
        ms = read_manifests(out)
        assert [m.shard for m in ms] == ["part-00000", "part-00002"]  # the good shards completed
        assert_valid(out)
    assert errors["beam"] == errors["local"] == errors["ray"]
    assert "part-00001" in errors["local"] and "b.jsonl.gz" in errors["local"]
    assert "cannot read" in errors["local"]


def test_failing_shard_exits_nonzero_through_the_cli_on_ray(tmp_path, with_truncated, tokenizer_dir):
    """A fresh process: Ray starts embedded and quiet, stops after, and the exit code says 'shards failed'."""
    out = tmp_path / "out"
    proc = cli("tokenize", with_truncated, "--tokenizer", tokenizer_dir, "--out", out, "--engine", "ray")
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 1, stderr
    assert "1 shard(s) failed" in stderr and "part-00001" in stderr and "b.jsonl.gz" in stderr
    assert len(read_manifests(out)) == 2
    assert_valid(out)
    # the failed shard is retried by the next run: still failing, still named, others untouched
    proc = cli("tokenize", with_truncated, "--tokenizer", tokenizer_dir, "--out", out, "--engine", "beam")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "part-00001" in stderr


def test_ray_pool_fits_the_cluster(ray_session):
    """Actors that can never be placed would hang the run: refuse with the reason instead."""
    from entroweight.pipelines.ray import pool_size

    cpus = int(ray_session.cluster_resources()["CPU"])
    assert pool_size(ray_session, {"num_cpus": 1}, None, 100) == cpus
    assert pool_size(ray_session, {"num_cpus": 1}, 64, 100) == cpus  # capped at what fits
    assert pool_size(ray_session, {"num_cpus": 1}, None, 1) == 1  # never more than there are shards
    with pytest.raises(StageError, match="num_gpus=1 \\(the cluster has 0\\)"):
        pool_size(ray_session, {"num_cpus": 1, "num_gpus": 1}, 2, 10)


def test_beam_results_go_through_temp_location(tmp_path, inputs, tokenizer_dir, local_out):
    """As on Dataflow: the task list and results live under temp_location, are read back, then deleted."""
    temp = tmp_path / "temp"
    stage = stage_for(inputs, tokenizer_dir, shard_docs=50)
    summary = run_stage(
        stage, tmp_path / "out", engine="beam", options={"temp_location": str(temp)}, progress=False
    )
    assert summary.shards_run == 7 and counts(tmp_path / "out") == counts(local_out)
    assert temp.exists() and not any(temp.rglob("*"))  # nothing left behind
    assert_valid(tmp_path / "out")
