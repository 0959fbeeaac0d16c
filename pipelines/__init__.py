"""Stages and the engines that run them: `local` (in process), `beam` (Apache Beam), `ray`."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from entroweight.transforms.writer import remove_stale_tmp

from .stage import LockHeld, RunSummary, Stage, StageError, StageFailed, plan_run, run_lock

ENGINES = ("local", "beam", "ray")
# The optional engines: the module each imports, installed by the extra of the engine's name.
OPTIONAL_ENGINES = {"beam": "apache_beam", "ray": "ray"}


def require_engine(engine: str) -> None:
    """Refuse an unknown engine, or an optional one whose library is not installed, before any work."""
    if engine not in ENGINES:
        raise StageError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    module = OPTIONAL_ENGINES.get(engine)
    # find_spec, not import: importing Beam takes seconds and logs; the engine imports it when it runs
    if module and importlib.util.find_spec(module) is None:
        raise StageError(
            f"--engine {engine} needs {module}, which is not installed: pip install 'entroweight[{engine}]'"
        )


def run_stage(
    stage: Stage,
    out_dir: str | Path,
    engine: str = "local",
    overwrite: bool = False,
    wait: float = 0,
    progress: bool = True,
    **engine_options,
) -> RunSummary:
    """Plan, run the pending shards on `engine`, and summarize. Raises StageFailed naming bad shards."""
    from .stage import finish_run

    require_engine(engine)
    lock = run_lock(out_dir, wait)
    try:
        plan = plan_run(stage, out_dir, overwrite=overwrite)
        stage.carry(plan.out_dir)
        start = time.perf_counter()
        if not plan.todo:
            results = []
        elif engine == "local":
            from .local import run_local

            results = run_local(plan, progress=progress)
        elif engine == "beam":
            from .beam import run_beam

            results = run_beam(plan, progress=progress, **engine_options)
        else:
            from .ray import run_ray

            results = run_ray(plan, progress=progress, **engine_options)
        # A worker that died mid-shard (SIGKILL, OOM) left its temp file; we hold the lock and the
        # engine is done, so nothing else writes here: clear them now rather than at the next run.
        remove_stale_tmp(out_dir)
        return finish_run(plan, results, time.perf_counter() - start)
    finally:
        lock.release()


__all__ = [
    "ENGINES",
    "LockHeld",
    "RunSummary",
    "Stage",
    "StageError",
    "StageFailed",
    "require_engine",
    "run_stage",
]
