"""The Ray pool waits for the nodes a worker needs and grows as nodes join (issue 18, "Placement and
survival"). The cluster is a stand-in whose resources change over time: what `ray.cluster_resources()`
reports as GPU nodes start."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from entroweight.pipelines import StageError
from entroweight.pipelines import ray as engine
from entroweight.workflows.cli.main import main

GPU_WORKER = {"num_cpus": 4, "num_gpus": 1}


def cluster(*states):
    """A cluster whose resources are each of `states` in turn (the last one stays)."""
    seen = list(states)
    return SimpleNamespace(cluster_resources=lambda: seen.pop(0) if len(seen) > 1 else seen[0])


def test_a_run_waits_for_gpu_nodes_that_are_starting():
    starting = cluster({"CPU": 8}, {"CPU": 8}, {"CPU": 16, "GPU": 1}, {"CPU": 32, "GPU": 4})
    assert engine.pool_size(starting, GPU_WORKER, None, 10, wait_nodes=5, poll=0.01) == 1


def test_no_gpu_node_in_time_is_refused_and_says_how_to_wait():
    with pytest.raises(StageError, match="--ray-wait-nodes"):
        engine.pool_size(cluster({"CPU": 8}), GPU_WORKER, None, 10)
    with pytest.raises(StageError, match=r"num_gpus=1 \(the cluster has 0\).*waited 0.05 s"):
        engine.pool_size(cluster({"CPU": 8}), GPU_WORKER, None, 10, wait_nodes=0.05, poll=0.01)


def test_the_pool_grows_as_nodes_join_up_to_the_backlog():
    joined = cluster({"CPU": 64, "GPU": 4})
    assert engine._grow(joined, GPU_WORKER, n_actors=1, n_pending=20) == 3  # room for 4: 3 more
    assert engine._grow(joined, GPU_WORKER, n_actors=1, n_pending=2) == 1  # 2 shards: one more actor
    assert engine._grow(joined, GPU_WORKER, n_actors=4, n_pending=20) == 0  # full
    assert engine._grow(joined, GPU_WORKER, n_actors=1, n_pending=0) == 0  # nothing waits
    assert engine._grow(cluster({"CPU": 64}), GPU_WORKER, n_actors=0, n_pending=5) == 0


def test_the_cli_takes_ray_wait_nodes():
    res = CliRunner().invoke(main, ["tokenize", "--help"])
    assert "--ray-wait-nodes" in res.output
