"""What every engine shares: a Stage (shard in, shard out), the plan of a run, and its results.

A Stage knows nothing of engines. The driver calls `plan_run` (which shards are done, which
to do), an engine calls `stage.setup()` once per worker and `run_task(stage, task)` per shard,
and the driver ends with `finish_run`, which raises StageFailed naming every failed shard.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from entroweight import __version__, storage
from entroweight.schemas import ShardManifest, StageRecord, config_hash
from entroweight.schemas.manifest import (
    REJECTS_DIR,
    SHARDS_FILE,
    STAGE_FILE,
    ShardInput,
    is_manifest,
    manifest_name,
)
from entroweight.storage import AnyPath, remove_stale_tmp, write_json_atomic

LOCK_FILE = ".lock"


class StageError(RuntimeError):
    """A stage cannot start (config mismatch, lock held, nothing to read); the message says what to do."""


class LockHeld(StageError):
    """Another run holds the output directory."""


class StageFailed(RuntimeError):
    """Some shards failed; completed shards stay valid and a rerun retries the failed ones."""

    def __init__(self, stage: str, failures: list[ShardResult]):
        self.failures = failures
        lines = "\n".join(f"  {r.shard}: {r.error}" for r in failures)
        super().__init__(f"{stage}: {len(failures)} shard(s) failed (rerun to retry them):\n{lines}")


@dataclass(frozen=True)
class EngineOption:
    """A knob of an engine: a keyword of its `run`, and the command-line flag that sets it
    (workflows/cli_common.py makes the flags from each engine's `OPTIONS`). `type` dict: a repeatable
    KEY=VALUE flag whose pairs make a dict."""

    flag: str
    type: type
    default: Any
    help: str


@dataclass(frozen=True)
class ShardTask:
    shard: str  # part-NNNNN
    inputs: tuple[ShardInput, ...]
    out_dir: str  # a local path or a URL (s3://...): every worker reaches it through entroweight.storage


@dataclass
class ShardResult:
    shard: str
    manifest: dict | None = None  # ShardManifest as JSON: crosses process boundaries cheaply
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Stage(ABC):
    """One shard-to-shard map. Subclasses keep heavy state (tokenizer, model) out of pickles."""

    name: str = "stage"
    #: attributes set by setup() that must not travel to workers
    _heavy: tuple[str, ...] = ()

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """Everything that changes the output bytes: its hash keys the shards."""

    @abstractmethod
    def plan_inputs(self) -> list[ShardInput]:
        """The input of each shard (driver side; cheap)."""

    def setup(self) -> None:  # noqa: B027 - optional hook
        """Load what is expensive (tokenizer, model), once per worker."""

    @abstractmethod
    def process(self, task: ShardTask) -> ShardManifest:
        """Read the shard's input, write its parquet atomically, return its manifest (not yet written)."""

    def carry(self, out_dir: AnyPath) -> None:  # noqa: B027 - optional hook
        """Write what the output directory carries besides shards (its tokenizer); driver side, each run."""

    def input_paths(self) -> list[str]:
        """The files and directories (local or URLs) this stage reads: its --out may be none of them,
        nor hold or lie inside one. Default: each input file, and the directory of one that is another
        stage's output (score reads a tokenized directory). One listing per distinct directory."""
        paths: list[str] = []
        is_stage_dir: dict[str, bool] = {}
        for inp in self.plan_inputs():
            if inp.uri.startswith("hf://"):  # read-only hub files: no --out can be among them
                continue
            paths.append(inp.uri)
            parent = inp.uri.rstrip("/").rsplit("/", 1)[0]
            if parent not in is_stage_dir:
                is_stage_dir[parent] = STAGE_FILE in storage.listing(parent)
            if is_stage_dir[parent]:
                paths.append(parent)
        return list(dict.fromkeys(paths))

    def resources(self) -> dict[str, float]:
        """What one worker needs (Ray: num_cpus / num_gpus)."""
        return {"num_cpus": 1}

    def __getstate__(self):
        state = self.__dict__.copy()
        for name in self._heavy:
            state.pop(name, None)
        return state

    @property
    def config_hash(self) -> str:
        return config_hash({"stage": self.name, **self.config()})


def manifest_path(out_dir: AnyPath, shard: str) -> AnyPath:
    return storage.path(out_dir) / manifest_name(shard)


def read_manifests(out_dir: AnyPath, names: dict[str, int] | None = None) -> list[ShardManifest]:
    """Every shard manifest of `out_dir`: one listing (or the one given), then the files in parallel."""
    names = storage.listing(out_dir) if names is None else names
    out = storage.path(out_dir)
    paths = [out / n for n in sorted(n for n in names if is_manifest(n))]
    return [ShardManifest.model_validate_json(b) for b in storage.read_many(paths)]


def check_out_dir(stage: Stage, out_dir: AnyPath, overwrite: bool = False, reads=()) -> str | None:
    """The path rule (entroweight.storage.check_output) for a stage: --out may not be, hold or lie
    inside one of the stage's inputs (with --overwrite its shards would be deleted, and a rerun would
    read its own output as input), nor another command's output unless --overwrite replaces it whole.
    `reads`: more (flag, location) pairs it reads (--quantiles-from, --tokenizer). Returns the other
    command whose output --overwrite replaces, else None."""
    pairs = [("the input", p) for p in stage.input_paths()] + list(reads)
    try:
        return storage.check_output(out_dir, pairs, stage.name, overwrite=overwrite)
    except storage.OutputRefused as e:
        raise StageError(str(e)) from None


def run_lock(out_dir: AnyPath, wait: float = 0):
    """Held by the driver for a whole run, so two overlapping runs cannot interleave shards: a file
    lock on a local --out, a lease object on an object store (entroweight.storage.lock)."""
    out = storage.path(out_dir)
    try:
        storage.check_writable(out)
        return storage.lock(out / LOCK_FILE, wait)
    except storage.LockBusy as e:
        raise LockHeld(
            f"another entroweight run holds {out_dir} (lock {LOCK_FILE}, {e}); wait for it to finish, "
            "or pass --wait SECONDS to queue behind it"
        ) from None
    except OSError as e:  # read-only, not a directory, full, no bucket: refused before anything is written
        raise StageError(f"cannot write to --out {out_dir}: {e.strerror or e}") from None


@dataclass
class RunPlan:
    stage: Stage
    out_dir: AnyPath
    todo: list[ShardTask]
    done: list[ShardManifest]
    stale: list[str] = field(default_factory=list)  # shards whose input changed: recomputed


def plan_run(
    stage: Stage, out_dir: AnyPath, overwrite: bool = False, inputs: list[ShardInput] | None = None
) -> RunPlan:
    """Which shards are done (manifest matches config and input, and its parquet is there with the
    recorded size), which to run; refuses mixed configs. It lists --out once and reads the manifests
    in parallel: no per-shard round trip, whatever the store."""
    out = storage.path(out_dir)
    storage.mkdir(out)
    if inputs is None:  # first: a missing source is the error to report, not a config clash
        inputs = stage.plan_inputs()
    record = StageRecord(
        stage=stage.name, config=stage.config(), config_hash=stage.config_hash, code_version=__version__
    )
    names = storage.listing(out)
    stage_file = out / STAGE_FILE
    if STAGE_FILE in names:
        old = StageRecord.model_validate_json(stage_file.read_bytes())
        if old.config_hash != record.config_hash or old.stage != record.stage:
            # a record without any shard (a run that failed to start) protects nothing: replace it
            if not overwrite and has_shards(out, names):
                raise StageError(_mismatch_message(out, old, record))
            for n in names:
                if n.startswith(("part-", ".part-")) or n == SHARDS_FILE:
                    storage.remove(out / n)
            for n in storage.listing(out / REJECTS_DIR):
                if n.startswith("part-"):
                    storage.remove(out / REJECTS_DIR / n)
            names = storage.listing(out)
    remove_stale_tmp(out)
    write_json_atomic(json.loads(record.model_dump_json()), stage_file)

    # Shard numbers are fixed when an input is first planned (.shards.json), so a crash, a rerun
    # or a new input file never renumbers what exists.
    registry_file = out / SHARDS_FILE
    registry: dict[str, str] = json.loads(registry_file.read_bytes()) if SHARDS_FILE in names else {}
    todo, done, stale = _sort_shards(
        inputs, registry, read_manifests(out, names), names, record.config_hash, out
    )
    write_json_atomic(registry, registry_file)
    # output of a shard killed after its parquet but before its manifest: redo it from scratch
    for task in todo:
        if manifest_name(task.shard) in names:
            storage.remove(manifest_path(out, task.shard))
    return RunPlan(stage=stage, out_dir=out, todo=todo, done=done, stale=stale)


def _sort_shards(inputs, registry: dict[str, str], manifests, names, config_hash: str, out):
    """(todo, done, stale) of `inputs`: a shard is done when its manifest has this config and this
    input and its parquet is listed with the recorded size. New inputs get the next shard numbers in
    `registry` (which the caller saves, or not for a preview)."""
    manifests = {m.shard: m for m in manifests}
    next_no = max((int(s.split("-")[1]) for s in registry.values()), default=-1) + 1
    todo, done, stale = [], [], []
    for inp in inputs:
        shard = registry.get(inp.key)
        if shard is None:
            shard = registry[inp.key] = f"part-{next_no:05d}"
            next_no += 1
        m = manifests.get(shard)
        if m is not None and m.config_hash == config_hash and _output_present(m, names):
            if list(m.inputs) == [inp]:
                done.append(m)
                continue
            stale.append(shard)  # the input file changed since: recompute
        todo.append(ShardTask(shard=shard, inputs=(inp,), out_dir=storage.key(out)))
    return todo, done, stale


def preview_run(stage: Stage, out_dir: AnyPath) -> tuple[RunPlan, str]:
    """What `plan_run` would plan, writing nothing (a dry run), and a note: a stage whose output holds
    another config plans every shard and says it needs --overwrite."""
    out = storage.path(out_dir)
    inputs = stage.plan_inputs()
    names = storage.listing(out) if out.exists() else {}
    if STAGE_FILE in names:
        old = StageRecord.model_validate_json((out / STAGE_FILE).read_bytes())
        if old.config_hash != stage.config_hash:
            tasks = [ShardTask(shard="", inputs=(inp,), out_dir=storage.key(out)) for inp in inputs]
            return RunPlan(stage, out, tasks, []), " (config changed: needs --overwrite)"
    registry = json.loads((out / SHARDS_FILE).read_bytes()) if SHARDS_FILE in names else {}
    todo, done, stale = _sort_shards(
        inputs, registry, read_manifests(out, names), names, stage.config_hash, out
    )
    return RunPlan(stage, out, todo, done, stale), ""


def _output_present(m: ShardManifest, names: dict[str, int]) -> bool:
    """The manifest's parquet is listed, with the size the manifest recorded (manifests written before
    sizes were recorded: presence alone). `verify` checks the sha256."""
    return m.output in names and (m.output_bytes is None or names[m.output] == m.output_bytes)


def has_shards(out: AnyPath, names: dict[str, int] | None = None) -> bool:
    """Whether `out` holds any shard or shard manifest (what a failed start must never delete)."""
    names = storage.listing(out) if names is None else names
    return any(n.startswith(("part-", ".part-")) for n in names)


def _mismatch_message(out: AnyPath, old: StageRecord, new: StageRecord) -> str:
    keys = sorted(set(old.config) | set(new.config))
    diff = [
        f"{k}: {old.config.get(k)!r} -> {new.config.get(k)!r}"
        for k in keys
        if old.config.get(k) != new.config.get(k)
    ]
    return (
        f"{out} holds {old.stage} output of another config ({old.config_hash}); this run's config is "
        f"{new.config_hash} ({'; '.join(diff) or 'stage changed'}). Write to a new --out directory, "
        "or pass --overwrite to delete the old shards."
    )


def run_task(stage: Stage, task: ShardTask) -> ShardResult:
    """Run one shard; any exception becomes a failed result naming the shard, never a crash of the run."""
    start = time.perf_counter()
    try:
        manifest = stage.process(task)
        manifest.seconds = round(time.perf_counter() - start, 3)
        output = storage.path(task.out_dir) / manifest.output
        with storage.open_input(output) as f:  # its size and footer, once, here: readers need no footer
            footer = pq.read_metadata(f)
            manifest.output_bytes = f.size if hasattr(f, "size") else os.fstat(f.fileno()).st_size
        manifest.output_row_groups = [footer.row_group(i).num_rows for i in range(footer.num_row_groups)]
        _test_delay()
        write_json_atomic(json.loads(manifest.model_dump_json()), manifest_path(task.out_dir, task.shard))
        return ShardResult(shard=task.shard, manifest=json.loads(manifest.model_dump_json()))
    except Exception as e:
        inputs = ", ".join(i.key for i in task.inputs)
        detail = traceback.format_exc(limit=3) if not isinstance(e, (ValueError, OSError)) else ""
        return ShardResult(
            shard=task.shard, error=f"{type(e).__name__}: {e} (input {inputs}){detail and chr(10) + detail}"
        )


def _test_delay() -> None:
    """Fault injection for the resume tests: a pause between a shard's parquet and its manifest,
    the window in which a killed run leaves the most to clean up. Unset in production."""
    delay = os.environ.get("ENTROWEIGHT_TEST_SHARD_DELAY")
    if delay:
        time.sleep(float(delay))


def reconcile_results(plan: RunPlan, results: list[ShardResult], missing_reason: str) -> list[ShardResult]:
    """One result per planned shard, in plan order. A shard the engine lost (worker or runner died)
    counts as done only if its manifest reached the disk; otherwise it fails with `missing_reason`."""
    by_shard = {r.shard: r for r in results}
    out = []
    for task in plan.todo:
        result = by_shard.get(task.shard)
        if result is None:
            try:
                manifest = ShardManifest.model_validate_json(
                    manifest_path(task.out_dir, task.shard).read_bytes()
                )
            except FileNotFoundError:
                manifest = None
            if manifest is not None and manifest.config_hash == plan.stage.config_hash:
                names = storage.listing(plan.out_dir)
                if list(manifest.inputs) == list(task.inputs) and _output_present(manifest, names):
                    result = ShardResult(task.shard, manifest=json.loads(manifest.model_dump_json()))
            if result is None:
                inputs = ", ".join(i.key for i in task.inputs)
                result = ShardResult(task.shard, error=f"{missing_reason} (input {inputs})")
        out.append(result)
    return out


@dataclass
class RunSummary:
    stage: str
    out_dir: str
    shards_done_before: int
    shards_run: int
    docs_in: int
    rows_out: int
    rejected: dict[str, int]
    n_real_tokens: int
    seconds: float
    docs_out: int = 0  # documents written (a long one may fill several rows): docs_in = docs_out + rejected
    truncated: int = 0  # documents cut to n_ctx (tokenize --overflow truncate) ...
    bytes_dropped: int = 0  # ... and the bytes of text they lost

    def line(self) -> str:
        rej = sum(self.rejected.values())
        if self.shards_run == 0:
            return f"{self.stage}: nothing to do, all {self.shards_done_before} shard(s) of {self.out_dir} are up to date"
        cut = (
            f"; {self.truncated} docs truncated, {self.bytes_dropped} bytes of text dropped"
            if self.truncated
            else ""
        )
        return (
            f"{self.stage}: {self.shards_run} shard(s) run, {self.shards_done_before} already done; "
            f"{self.docs_in} docs in, {self.docs_out} docs out in {self.rows_out} rows, {rej} rejected {dict(self.rejected) if rej else ''}"
            f"{cut}; {self.n_real_tokens} tokens in {self.seconds:.1f} s -> {self.out_dir}"
        ).replace("  ", " ")


def finish_run(plan: RunPlan, results: list[ShardResult], seconds: float) -> RunSummary:
    failures = [r for r in results if not r.ok]
    if failures:
        raise StageFailed(plan.stage.name, failures)
    manifests = plan.done + [ShardManifest.model_validate(r.manifest) for r in results]
    rejected: dict[str, int] = {}
    for m in manifests:
        for k, v in m.rejected.items():
            rejected[k] = rejected.get(k, 0) + v
    return RunSummary(
        stage=plan.stage.name,
        out_dir=str(plan.out_dir),
        shards_done_before=len(plan.done),
        shards_run=len(results),
        docs_in=sum(m.docs_in for m in manifests),
        rows_out=sum(m.rows_out for m in manifests),
        docs_out=sum(m.docs_out for m in manifests),
        rejected=rejected,
        n_real_tokens=sum(m.n_real_tokens for m in manifests),
        seconds=seconds,
        truncated=sum(m.extra.get("n_truncated", 0) for m in manifests),
        bytes_dropped=sum(m.extra.get("bytes_dropped", 0) for m in manifests),
    )
