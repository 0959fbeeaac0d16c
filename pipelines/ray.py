"""The Ray engine: shards dispatched to a pool of actors, on a local Ray or a cluster.

Each actor calls `stage.setup()` once in its constructor (the tokenizer or model loads once per
actor, not once per shard) and then runs shards with `run_task`, which never raises. Actors ask
Ray for `stage.resources()` (a scoring stage: {"num_cpus": 1, "num_gpus": 1}); the pool has
`workers` actors, or as many as the cluster's resources fit. The driver keeps a few shards in
flight per actor and collects every ShardResult; an actor that dies fails its shard, naming it.

Embedded default: `ray.init()` in this process sized to the machine, shut down after the run;
`address` (e.g. "10.0.0.1:6379" or "auto") connects to a running cluster and leaves it up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time

from tqdm.auto import tqdm

from .stage import (
    EngineOption,
    RunPlan,
    ShardResult,
    Shuffle,
    Stage,
    StageError,
    reconcile_results,
    run_task,
)

OPTIONS = {
    "address": EngineOption(
        "--ray-address",
        str,
        None,
        "Ray cluster address (HOST:PORT or auto; default: a local Ray in process).",
    ),
    "workers": EngineOption(
        "--workers", int, None, "actors in the pool (default: as many as the cluster's resources fit)."
    ),
    "wait_nodes": EngineOption(
        "--ray-wait-nodes",
        float,
        0,
        "Wait up to SECONDS for nodes with what a worker needs (GPU nodes still starting) before "
        "refusing; the pool also grows as nodes join.",
    ),
}

IN_FLIGHT_PER_ACTOR = 2  # one running, one queued: no idle gap between shards, little memory
GROW_EVERY = 10.0  # seconds between looks at the cluster for nodes that joined
# an actor lost with its node (preemption) restarts elsewhere and its shard runs again: shard outputs
# are written atomically, so a retried shard is the same shard; -1 would retry forever
MAX_RESTARTS = 3
MAX_TASK_RETRIES = 3


def actor_options(resources: dict[str, float]) -> dict:
    """What each actor asks Ray for: the stage's resources (a scoring stage on CUDA: one GPU per actor,
    so one model per accelerator) and how it survives a lost node."""
    return {**resources, "max_restarts": MAX_RESTARTS, "max_task_retries": MAX_TASK_RETRIES}


QUIET_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no phone-home (offline machines, CI)
    "RAY_DEDUP_LOGS": "0",
}


class ShardWorker:
    """The actor: one loaded stage, many shards. Decorated with ray.remote at run time."""

    def __init__(self, stage: Stage, env: dict[str, str]):
        os.environ.update(env)  # before setup(): thread pools read it when they start
        if env.get("OMP_NUM_THREADS"):
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        self.stage = stage
        stage.setup()

    def run(self, task) -> ShardResult:
        return run_task(self.stage, task)

    def pid(self) -> int:
        return os.getpid()


def start_ray(address: str | None):
    """Connect to `address`, or start Ray in process; returns (ray module, whether we started it)."""
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    import ray

    if ray.is_initialized():
        return ray, False
    common = dict(
        log_to_driver=False,  # worker logs stay in Ray's session dir; failures come back as results
        logging_level=logging.ERROR,
        include_dashboard=False,
        ignore_reinit_error=True,
    )
    if address:
        _reachable(address)
        try:
            ray.init(address=address, **common)
        except (
            ValueError,
            ConnectionError,
            RuntimeError,
            SystemExit,
        ) as e:  # Ray exits when GCS never answers
            raise StageError(f"cannot connect to the Ray cluster at --ray-address {address}: {e}") from None
    else:
        ray.init(num_cpus=_machine_cpus(), **common)
    return ray, True


def _reachable(address: str, timeout: float = 5.0) -> None:
    """A HOST:PORT that does not answer is refused at once: ray.init would retry for two minutes
    and then exit the process. ("auto" and other forms are left to Ray.)"""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        if address != "auto":
            raise StageError(f"--ray-address takes HOST:PORT (e.g. 10.0.0.1:6379) or auto, not {address!r}")
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise StageError(
            f"cannot reach the Ray cluster at --ray-address {address} ({e.strerror or e}); "
            "is `ray start --head` running there?"
        ) from None


def _machine_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pool_size(
    ray,
    resources: dict[str, float],
    workers: int | None,
    n_tasks: int,
    wait_nodes: float = 0,
    poll: float = 2,
) -> int:
    """`workers`, or as many actors as the cluster's resources fit; never more than fit, or than there
    are shards. A cluster without room for one actor (its GPU nodes still starting) is polled for up
    to `wait_nodes` seconds, then refused: an actor that can never be placed would hang the run."""
    deadline = time.monotonic() + wait_nodes
    while True:
        fits, short = _fits(ray, resources)
        if not short:
            break
        if time.monotonic() >= deadline:
            waited = (
                f" (waited {wait_nodes:g} s for them)"
                if wait_nodes
                else "; or pass --ray-wait-nodes SECONDS to wait for nodes that are starting"
            )
            raise StageError(
                f"each worker of this stage needs {', '.join(short)}; add such nodes to the Ray cluster, "
                f"or run the stage on a device that is there (e.g. CPU){waited}"
            )
        time.sleep(max(0.0, min(poll, deadline - time.monotonic())))
    most = min(fits.values(), default=n_tasks)
    return max(1, min(workers or most, most, n_tasks))


def _fits(ray, resources: dict[str, float]) -> tuple[dict[str, int], list[str]]:
    """How many actors each resource of the cluster fits now, and what it lacks for even one."""
    total = ray.cluster_resources()
    names = {"num_cpus": "CPU", "num_gpus": "GPU"}
    fits = {k: int(total.get(names.get(k, k), 0) // v) for k, v in resources.items() if v}
    short = [
        f"{k}={resources[k]:g} (the cluster has {total.get(names.get(k, k), 0):g})"
        for k, n in fits.items()
        if n == 0
    ]
    return fits, short


def actor_env(resources: dict[str, float]) -> dict[str, str]:
    """Thread pools sized to the actor's CPUs, so N actors on one node do not oversubscribe it."""
    cpus = max(1, int(resources.get("num_cpus", 1)))
    return {
        "RAYON_NUM_THREADS": str(cpus),
        "TOKENIZERS_PARALLELISM": "true" if cpus > 1 else "false",
        "OMP_NUM_THREADS": str(cpus),
    }


