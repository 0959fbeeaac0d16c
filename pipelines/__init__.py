"""Stages and the engines that run them: `local` (in process), `beam` (Apache Beam), `ray`."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import time
from types import ModuleType

from entroweight import storage
from entroweight.storage import AnyPath, remove_stale_tmp

from .stage import (
    Judged,
    LockHeld,
    RunSummary,
    Stage,
    StageError,
    StageFailed,
    has_shards,
    plan_past_damage,
    run_lock,
)

# Each engine is the module of its name beside this one: `OPTIONS` (its knobs: EngineOption per keyword
# of `run`), `run(plan, progress, **options) -> list[ShardResult]`, `shuffle(job, out_dir, **options)` (a
# whole-input plan's map and group, `stage.Shuffle`, on the engine's own shuffle) and, where it has something to set up
# before the run is planned and to tear down after, `session(**options)` (a context manager).
# The table gives each engine the library it needs, installed by the extra of the engine's name.
ENGINES = {"local": None, "beam": "apache_beam", "ray": "ray"}


def engine_module(engine: str) -> ModuleType:
    """The engine's module; importing it imports no engine library (that happens when it runs)."""
    return importlib.import_module(f"{__name__}.{engine}")


def require_engine(engine: str) -> None:
    """Refuse an unknown engine, or an optional one whose library is not installed, before any work."""
    if engine not in ENGINES:
        raise StageError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    library = ENGINES[engine]
    # find_spec, not import: importing Beam takes seconds and logs; the engine imports it when it runs
    if library and importlib.util.find_spec(library) is None:
        raise StageError(
            f"--engine {engine} needs {library}, which is not installed: pip install 'entroweight[{engine}]'"
        )


def run_stage(
    stage: Stage,
    out_dir: AnyPath,
    engine: str = "local",
    overwrite: bool = False,
    wait: float = 0,
    progress: bool = True,
    reads=(),
    judged: Judged | None = None,
    **engine_options,
) -> RunSummary:
    """Plan, run the pending shards on `engine`, and summarize. Raises StageFailed naming bad shards.

    Everything that can refuse the run (an --out among the inputs, an unreadable source or hub
    dataset, a Ray cluster that cannot be reached, a read-only --out) is checked before --out is
    written; a directory this call created for a run that then could not start is removed. The path
    rule is asked once: here, or by the caller that asked it before building the stage (`judged`,
    `stage.judge_out`'s verdict: `reads` then go unused)."""
    from .stage import check_out_dir, finish_run

    require_engine(engine)
    foreign = (judged or check_out_dir(stage, out_dir, overwrite, reads, wait)).replaces
    inputs = stage.plan_inputs()
    module = engine_module(engine)
    with getattr(module, "session", _no_session)(**engine_options):
        out_dir = storage.path(out_dir)  # a local path or a URL (s3://, gs://, memory://)
        created = not out_dir.exists() if storage.is_local(out_dir) else not storage.listing(out_dir)
        created = created or bool(foreign)  # replaced whole: a run refused before any shard leaves none
        lock = run_lock(out_dir, wait)  # first: the other command may be writing there now
        try:
            if foreign:  # another command's output, which --overwrite replaces whole (never mixed into)
                storage.clear_output(out_dir)  # all but the lock this run holds
            # a whole-input plan (tokenize's duplicate ids) runs on the engine too, on its own shuffle
            shuffle = functools.partial(module.shuffle, out_dir=out_dir, **engine_options)
            plan = plan_past_damage(stage, out_dir, overwrite=overwrite, inputs=inputs, shuffle=shuffle)
            start = time.perf_counter()
            results = module.run(plan, progress=progress, **engine_options) if plan.todo else []
            # A worker that died mid-shard (SIGKILL, OOM) left its temp file; we hold the lock and the
            # engine is done, so nothing else writes here: clear them now rather than at the next run.
            remove_stale_tmp(out_dir)
            try:  # after the shards: a full disk fails them first, each named, and a rerun writes it
                stage.carry(plan.out_dir)
                carry_error = None
            except OSError as e:
                carry_error = f"cannot write what {plan.out_dir} carries (its tokenizer): {e.strerror or e}"
            summary = finish_run(plan, results, time.perf_counter() - start)  # raises for failed shards
            if carry_error:
                raise StageError(carry_error)
            return summary
        finally:
            lock.release()
            if created and not has_shards(out_dir):  # refused before any shard: leave no directory behind
                storage.remove_tree(out_dir)


def _no_session(**options):
    return contextlib.nullcontext()


__all__ = [
    "ENGINES",
    "engine_module",
    "Judged",
    "LockHeld",
    "RunSummary",
    "Stage",
    "StageError",
    "StageFailed",
    "require_engine",
    "run_stage",
]
