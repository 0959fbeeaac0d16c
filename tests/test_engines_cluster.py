"""A two-node Ray cluster on this machine, as a cluster would run the job: the same rows as local.

Each node is a `ray start --block` process in its own session; the test stops exactly those two
(SIGTERM, then SIGKILL), not `ray stop`, which would kill every Ray on the machine.
"""

from __future__ import annotations

import gzip
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from entroweight.pipelines import run_stage
from entroweight.pipelines.stage import read_manifests
from entroweight.pipelines.tokenize import TokenizeStage

RAY = str(Path(sys.executable).with_name("ray"))
# a throwaway local cluster: no token auth (Ray >= 2.5x enables it by default), loopback only
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(*args, cwd=None, env=None) -> subprocess.Popen:
    """A `ray start --block` node; `cwd`: its own working directory (nodes that share no disk)."""
    return subprocess.Popen(
        [
            RAY,
            "start",
            "--block",
            "--num-cpus",
            "1",
            "--node-ip-address",
            "127.0.0.1",
            "--disable-usage-stats",
            *args,
        ],
        env=env or ENV,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop_node(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # `ray start --block` stops its node's processes on SIGTERM
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of that session is left
    except ProcessLookupError:
        pass


def wait_for_nodes(address: str, n: int, timeout: float = 120) -> None:
    probe = f"import ray; ray.init(address={address!r}, log_to_driver=False); print(len([x for x in ray.nodes() if x['Alive']]))"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run([sys.executable, "-c", probe], env=ENV, capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
            return
        time.sleep(2)
    raise TimeoutError(f"the Ray cluster at {address} did not reach {n} nodes")


@pytest.fixture
def two_node_cluster():
    temp = tempfile.mkdtemp(prefix="ewray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    port = free_port()
    head = start_node("--head", "--port", str(port), "--include-dashboard=false", "--temp-dir", temp)
    nodes = [head]
    try:
        address = f"127.0.0.1:{port}"
        wait_for_nodes(address, 1)
        nodes.append(start_node("--address", address))
        wait_for_nodes(address, 2)
        yield address
    finally:
        for proc in reversed(nodes):
            stop_node(proc)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_two_node_ray_cluster_matches_local(tmp_path, c4_path, tokenizer_dir, two_node_cluster):
    src = tmp_path / "src"
    src.mkdir()
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(300)]
    for i in range(3):
        with gzip.open(src / f"{i}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(lines[i * 100 : (i + 1) * 100])
    args = [str(src), "--tokenizer", str(tokenizer_dir), "--n-ctx", "64", "--shard-docs", "25"]
    run_stage(
        TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=64, shard_docs=25),
        tmp_path / "local",
        progress=False,
    )

    # the job connects by address, as on a real cluster; 2 actors of 1 CPU need both nodes
    cmd = [
        sys.executable,
        "-m",
        "entroweight.workflows.cli",
        "tokenize",
        *args,
        "--out",
        str(tmp_path / "ray"),
    ]
    cmd += ["--engine", "ray", "--ray-address", two_node_cluster, "--workers", "2"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "12 shard(s) run" in proc.stdout and "300 docs in, 300 docs out" in proc.stdout

    local = {m.shard: m for m in read_manifests(tmp_path / "local")}
    remote = {m.shard: m for m in read_manifests(tmp_path / "ray")}
    assert local.keys() == remote.keys() and len(local) == 12
    for shard, m in local.items():
        assert (remote[shard].output_sha256, remote[shard].rows_out, remote[shard].docs_in) == (
            m.output_sha256,
            m.rows_out,
            m.docs_in,
        )


@pytest.mark.slow
def test_a_run_waits_for_the_nodes_it_needs_and_grows_as_more_join(tmp_path, c4_path, tokenizer_dir):
    """A real cluster whose head has no CPU for workers: the run waits (--ray-wait-nodes) until a
    node joins, starts with one worker, and adds one when a second node joins; nothing is lost."""
    # 10 files of 12 documents: a JSON-lines file is one task (read once), so 10 tasks to share out
    src = tmp_path / "src"
    src.mkdir()
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(120)]
    for i in range(10):
        with gzip.open(src / f"c4-{i:02d}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(lines[12 * i : 12 * i + 12])
    temp = tempfile.mkdtemp(prefix="ewray-", dir="/tmp")
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {**ENV, "ENTROWEIGHT_TEST_SHARD_DELAY": "2.2"}  # 10 shards: ~22 s on one worker
    # a head with no CPU for workers, as a cluster's head often is (the later --num-cpus wins)
    head = start_node(
        "--head", "--port", str(port), "--include-dashboard=false", "--temp-dir", temp, "--num-cpus", "0"
    )
    nodes = [head]
    try:
        wait_for_nodes(address, 1)
        cmd = [sys.executable, "-m", "entroweight.workflows.cli", "tokenize", str(src), "--tokenizer",
               str(tokenizer_dir), "--n-ctx", "64", "--out", str(tmp_path / "out"),
               "--engine", "ray", "--ray-address", address, "--ray-wait-nodes", "120"]  # fmt: skip
        job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(5)
        nodes.append(start_node("--address", address, env=env))
        wait_for_nodes(address, 2)
        time.sleep(4)
        nodes.append(start_node("--address", address, env=env))
        out, err = job.communicate(timeout=240)
        assert job.returncode == 0, err
        assert "10 shard(s) run" in out and "120 docs in, 120 docs out" in out
        assert "more worker(s) on nodes that joined" in err, err
    finally:
        for proc in reversed(nodes):
            stop_node(proc)
        shutil.rmtree(temp, ignore_errors=True)