@contextlib.contextmanager
def session(address: str | None = None, **options):
    """A cluster at `address` is connected before the run is planned, so that one that cannot be reached
    is refused before --out is written, and disconnected after. The embedded Ray starts in `run`:
    not at all when every shard is done."""
    ray, started = start_ray(address) if address else (None, False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def run(
    plan: RunPlan,
    address: str | None = None,
    workers: int | None = None,
    progress: bool = True,
    wait_nodes: float = 0,
) -> list[ShardResult]:
    ray, started = start_ray(address)
    try:
        return _run_pool(ray, plan, workers, progress, embedded=not address, wait_nodes=wait_nodes)
    finally:
        if started:
            ray.shutdown()


def shuffle(
    job: Shuffle, out_dir=None, address: str | None = None, workers: int | None = None, progress=True, **_
) -> list:
    """A whole-input plan (`Stage.whole_plan`) as Ray tasks: a map task per item returns one object per
    partition (`num_returns`), and a group task per partition takes that partition's object of every
    map: Ray's object store is the shuffle, and a partition's tables meet in one worker alone."""
    ray, started = start_ray(address)
    try:
        parts = job.parts
        mapper = ray.remote(_map_parts).options(num_returns=parts, num_cpus=1)
        grouper = ray.remote(_group_part).options(num_cpus=1)
        maps = [mapper.remote(job.map, item, parts) for item in job.items]
        maps = [m if parts > 1 else [m] for m in maps]  # one return: a ref, not a list of one
        groups = [grouper.remote(job.group, p, *[m[p] for m in maps]) for p in range(parts)]
        return [t for t in ray.get(groups) if t is not None]
    finally:
        if started:
            ray.shutdown()


def _map_parts(map_fn, item: str, parts: int):
    """A map task: its tables by partition, one return each (None where it gives a partition nothing)."""
    out = [None] * parts
    for part, table in map_fn(item):
        out[part] = table
    return tuple(out) if parts > 1 else out[0]


def _group_part(group_fn, part: int, *tables):
    """A group task: one partition's tables from every map."""
    tables = [t for t in tables if t is not None]
    return group_fn(part, tables) if tables else None


def _run_pool(
    ray, plan: RunPlan, workers: int | None, progress: bool, embedded: bool, wait_nodes: float = 0
) -> list[ShardResult]:
    stage = plan.stage
    resources = {k: v for k, v in stage.resources().items() if v}
    n = pool_size(ray, resources, workers, len(plan.todo), wait_nodes)
    # a cluster's pool grows as nodes join (unless --workers fixes it); our own Ray never changes
    grows = workers is None and not embedded
    if embedded and workers:
        # our own Ray on this machine: the actors share its cores (a stage's thread pools use them)
        resources["num_cpus"] = max(resources.get("num_cpus", 1), _machine_cpus() // n)
    actor_cls = ray.remote(ShardWorker).options(**actor_options(resources))
    stage_ref = ray.put(stage)  # pickled once (heavy state dropped), shared by all actors
    env = actor_env(resources)
    actors = [actor_cls.remote(stage_ref, env) for _ in range(n)]
    pending = list(plan.todo)[::-1]
    in_flight: dict = {}  # ObjectRef -> (task, actor)
    results: list[ShardResult] = []
    idle = [a for a in actors for _ in range(IN_FLIGHT_PER_ACTOR)]
    start, docs, tokens, looked = time.perf_counter(), 0, 0, time.monotonic()
    with plan.progress(f"ray x{n}", disable=not progress) as bar:
        while pending or in_flight:
            while pending and idle:
                task, actor = pending.pop(), idle.pop(0)
                in_flight[actor.run.remote(task)] = (task, actor)
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=GROW_EVERY if grows else None)
            if grows and time.monotonic() - looked >= GROW_EVERY:  # have nodes joined? more actors
                looked = time.monotonic()
                new = _grow(ray, resources, len(actors), len(pending))
                for _ in range(new):
                    actor = actor_cls.remote(stage_ref, env)
                    actors.append(actor)
                    idle += [actor] * IN_FLIGHT_PER_ACTOR
                if new:
                    bar.set_description(f"{stage.name} (ray x{len(actors)})")
                    tqdm.write(
                        f"ray: {new} more worker(s) on nodes that joined, {len(actors)} in all",
                        file=sys.stderr,
                    )
            if not ready:
                continue
            ref = ready[0]
            task, actor = in_flight.pop(ref)
            try:
                result = ray.get(ref)
                idle.append(actor)
            except Exception as e:  # the actor died (OOM, node lost) or could not start (setup failed)
                result = ShardResult(task.shard, error=_actor_error(e, task))
            results.append(result)
            docs += sum(m["docs_in"] for m in result.manifests)
            tokens += sum(m["n_real_tokens"] for m in result.manifests)
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(
                docs=docs, tok_s=f"{tokens / elapsed:,.0f}", failed=sum(not r.ok for r in results)
            )
            bar.update()
            if not idle and not in_flight and pending:  # every actor is dead: fail what is left
                break
    for actor in actors:
        ray.kill(actor)
    return reconcile_results(plan, results, "not run: every Ray actor died")


def _grow(ray, resources: dict[str, float], n_actors: int, n_pending: int) -> int:
    """How many actors to add: as many more as the cluster now fits, no more than the waiting shards
    need (each actor keeps IN_FLIGHT_PER_ACTOR of them)."""
    if not n_pending:
        return 0
    fits, short = _fits(ray, resources)
    if short:
        return 0
    want = n_actors + -(-n_pending // IN_FLIGHT_PER_ACTOR)
    return max(0, min(min(fits.values(), default=0), want) - n_actors)


def _actor_error(e: Exception, task) -> str:
    inputs = ", ".join(i.key for i in task.inputs)
    cause = getattr(e, "cause", None) or e
    first = str(cause).strip().splitlines()[-1] if str(cause).strip() else ""
    return f"Ray worker failed: {type(cause).__name__}: {first} (input {inputs})"
