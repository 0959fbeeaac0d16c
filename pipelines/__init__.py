"""Stages and the engines that run them: `local` (in process), `beam` (Apache Beam), `ray`."""

from __future__ import annotations

import time
from pathlib import Path

from entroweight.transforms.writer import remove_stale_tmp

from .stage import LockHeld, RunSummary, Stage, StageError, StageFailed, plan_run, run_lock

ENGINES = ("local", "beam", "ray")


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

    if engine not in ENGINES:
        raise StageError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
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


__all__ = ["ENGINES", "LockHeld", "RunSummary", "Stage", "StageError", "StageFailed", "run_stage"]
