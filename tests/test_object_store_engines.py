"""The engines with every path on object storage (issue 16, "clusters without a shared disk"): Beam's
task list and results go through the store too, in a directory of the run's own; on the loopback S3
server (tests/s3server.py)."""

from __future__ import annotations

import pytest
from test_object_store import parquet_bytes, s3fs, tokenize

from entroweight import storage


@pytest.mark.slow
def test_beam_multi_processing_on_s3_matches_local(tmp_path, s3_bucket, c4_60, tokenizer_dir):
    s3fs().put(str(c4_60), f"{s3_bucket}/raw/c4.jsonl.gz")
    s3fs().put(str(tokenizer_dir / "tokenizer.json"), f"{s3_bucket}/tok/tokenizer.json")
    tokenize(c4_60, tokenizer_dir, tmp_path / "local")
    out = f"{s3_bucket}/tokens"
    summary = tokenize(
        f"{s3_bucket}/raw/c4.jsonl.gz", f"{s3_bucket}/tok/tokenizer.json", out, engine="beam", workers=2
    )
    assert summary.shards_run == 3
    assert parquet_bytes(out) == parquet_bytes(tmp_path / "local")
    assert not storage.walk(f"{out}/.engine")  # the run's task list and results are gone


def test_beam_leaves_other_runs_in_a_shared_temp_location_alone(s3_bucket, c4_60, tokenizer_dir):
    temp = f"{s3_bucket}/beam-temp"
    other = f"{temp}/.engine/beam-another-run/tasks.jsonl"  # a concurrent run's task list
    storage.write_text_atomic('{"shard": "part-00000"}\n', other)
    summary = tokenize(
        c4_60, tokenizer_dir, f"{s3_bucket}/tokens", engine="beam", options={"temp_location": temp}
    )
    assert summary.shards_run == 3
    assert storage.path(other).read_text() == '{"shard": "part-00000"}\n'
    assert list(storage.walk(temp)) == [".engine/beam-another-run/tasks.jsonl"]  # ours is gone


@pytest.mark.slow
def test_two_node_ray_cluster_with_no_shared_disk_matches_local(tmp_path, s3_bucket, c4_60, tokenizer_dir):
    """Two Ray nodes, each started in a working directory of its own, the driver in a third; the
    documents, the tokenizer and --out on S3: the same bytes as a local run."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from test_engines_cluster import ENV, free_port, start_node, stop_node, wait_for_nodes

    s3fs().put(str(c4_60), f"{s3_bucket}/raw/c4.jsonl.gz")
    s3fs().put(str(tokenizer_dir / "tokenizer.json"), f"{s3_bucket}/tok/tokenizer.json")
    tokenize(c4_60, tokenizer_dir, tmp_path / "local")

    env = {**ENV, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")}}
    dirs = [tmp_path / name for name in ("head", "worker", "driver")]
    for d in dirs:
        d.mkdir()
    temp = tempfile.mkdtemp(prefix="ewray-", dir="/tmp")
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes = [
        start_node(
            "--head",
            "--port",
            str(port),
            "--include-dashboard=false",
            "--temp-dir",
            temp,
            cwd=dirs[0],
            env=env,
        )
    ]
    try:
        wait_for_nodes(address, 1)
        nodes.append(start_node("--address", address, cwd=dirs[1], env=env))
        wait_for_nodes(address, 2)
        out = f"{s3_bucket}/tokens"
        cmd = [
            sys.executable,
            "-m",
            "entroweight.workflows.cli",
            "tokenize",
            f"{s3_bucket}/raw/",
            "--tokenizer",
            f"{s3_bucket}/tok/tokenizer.json",
            "--n-ctx",
            "64",
            "--shard-docs",
            "20",
            "--overflow",
            "truncate",
            "--out",
            out,
            "--engine",
            "ray",
            "--ray-address",
            address,
            "--workers",
            "2",
        ]
        proc = subprocess.run(cmd, env=env, cwd=dirs[2], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "3 shard(s) run" in proc.stdout
        assert parquet_bytes(out) == parquet_bytes(tmp_path / "local")
    finally:
        for node in reversed(nodes):
            stop_node(node)
        shutil.rmtree(temp, ignore_errors=True)
    for d in dirs:  # nothing was written to any node's or the driver's working directory
        assert not any(d.iterdir()), list(d.iterdir())


@pytest.mark.slow
def test_sigkill_mid_run_on_s3_then_rerun_gives_the_same_rows(tmp_path, s3_bucket, c4_60, tokenizer_dir):
    """Killed between a shard's parquet and its manifest, with another worker's multipart upload left
    open: the rerun redoes what has no manifest, and the output is the local run's, row for row."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from entroweight.pipelines.stage import read_manifests
    from entroweight.pipelines.verify import verify_dir

    tokenize(c4_60, tokenizer_dir, tmp_path / "local")
    out = f"{s3_bucket}/tokens"
    args = [
        sys.executable,
        "-m",
        "entroweight.workflows.cli",
        "tokenize",
        str(c4_60),
        "--tokenizer",
        str(tokenizer_dir),
        "--n-ctx",
        "64",
        "--shard-docs",
        "20",
        "--overflow",
        "truncate",
        "--out",
        out,
    ]
    env = {**os.environ, "ENTROWEIGHT_TEST_SHARD_DELAY": "1.0"}
    proc = subprocess.Popen(
        args, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120

    def first_part_written() -> bool:
        return any(n.startswith("part-") and n.endswith(".parquet") for n in storage.listing(out))

    while time.monotonic() < deadline and not first_part_written():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the parquet is there, its manifest not yet
    proc.wait()
    assert len(read_manifests(out)) < 3
    partial = storage.AtomicFile(f"{out}/part-00002.parquet")  # a dead worker's open multipart upload
    partial.write(b"x" * (6 << 20))
    partial.file.flush()
    assert "part-00002.parquet" not in storage.listing(out)  # invisible until completed

    rerun = subprocess.run(args, capture_output=True, text=True, env=os.environ.copy())
    assert rerun.returncode == 0, rerun.stderr
    assert parquet_bytes(out) == parquet_bytes(tmp_path / "local")
    assert verify_dir(out) == []
    assert sum(m.docs_in for m in read_manifests(out)) == 60
