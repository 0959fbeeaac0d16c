"""What every engine shares: a Stage (shard in, shard out), the plan of a run, and its results.

A Stage knows nothing of engines. The driver calls `plan_run` (which shards are done, which
to do), an engine calls `stage.setup()` once per worker and `run_task(stage, task)` per shard,
and the driver ends with `finish_run`, which raises StageFailed naming every failed shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import PurePosixPath
from typing import Any

import pyarrow.parquet as pq
from tqdm.auto import tqdm

from entroweight import __version__, output, storage
from entroweight.options import setting_changes
from entroweight.schemas import ShardManifest, StageRecord, config_hash
from entroweight.schemas.datadir import DataDir, Unreadable
from entroweight.schemas.manifest import (
    DUPLICATES_KEPT,
    REJECTS_DIR,
    SHARDS_FILE,
    STAGE_FILE,
    ShardInput,
    manifest_name,
    sum_lineage,
)
from entroweight.storage import AnyPath, remove_stale_tmp, write_json_atomic

LOCK_FILE = storage.LOCK_FILE


class StageError(RuntimeError):
    """A stage cannot start (config mismatch, lock held, nothing to read); the message says what to do."""


class LockHeld(StageError):
    """Another run holds the output directory."""


class StageFailed(RuntimeError):
    """Some shards failed; completed shards stay valid and a rerun retries the failed ones."""

    def __init__(self, stage: str, failures: list[ShardResult], shards: int | None = None):
        """`shards`: how many the run has in all (done before it included), where known."""
        self.failures = failures
        lines = "\n".join(f"  {r.shard}: {r.error}" for r in failures)
        others = (
            "there were no others"
            if shards is not None and shards <= len(failures)
            else "the others are done and kept"
        )
        super().__init__(
            f"{stage}: {len(failures)} shard(s) failed; {others}. Once each cause below "
            f"is fixed (or if it was transient), a rerun retries only these:\n{lines}"
        )


@dataclass(frozen=True)
class EngineOption:
    """A knob of an engine: a keyword of its `run`, and the command-line flag that sets it
    (workflows/cli/common.py makes the flags from each engine's `OPTIONS`). `type` dict: a repeatable
    KEY=VALUE flag whose pairs make a dict."""

    flag: str
    type: type
    default: Any
    help: str


@dataclass(frozen=True)
class ShardTask:
    shard: str  # part-NNNNN, or part-NNNNN-KKKKK: the first shard of a streamed input's task
    inputs: tuple[ShardInput, ...]
    out_dir: str  # a local path or a URL (s3://...): every worker reaches it through entroweight.storage
    # a streamed input (Stage.streams): a shard is committed every `every` rows, named shard, then
    # next_shard(shard), ...; None: one shard
    every: int | None = None
    # what the stage planned over the whole input for this task's rows (`Stage.whole_plan`): (row, note)
    # pairs; tokenize: the rows that repeat a document id seen before in the run, and where it was first
    plan: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class Shuffle:
    """A map and a group over a run's whole input, which the engine runs before the shards
    (`Stage.whole_plan`; each engine's `shuffle(job, out_dir, **options)`, on its own shuffle):
    `map(item)` -> [(partition, Arrow table)] for each of `items` (lines of text), then `group(partition,
    tables)` -> an Arrow table, once per partition with all its tables; the tables it gives come back."""

    items: list[str]
    map: Callable
    group: Callable
    parts: int


def shuffle_here(job: Shuffle, out_dir: AnyPath | None = None, **_) -> list:
    """`Shuffle` in this process (the local engine's, and a preview's). One partition (an input under
    BYTES_PER_PARTITION) is grouped in memory, which grouping needs anyway; several spill each map's
    tables to a file per partition in a temporary directory, then each partition is grouped alone, so
    memory holds one partition (and one map's output), not the whole input's ids. A spill that cannot
    be written (a full disk) is a StageError naming the place, not a traceback."""
    import tempfile

    import pyarrow as pa

    if job.parts <= 1:
        held: dict[int, list] = {}
        for item in job.items:
            for part, table in job.map(item):
                held.setdefault(part, []).append(table)
        return [job.group(part, held[part]) for part in sorted(held)]
    with tempfile.TemporaryDirectory(prefix="entroweight-shuffle-") as tmp:
        writers: dict[int, Any] = {}
        try:
            for item in job.items:
                for part, table in job.map(item):
                    if part not in writers:
                        writers[part] = pa.ipc.new_stream(os.path.join(tmp, f"{part}.arrow"), table.schema)
                    writers[part].write_table(table)
        except OSError as e:
            raise StageError(
                f"the plan of duplicate ids could not write its partitions under {tmp} ({e}): free space "
                "there, or point TMPDIR at a disk with room"
            ) from None
        finally:
            for w in writers.values():
                w.close()
        out = []
        for part in sorted(writers):
            with pa.memory_map(os.path.join(tmp, f"{part}.arrow")) as f:
                out.append(job.group(part, [pa.ipc.open_stream(f).read_all()]))
        return out


@dataclass
class ShardResult:
    shard: str  # the task's (first) shard
    # one ShardManifest as JSON per shard committed (crosses process boundaries cheaply): one, or a
    # streamed task's several; a failed task keeps those it committed before it failed
    manifests: list[dict] = field(default_factory=list)
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

    _prepared: bool = False

    def prepare(self) -> None:
        """The driver's refusals (`_prepare`), once, before anything is planned or written: a
        StageError (the CLI's exit 2) whatever part of the input refused it. A stage that reads data
        calls it first in `plan_inputs`, so that its constructor stays free of I/O."""
        if not self._prepared:
            try:
                self._prepare()
            except StageError:
                raise
            except ValueError as e:  # the scorer's, the tokenizer's, the data directory's refusals
                raise StageError(str(e)) from None
            self._prepared = True

    def _prepare(self) -> None:  # noqa: B027 - optional hook
        """Check the inputs on the driver (listing, metadata, small files); raise to refuse."""

    def setup(self) -> None:  # noqa: B027 - optional hook
        """Load what is expensive (tokenizer, model), once per worker."""

    @abstractmethod
    def process(self, task: ShardTask) -> ShardManifest | Iterator[ShardManifest]:
        """Read the shard's input, write its parquet atomically, return its manifest (not yet written);
        a streamed task yields one manifest per shard, each committed before it goes on."""

    #: rows per shard of a streamed input (None: one shard per input)
    shard_rows: int | None = None

    def streams(self, inp: ShardInput) -> bool:
        """Whether `inp` is read start to end by one task that commits a shard every `shard_rows` rows
        (rows that cannot be counted without reading them all: JSON lines, compressed or not). Its
        shards are named as they are made (part-NNNNN-KKKKK), and a killed task resumes after the
        last one committed."""
        return False

    def whole_plan(self, inputs: list[ShardInput], order: list[str], shuffle) -> dict[str, list] | None:
        """What a shard holds beyond its own rows, decided over the whole input before any shard runs:
        {input uri: [(row, note), ...]} (tokenize: the rows that repeat a document id seen before in the
        run, `order` being the run's input files in their stable order), through `shuffle` (the engine's,
        a callable of a `Shuffle`). Each input records a digest of its rows' part (`ShardInput.repeats`),
        so a change redoes its shard, and each task gets its rows' part (`ShardTask.plan`). It runs only
        when a shard is to be made (or dropped); None (the default): the stage has no such plan."""
        return None

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

    def input_universe(self, planned: list[ShardInput]) -> set[str]:
        """Every input URI this stage's output may hold shards of: those planned (a stage that plans a
        part of its input, score's `limit`, says more). A committed shard of any other input is an
        orphan (`plan_run`)."""
        return {inp.uri for inp in planned}

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


def next_shard(shard: str) -> str:
    """The shard a streamed task writes after `shard`: part-NNNNN-KKKKK -> part-NNNNN-(KKKKK+1)."""
    part, base, k = shard.split("-")  # a name without KKKKK has no next: a ValueError
    return f"{part}-{base}-{int(k) + 1:05d}"


def shard_base(name: str) -> str:
    """part-NNNNN of a shard's file names (part-NNNNN[-KKKKK].parquet, .part-....manifest.json)."""
    return "-".join(name.lstrip(".").split("-", 2)[:2]).split(".", 1)[0]


def manifest_path(out_dir: AnyPath, shard: str) -> AnyPath:
    return storage.path(out_dir) / manifest_name(shard)


def read_manifests(out_dir: AnyPath, names: dict[str, int] | None = None) -> list[ShardManifest]:
    """Every shard manifest of `out_dir`, whatever its config (the planner's bookkeeping): one listing
    (or the one given), then the files in parallel, through DataDir (schemas/datadir.py)."""
    return DataDir(out_dir, names).manifests


@dataclass(frozen=True)
class Judged:
    """`judge_out`'s verdict on a stage's --out: `replaces`, the other command's output --overwrite
    replaces whole (removed under the run's lock), else None."""

    replaces: str | None


def check_out_dir(
    stage: Stage, out_dir: AnyPath, overwrite: bool = False, reads=(), wait: float = 0, apart: bool = False
) -> Judged:
    """The path rule for a built stage: its inputs (`stage.input_paths()`) and `reads`, more (flag,
    location) pairs it reads (--quantiles-from, --tokenizer), as `judge_out` asks it."""
    pairs = [("the input", p) for p in stage.input_paths()] + list(reads)
    return judge_out(stage.name, out_dir, pairs, overwrite, wait, apart)


def judge_out(
    name: str, out_dir: AnyPath, reads, overwrite: bool = False, wait: float = 0, apart: bool = False
) -> Judged:
    """The path rule for a stage's --out, asked once per run: by `run_stage`, or first by a command
    that builds its stage after it (a model named, a tokenizer loaded), which hands the verdict to
    `run_stage`. In order: a run writing there now (LockHeld, exit 3: its files are not yet marked
    as its output), a glob read that may match it, `output.check_output` (--out may not be, hold or
    lie inside what it reads: with --overwrite its shards would be deleted, and a rerun would read
    its own output; nor another command's output unless --overwrite replaces it whole; `apart`, a
    command run by hand: nor lie inside another command's output), and an --out on an object store
    writable now, not after the work."""
    from entroweight.transforms.sources import check_globs_apart

    try:
        storage.wait_unheld(out_dir, wait)
    except storage.OutputHeld as e:
        raise LockHeld(str(e)) from None
    try:
        check_globs_apart(out_dir, reads, name)
        foreign = output.check_output(out_dir, reads, name, overwrite=overwrite, apart=apart)
    except (storage.OutputRefused, storage.StorageError) as e:
        raise StageError(str(e)) from None
    if storage.is_url(out_dir):  # no bucket, no credentials: now, not after the work (one probe object)
        try:
            storage.check_writable(out_dir)
        except OSError as e:
            raise StageError(f"cannot write to --out {out_dir}: {e.strerror or e}") from None
    return Judged(foreign)


def run_lock(out_dir: AnyPath, wait: float = 0):
    """Held by the driver for a whole run, so two overlapping runs cannot interleave shards: a file
    lock on a local --out, a lease object on an object store (entroweight.storage.lock)."""
    out = storage.path(out_dir)
    try:
        storage.check_writable(out)
        return storage.lock(storage.lock_location(out), wait)
    except storage.LockBusy as e:
        raise LockHeld(storage.held_message(out_dir, e, wait)) from None
    except OSError as e:  # read-only, not a directory, full, no bucket: refused before anything is written
        raise StageError(f"cannot write to --out {out_dir}: {e.strerror or e}") from None


@dataclass
class RunPlan:
    stage: Stage
    out_dir: AnyPath
    todo: list[ShardTask]
    done: list[ShardManifest]
    stale: list[str] = field(default_factory=list)  # shards whose input changed: recomputed
    registry: dict[str, str] = field(default_factory=dict)  # .shards.json as planned
    #: (previews) shards of `todo` whose output went missing while their manifest, of this config and
    #: these inputs, stayed: a stage's output is a function of both, so their run writes what it records
    lost: list[str] = field(default_factory=list)

    def progress(self, engine: str = "", disable: bool = False):
        """Every engine's progress bar over this plan's tasks. Its unit is the input (a file, or an
        input shard): a task reads one, and a long file streamed into `--shard-docs` pieces commits
        several shards, which the run's summary counts."""
        desc = f"{self.stage.name} ({engine})" if engine else self.stage.name
        return tqdm(total=len(self.todo), unit="input", desc=desc, disable=disable)

    def remakes_as_recorded(self) -> bool:
        """Whether all this run writes is shards its manifests already record (`lost`): what reads
        the output (a model's data fingerprint, `workflows.steps`) finds it as it was."""
        return {t.shard for t in self.todo} <= set(self.lost)


def plan_run(
    stage: Stage,
    out_dir: AnyPath,
    overwrite: bool = False,
    inputs: list[ShardInput] | None = None,
    shuffle: Callable | None = None,
) -> RunPlan:
    """Which shards are done (manifest matches config and input, and its parquet is there with the
    recorded size), which to run; refuses mixed configs. It lists --out once and reads the manifests
    in parallel: no per-shard round trip, whatever the store."""
    out = storage.path(out_dir)
    storage.mkdir(out)
    if inputs is None:  # first: a missing source is the error to report, not a config clash
        inputs = stage.plan_inputs()
    record = _record_of(stage)
    names = storage.listing(out)
    stage_file = out / STAGE_FILE
    old = _other_record(out, names, record)
    if old is not None:  # another config's output: refused, or (--overwrite, or no shard) its shards go
        if not overwrite:
            _refuse_unless_overwrite(out, names, old, record, [], [])
        for n in names:
            if n.startswith(("part-", ".part-")) or n == SHARDS_FILE:
                storage.remove(out / n)
        for n in storage.listing(out / REJECTS_DIR):
            if n.startswith("part-"):
                storage.remove(out / REJECTS_DIR / n)
        names = storage.listing(out)
    manifests = _rejects_present(out, read_manifests(out, names))
    orphans, recut = _not_remade(stage, inputs, manifests, record.config_hash, names)
    if not overwrite:
        _refuse_unless_overwrite(out, names, None, record, orphans, recut, inputs)
    else:  # shards changed or damaged since their manifest (what `verify` finds) are redone
        manifests = _intact(out, manifests, record.config_hash)
    orphans += recut
    remove_stale_tmp(out)
    written = json.loads(record.model_dump_json())
    if STAGE_FILE not in names or json.loads(stage_file.read_bytes()) != written:  # a rerun touches nothing
        write_json_atomic(written, stage_file)

    # Shard numbers are fixed when an input is first planned (.shards.json), so a crash, a rerun
    # or a new input file never renumbers what exists.
    registry_file = out / SHARDS_FILE
    registry: dict[str, str] = json.loads(registry_file.read_bytes()) if SHARDS_FILE in names else {}
    planned = dict(registry) if SHARDS_FILE in names else None
    todo, done, stale, remove = _sort_whole(
        stage, inputs, registry, manifests, names, record.config_hash, out, shuffle, bool(orphans)
    )
    if orphans:  # --overwrite: the output holds this run's inputs only
        remove += [m.shard for m in orphans]
        gone = {m.shard for m in orphans}
        registry = {k: v for k, v in registry.items() if v not in gone}
    if registry != planned:
        write_json_atomic(registry, registry_file)
    # output of a shard killed after its parquet but before its manifest: redo it from scratch
    for task in todo:
        if manifest_name(task.shard) in names:
            storage.remove(manifest_path(out, task.shard))
    # a streamed input's shards past the point it resumes from: manifests first, then the data
    if remove:
        rejects = storage.listing(out / REJECTS_DIR)
        for shard in remove:
            storage.remove(manifest_path(out, shard))
        # what a committed shard wrote is what its manifest names (score's parquet is named after
        # its input, not its shard); a shard killed before its manifest wrote the default names
        outputs = {m.shard: (m.output, m.rejects_file) for m in manifests}
        for shard in remove:
            defaults = (f"{shard}.parquet", f"{REJECTS_DIR}/{shard}.parquet")
            for name in {n for n in (*defaults, *outputs.get(shard, ())) if n}:
                if name in names or name.removeprefix(f"{REJECTS_DIR}/") in rejects:
                    storage.remove(out / name)
    return RunPlan(stage=stage, out_dir=out, todo=todo, done=done, stale=stale, registry=registry)


def plan_past_damage(
    stage: Stage,
    out_dir: AnyPath,
    overwrite: bool = False,
    inputs: list[ShardInput] | None = None,
    shuffle: Callable | None = None,
) -> RunPlan:
    """`plan_run`, where --out's bookkeeping that does not parse (a shard manifest or `.shards.json`,
    changed by hand or damaged) is refused naming the file (StageError), or with --overwrite removed
    and planned again: a shard without its manifest is not done (redone, as after a crash between its
    parquet and its manifest), and a run without a registry numbers its inputs anew."""
    while True:
        try:
            return plan_run(stage, out_dir, overwrite=overwrite, inputs=inputs, shuffle=shuffle)
        except (ValueError, TypeError, AttributeError) as e:  # Unreadable (a manifest), or the registry's
            # json error or a registry of another shape: the registry read again names it, or the error stands
            damaged = e if isinstance(e, Unreadable) else _unreadable_registry(out_dir)
            if damaged is None:
                raise
            if not overwrite:
                raise StageError(str(damaged)) from None
            storage.remove(storage.path(damaged.location))


def _unreadable_registry(out_dir: AnyPath) -> Unreadable | None:
    try:
        DataDir(out_dir).registry  # noqa: B018 - read to check that it parses
    except Unreadable as e:
        return e
    return None


def _not_remade(stage: Stage, inputs, manifests, config_hash: str, names) -> tuple[list, list]:
    """Committed shards of this config that this run would not make again, kept beside its own:
    (orphans: of an input it does not read, renamed, moved or deleted since, whose documents would
    be in the output once too often or after their source is gone; recut: of a range of an input file
    it does not plan, its rows cut at other places since (`--shard-docs` changed), each row of them
    in the output twice). A streamed input resumes the shards it has (new ones take the new size),
    so only the inputs planned as row ranges can be recut."""
    read = stage.input_universe(inputs)
    planned, planned_uris = {i.key for i in inputs}, {i.uri for i in inputs}
    orphans, recut = [], []
    for m in manifests:
        if m.config_hash != config_hash or not _output_present(m, names):
            continue
        if not all(i.uri in read for i in m.inputs):
            orphans.append(m)
        elif (
            len(m.inputs) == 1
            and m.inputs[0].uri in planned_uris
            and not stage.streams(m.inputs[0])
            and m.inputs[0].key not in planned
        ):
            recut.append(m)
    return orphans, recut


def _shown(items: list[str]) -> str:
    return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def _recut_message(out: AnyPath, recut: list[ShardManifest]) -> str:
    sizes = sorted({i.stop - i.start for m in recut for i in m.inputs if i.stop is not None})
    shown = _shown(list(dict.fromkeys(i.uri for m in recut for i in m.inputs)))
    made = f" (they hold {', '.join(map(str, sizes))} rows each)" if sizes else ""
    return (
        f"{out} holds {len(recut)} shard(s) of {shown} cut at other rows than this run plans{made}: the "
        "shard size changed since (--shard-docs). Resume with the size they were made with, write to a "
        "new --out, or pass --overwrite to replace them with shards of this size"
    )


def _orphans_message(out: AnyPath, orphans: list[ShardManifest], inputs=()) -> str:
    gone = list(dict.fromkeys(i.uri for m in orphans for i in m.inputs))
    shown = _shown(gone)
    read_now = {PurePosixPath(i.uri).name: i.uri for i in inputs}
    if gone and all(PurePosixPath(u).name in read_now for u in gone):  # the same files elsewhere
        was = sorted({str(PurePosixPath(u).parent) for u in gone})
        now = sorted({str(PurePosixPath(read_now[PurePosixPath(u).name]).parent) for u in gone})
        return (
            f"{out} holds {len(orphans)} shard(s) made from {_shown(was)}, and this run reads files of "
            f"the same names in {_shown(now)}: moved or copied since (a run directory moved?); pass "
            "--overwrite to make them again from where they are now"
        )
    if any(not storage.is_url(u) and not u.startswith("hf:") and not os.path.isabs(u) for u in gone):
        # score and weigh record where they read absolutely now (pipelines/weighted.py part_locations)
        return (
            f"{out} holds {len(orphans)} shard(s) whose inputs were recorded relative to the working "
            f"directory of the run that wrote them ({shown}), by an older entroweight: it cannot tell "
            "whether this run reads them; pass --overwrite to redo those shards"
        )
    return (
        f"{out} holds {len(orphans)} shard(s) of inputs this run does not read ({shown}): renamed, moved "
        "or deleted since the run that wrote them; restore them, or pass --overwrite to drop those "
        "shards (inputs read under another name are made again from it; the others' documents leave "
        "the output)"
    )


def _sort_whole(
    stage: Stage, inputs, registry, manifests, names, config_hash: str, out, shuffle, dropping: bool
):
    """`_sort_shards`, for a stage with a plan over the whole input (`Stage.whole_plan`): first with
    the plan its committed shards record (no input read); where a shard is to be made, or shards are
    dropped (`dropping`: a first copy may go with them), the plan is made (`shuffle`, default this
    process) and the shards sorted again by it, each task with its rows' part."""
    sort = (stage, registry, manifests, names, config_hash, out)
    recorded = {}
    for m in manifests:
        for i in m.inputs if m.config_hash == config_hash else ():
            recorded[i.model_copy(update={"repeats": None})] = i.repeats
            recorded[i.model_copy(update={"repeats": None, "start": 0, "stop": None})] = i.repeats

    def as_recorded(inp: ShardInput) -> ShardInput:
        return inp.model_copy(update={"repeats": recorded.get(inp)})

    first = _sort_shards(sort[0], [as_recorded(i) for i in inputs], *sort[1:])
    if not (first[0] or dropping):
        return first
    # the run's order of files: by the shard numbers they were given (those committed first), which
    # the sort above gave the new inputs in the order planned
    number = {}
    for key, shard in registry.items():
        uri = ShardInput.parse_key(key)[0]
        number[uri] = min(number.get(uri, 1 << 62), int(shard.split("-")[1]))
    order = sorted(dict.fromkeys(i.uri for i in inputs), key=lambda u: number.get(u, 1 << 62))
    plan = stage.whole_plan(inputs, order, shuffle or shuffle_here)
    if plan is None:
        return first
    parts = {i: _in_rows(plan.get(i.uri, ()), i.start, i.stop) for i in inputs}
    todo, done, stale, remove = _sort_shards(
        sort[0], [i.model_copy(update={"repeats": _digest(parts[i])}) for i in inputs], *sort[1:]
    )
    whole = {i.uri: plan.get(i.uri, ()) for i in inputs}
    todo = [
        replace(t, plan=tuple(_in_rows(whole[t.inputs[0].uri], t.inputs[0].start, t.inputs[0].stop)))
        for t in todo
    ]
    return todo, done, stale, remove


def _in_rows(found, start: int, stop: int | None) -> list[tuple[int, str]]:
    """The (row, note) pairs of a whole-input plan among rows [start, stop) of an input."""
    return sorted(f for f in found if f[0] >= start and (stop is None or f[0] < stop))


def _digest(found: list[tuple[int, str]]) -> str | None:
    """A short digest of an input's part of a whole-input plan (`ShardInput.repeats`); None: none."""
    if not found:
        return None
    return hashlib.sha256(json.dumps(found).encode()).hexdigest()[:16]


def _sort_shards(stage: Stage, inputs, registry: dict[str, str], manifests, names, config_hash: str, out):
    """(todo, done, stale, shards to remove) of `inputs`: a shard is done when its manifest has this
    config and this input and its parquet is listed with the recorded size. New inputs get the next
    shard numbers in `registry` (which the caller saves, or not for a preview)."""
    manifests = {m.shard: m for m in manifests}
    next_no = max((int(s.split("-")[1]) for s in registry.values()), default=-1) + 1
    todo, done, stale, remove = [], [], [], []
    out_key = storage.key(out)  # once: it resolves the path
    streamed = None  # built at the first streamed input: one pass over the registry and the listing
    for inp in inputs:
        if stage.streams(inp):
            if streamed is None:
                streamed = _Streamed(registry, manifests, names)
            base = streamed.bases.get(inp.uri)
            if base is None:
                base, next_no = f"part-{next_no:05d}", next_no + 1
            task, chain, changed, dead = streamed.resume(stage, inp, base, config_hash, out_key)
            done += chain
            stale += changed
            remove += dead
            if task is not None:
                todo.append(task)
            continue
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
        todo.append(ShardTask(shard=shard, inputs=(inp,), out_dir=out_key))
    return todo, done, stale, remove


class _Streamed:
    """What planning a streamed input needs, indexed once: the shard number each file was given
    (from the registry), and the manifests and files of each number."""

    def __init__(self, registry: dict[str, str], manifests: dict[str, ShardManifest], names):
        self.registry = registry
        self.bases: dict[str, str] = {}  # uri -> part-NNNNN
        self.keys: dict[str, list[str]] = {}  # part-NNNNN -> its registry keys
        for key, shard in registry.items():
            self.bases[ShardInput.parse_key(key)[0]] = shard_base(shard)
            self.keys.setdefault(shard_base(shard), []).append(key)
        self.manifests: dict[str, list[ShardManifest]] = {}
        for m in manifests.values():
            self.manifests.setdefault(shard_base(m.shard), []).append(m)
        self.files: dict[str, list[str]] = {}
        self.names = names
        for n in names:
            if n.startswith(("part-", ".part-")):
                self.files.setdefault(shard_base(n), []).append(n)

    def resume(self, stage: Stage, inp: ShardInput, base: str, config_hash: str, out_key: str):
        """(task or None when done, its shards done, shards whose input changed, files to remove):
        the shards of `base` that chain from the input's first row on are kept; the rest is redone
        from where they end."""
        family = sorted(self.manifests.get(base, []), key=lambda m: (m.inputs[0].start, m.shard))
        chain, pos, complete, changed = [], 0, False, []
        for m in family:
            (mi,) = m.inputs
            if mi.model_copy(update={"start": 0, "stop": None}) != inp:
                changed.append(m.shard)  # the file changed since
            elif (
                not complete
                and mi.start == pos
                and m.config_hash == config_hash
                and _output_present(m, self.names)
            ):
                chain.append(m)
                pos, complete = mi.stop, mi.stop is None
        kept = {m.shard for m in chain}
        shards = {
            n.lstrip(".").removesuffix(".manifest.json").removesuffix(".parquet")
            for n in self.files.get(base, [])
        }
        dead = sorted(shards - kept)
        registered = {m.inputs[0].key: m.shard for m in chain}
        for key in self.keys.get(base, []):  # what no longer holds: a shard redone, a resume point
            if key not in registered:
                self.registry.pop(key, None)
        self.registry.update(registered)
        if complete:
            return None, chain, changed, dead
        shard = (
            next_shard(chain[-1].shard) if chain else base if stage.shard_rows is None else f"{base}-00000"
        )
        rest = inp.model_copy(update={"start": pos})
        self.registry[rest.key] = shard  # the next shard, until it is made (verify: a hole)
        task = ShardTask(shard=shard, inputs=(rest,), out_dir=out_key, every=stage.shard_rows)
        return task, chain, changed, dead


def _as_recorded(task: ShardTask, recorded: dict[str, ShardManifest], config_hash: str) -> bool:
    """Whether every shard `task` writes has a manifest of this config and of the input rows it would
    read: its output went missing, and the run writes it again as the manifest records it. A streamed
    task writes its shards in a chain from its start row to the input's end."""
    (rest,) = task.inputs if len(task.inputs) == 1 else (None,)
    if rest is None:
        return False
    whole = rest.model_copy(update={"start": 0, "stop": None})
    shard, pos = task.shard, rest.start
    while True:
        m = recorded.get(shard)
        if m is None or m.config_hash != config_hash or len(m.inputs) != 1:
            return False
        (mi,) = m.inputs
        if task.every is None:  # one shard: the input as it is now
            return mi == rest
        if mi.start != pos or mi.model_copy(update={"start": 0, "stop": None}) != whole:
            return False
        if mi.stop is None:
            return True
        shard, pos = next_shard(shard), mi.stop


def preview_run(stage: Stage, out_dir: AnyPath, overwrite: bool = False) -> tuple[RunPlan, str]:
    """What `plan_run` would plan, writing nothing (a dry run), and a note. Without `overwrite` it
    refuses what `plan_run` refuses, in the same words (`_refuse_unless_overwrite`); with it, the
    note says what --overwrite replaces."""
    out = storage.path(out_dir)
    inputs = stage.plan_inputs()
    names = storage.listing(out) if out.exists() else {}
    record = _record_of(stage)
    old = _other_record(out, names, record)
    if old is not None and has_shards(out, names):
        if not overwrite:
            _refuse_unless_overwrite(out, names, old, record, [], [])
        tasks = [ShardTask(shard="", inputs=(inp,), out_dir=storage.key(out)) for inp in inputs]
        return RunPlan(stage, out, tasks, []), " (config changed: --overwrite replaces every shard)"
    try:  # bookkeeping that does not parse: refused naming the file, as the run refuses it
        registry, manifests = DataDir(out).registry, _rejects_present(out, read_manifests(out, names))
    except Unreadable as e:
        raise StageError(str(e)) from None
    orphans, recut = _not_remade(stage, inputs, manifests, stage.config_hash, names)
    if not overwrite:
        _refuse_unless_overwrite(out, names, None, record, orphans, recut, inputs)
    else:
        manifests = _intact(out, manifests, stage.config_hash)
    todo, done, stale, _ = _sort_whole(
        stage, inputs, registry, manifests, names, stage.config_hash, out, None, bool(orphans or recut)
    )
    recorded = {m.shard: m for m in manifests}
    lost = [t.shard for t in todo if _as_recorded(t, recorded, stage.config_hash)]
    note = (
        f" ({len(orphans)} shard(s) of inputs no longer read: --overwrite removes them)"
        if orphans
        else f" ({len(recut)} shard(s) cut at other rows (--shard-docs): --overwrite re-cuts them)"
        if recut
        else ""
    )
    return RunPlan(stage, out, todo, done, stale, registry, lost), note


def _record_of(stage: Stage) -> StageRecord:
    """The stage record (`.stage.json`) a run of `stage` writes."""
    return StageRecord(
        stage=stage.name, config=stage.config(), config_hash=stage.config_hash, code_version=__version__
    )


def _other_record(out: AnyPath, names: dict[str, int], record: StageRecord) -> StageRecord | None:
    """The stage record `out` holds where it is another stage's or another config's, else None."""
    if STAGE_FILE not in names:
        return None
    old = StageRecord.model_validate_json((storage.path(out) / STAGE_FILE).read_bytes())
    return old if old.config_hash != record.config_hash or old.stage != record.stage else None


def _refuse_unless_overwrite(
    out, names, old: StageRecord | None, record: StageRecord, orphans, recut, inputs=()
) -> None:
    """What a run (and its preview) refuses without --overwrite: shards of another config (`old`; a
    record without any shard, a run that failed to start, protects nothing), shards of inputs it no
    longer reads (renamed, moved or deleted: their documents would stay), shards cut at other rows
    (the same rows would be in two shards)."""
    if old is not None and has_shards(out, names):
        raise StageError(_mismatch_message(out, old, record))
    if orphans:
        raise StageError(_orphans_message(out, orphans, inputs))
    if recut:
        raise StageError(_recut_message(out, recut))


def _intact(out: AnyPath, manifests: list[ShardManifest], config_hash: str) -> list[ShardManifest]:
    """The manifests of this config whose shard (and rejects file) still hold the bytes they record
    (their sha256), and those of other configs: a shard whose files changed is then planned as one
    without a manifest, and redone (one whose counts do not add up is refused as it is read:
    `datadir.counts_off`, which --overwrite removes). Each shard of this config is read once (in
    parallel): what --overwrite costs on an output of the same config, so that the advice of `verify`
    and of every reader that finds a damaged shard ("rerun with --overwrite") redoes it."""

    def intact(m: ShardManifest) -> bool:
        files = [(m.output, m.output_sha256)] + (
            [(m.rejects_file, m.rejects_sha256)] if m.rejects_file else []
        )
        try:
            return all(
                want is None or storage.sha256(storage.path(out) / name) == want for name, want in files
            )
        except OSError:  # missing or unreadable (StorageError is one): redone
            return False

    ours = [m for m in manifests if m.config_hash == config_hash]
    with ThreadPoolExecutor(min(8, max(1, len(ours)))) as pool:
        keep = dict(zip((id(m) for m in ours), pool.map(intact, ours), strict=True))
    return [m for m in manifests if keep.get(id(m), True)]


def _rejects_present(out: AnyPath, manifests: list[ShardManifest]) -> list[ShardManifest]:
    """The manifests but those whose rejects file (where they record one) is gone or of another size
    than recorded: such a shard is redone, as one whose parquet is, since the ids and reasons of its
    rejected documents are in no other file. One listing of `.rejects/`, only where some manifest
    records a rejects file (a manifest from before sizes were recorded: presence alone)."""
    if not any(m.rejects_file for m in manifests):
        return manifests
    listed = storage.listing(storage.path(out) / REJECTS_DIR)

    def present(m: ShardManifest) -> bool:
        size = listed.get(m.rejects_file.removeprefix(f"{REJECTS_DIR}/"))
        return size is not None and m.rejects_bytes in (None, size)

    return [m for m in manifests if not m.rejects_file or present(m)]


def _output_present(m: ShardManifest, names: dict[str, int]) -> bool:
    """The manifest's parquet is listed, with the size the manifest recorded (manifests written before
    sizes were recorded: presence alone). `verify` checks the sha256."""
    return m.output in names and (m.output_bytes is None or names[m.output] == m.output_bytes)


def has_shards(out: AnyPath, names: dict[str, int] | None = None) -> bool:
    """Whether `out` holds any shard or shard manifest (what a failed start must never delete)."""
    names = storage.listing(out) if names is None else names
    return any(n.startswith(("part-", ".part-")) for n in names)


def _mismatch_message(out: AnyPath, old: StageRecord, new: StageRecord) -> str:
    diff = setting_changes(old.config, new.config)
    if not diff and old.stage == new.stage:  # the same settings: FORMAT_VERSION changed what they write
        diff = [f"the data format changed since entroweight {old.code_version} wrote it"]
    return (
        f"{out} holds {old.stage} output of another config ({old.config_hash}); this run's config is "
        f"{new.config_hash} ({'; '.join(diff) or 'stage changed'}). Write elsewhere (another --out; in "
        "a workflow, another run_dir), or pass --overwrite to delete the old shards."
    )


def run_task(stage: Stage, task: ShardTask) -> ShardResult:
    """Run one task, committing each shard it makes; any exception becomes a failed result naming the
    shard (keeping the shards committed before it), never a crash of the run."""
    committed: list[dict] = []
    made = None
    start = time.perf_counter()
    try:
        made = stage.process(task)
        for manifest in [made] if isinstance(made, ShardManifest) else made:
            manifest.seconds = round(time.perf_counter() - start, 3)
            _commit(manifest, task.out_dir)
            committed.append(json.loads(manifest.model_dump_json()))
            start = time.perf_counter()
        return ShardResult(shard=task.shard, manifests=committed)
    except Exception as e:
        inputs = ", ".join(i.key for i in task.inputs)
        detail = traceback.format_exc(limit=3) if not isinstance(e, (ValueError, OSError)) else ""
        # a streamed task that committed shards failed in the next one: name it, and what is kept
        where = (
            f"{next_shard(committed[-1]['shard'])} failed after {len(committed)} committed: "
            if committed
            else ""
        )
        return ShardResult(
            shard=task.shard,
            manifests=committed,
            error=f"{where}{type(e).__name__}: {e} (input {inputs}){detail and chr(10) + detail}",
        )
    finally:
        if hasattr(made, "close"):  # a streamed task stopped early: its open shard is discarded
            made.close()


def _commit(manifest: ShardManifest, out_dir: str) -> None:
    """Record the shard's parquet size and row groups in its manifest and write it: the commit."""
    written = storage.path(out_dir) / manifest.output
    with storage.open_input(written) as f:  # its size and footer, once, here: readers need no footer
        footer = pq.read_metadata(f)
        manifest.output_bytes = f.size if hasattr(f, "size") else os.fstat(f.fileno()).st_size
    manifest.output_row_groups = [footer.row_group(i).num_rows for i in range(footer.num_row_groups)]
    _test_delay()
    write_json_atomic(json.loads(manifest.model_dump_json()), manifest_path(out_dir, manifest.shard))


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
    names = None
    for task in plan.todo:
        result = by_shard.get(task.shard)
        if result is None:
            names = storage.listing(plan.out_dir) if names is None else names
            committed = _committed(plan, task, names)
            result = ShardResult(task.shard, manifests=[json.loads(m.model_dump_json()) for m in committed])
            if not _covers(task, committed):
                inputs = ", ".join(i.key for i in task.inputs)
                result.error = f"{missing_reason} (input {inputs})"
        out.append(result)
    return out


def _committed(plan: RunPlan, task: ShardTask, names: dict[str, int]) -> list[ShardManifest]:
    """The shards of `task` whose manifests reached the store, in order, from its first row on."""
    (inp,) = task.inputs
    found, shard, pos = [], task.shard, inp.start
    while manifest_name(shard) in names:
        m = ShardManifest.model_validate_json(manifest_path(task.out_dir, shard).read_bytes())
        (mi,) = m.inputs
        same = mi.model_copy(update={"start": inp.start, "stop": inp.stop}) == inp
        if not (same and mi.start == pos and m.config_hash == plan.stage.config_hash):
            break
        if not _output_present(m, names):
            break
        found.append(m)
        if task.every is None or mi.stop == inp.stop:
            break
        shard, pos = next_shard(shard), mi.stop
    return found


def _covers(task: ShardTask, manifests: list[ShardManifest]) -> bool:
    """Whether the shards committed cover the task's input to its end."""
    return bool(manifests) and manifests[-1].inputs[0].stop == task.inputs[0].stop


def _register(plan: RunPlan, results: list[ShardResult]) -> None:
    """Record in .shards.json the shards streamed tasks made (their rows were unknown when planned),
    and where each stopped short resumes: verify then finds every shard registered, and a hole named."""
    by_shard = {r.shard: r for r in results}
    changed = False
    for task in plan.todo:
        result = by_shard.get(task.shard)
        if result is None or not result.manifests:
            continue
        (inp,) = task.inputs
        manifests = [ShardManifest.model_validate(m) for m in result.manifests]
        keys = {m.inputs[0].key: m.shard for m in manifests}
        if keys == {inp.key: task.shard}:
            continue  # one shard, as planned
        if plan.registry.get(inp.key) == task.shard:
            del plan.registry[inp.key]
        plan.registry.update(keys)
        if not _covers(task, manifests):  # the rest: the next shard's, until it is made
            rest = inp.model_copy(update={"start": manifests[-1].inputs[0].stop})
            plan.registry[rest.key] = next_shard(manifests[-1].shard)
        changed = True
    if changed:
        write_json_atomic(plan.registry, storage.path(plan.out_dir) / SHARDS_FILE)


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
    duplicates_kept: int = 0  # documents whose id was seen before in the run, kept (tokenize without
    # --reject-duplicates)
    note: str = ""  # what the user should know of what was kept (`_kept_size_note`)
    upstream: list[dict] = field(default_factory=list)  # the stages before (`sum_lineage`)

    def line(self) -> str:
        rej = sum(self.rejected.values())
        if self.shards_run == 0:
            return (
                f"{self.stage}: nothing to do, all {self.shards_done_before} shard(s) of {self.out_dir} are up "
                f"to date{self.note}"
            )
        cut = (
            f"; {self.truncated} docs truncated, {self.bytes_dropped} bytes of text dropped"
            if self.truncated
            else ""
        )
        cut += (
            f"; {self.duplicates_kept} docs repeat an id seen before in the input, kept (--reject-duplicates "
            "rejects them)"
            if self.duplicates_kept
            else ""
        )
        earlier = [f"{c['stage']} {sum(c['rejected'].values())}" for c in self.upstream if c["rejected"]]
        before = f"; rejected by earlier stages: {', '.join(earlier)}" if earlier else ""
        return (
            f"{self.stage}: {self.shards_run} shard(s) run, {self.shards_done_before} already done; "
            f"{self.docs_in} docs in, {self.docs_out} docs out in {self.rows_out} rows, {rej} rejected"
            f"{f' {dict(self.rejected)}' if rej else ''}{before}{cut}; {self.n_real_tokens} tokens in "
            f"{self.seconds:.1f} s -> {self.out_dir}{self.note}"
        )


def _kept_size_note(plan: RunPlan) -> str:
    """Shards of a streamed input kept from a run with another shard size: not an error (each row is
    in one shard; new shards take this run's size), but not what the flag asked either."""
    want = plan.stage.shard_rows
    sizes = {
        i.stop - i.start for m in plan.done for i in m.inputs if i.stop is not None and plan.stage.streams(i)
    }
    if want is None or not sizes or sizes == {want}:
        return ""
    return (
        f"; kept shards of {', '.join(map(str, sorted(sizes)))} rows each from an earlier run (the shard "
        f"size asked, {want}, applies to new shards; to re-cut these, write to a new --out)"
    )


def finish_run(plan: RunPlan, results: list[ShardResult], seconds: float) -> RunSummary:
    _register(plan, results)  # first: a failed run's committed shards stay registered
    failures = [r for r in results if not r.ok]
    if failures:
        raise StageFailed(plan.stage.name, failures, len(plan.todo) + len(plan.done))
    made = [ShardManifest.model_validate(m) for r in results for m in r.manifests]
    manifests = plan.done + made
    *upstream, own = sum_lineage(manifests) or [{"docs_in": 0, "docs_out": 0, "rejected": {}}]
    return RunSummary(
        stage=plan.stage.name,
        out_dir=str(plan.out_dir),
        shards_done_before=len(plan.done),
        shards_run=len(made),
        docs_in=own["docs_in"],
        rows_out=sum(m.rows_out for m in manifests),
        docs_out=own["docs_out"],
        rejected=own["rejected"],
        n_real_tokens=sum(m.n_real_tokens for m in manifests),
        seconds=seconds,
        truncated=own.get("n_truncated", 0),
        bytes_dropped=own.get("bytes_dropped", 0),
        duplicates_kept=own.get(DUPLICATES_KEPT, 0),
        note=_kept_size_note(plan),
        upstream=upstream,
    )
