"""Stream (weighted) token parquet: shuffle buffer, rank/worker sharding, exact resume.

The order of samples is a pure function of (files, seed, shuffle buffer, number of streams), so a
position (the count of items a rank has consumed) is all a checkpoint needs to resume exactly:

- the files' row groups (split further when there are fewer than streams) are the *units*;
- each epoch permutes the units with `seed + epoch`; stream s = rank·workers + worker takes every
  n_streams-th unit;
- a stream reads its units in blocks of at least `shuffle_buffer` rows and yields each block's rows
  in a seeded random order (a block shuffle: resumable without saving the buffer's contents).

Resuming skips whole epochs and blocks by their row counts (from the parquet footers, no reading),
then reads one block and drops its first rows.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import numbers
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

from entroweight import output, storage
from entroweight.schemas.compat import Incompatible, check_compatible, check_part_config, facts
from entroweight.schemas.datadir import (
    DataDir,
    DataDirError,
    Part,
    data_dir,
    data_files,
    no_rows,
    open_data_file,
)
from entroweight.schemas.exports import EXPORT_RECORD, HF_DATA_FILES
from entroweight.schemas.weighted import (
    EXCLUDED,
    WEIGHT,
    excluded_mask,
    matrix,
    real_mask,
    weight_dtype,
    weights_matrix,
)

from .controls import Shuffle, shuffle_weights


class DataError(ValueError):
    """Data the trainer cannot use; the message says what to do."""


@dataclass(frozen=True)
class Unit:
    path: str
    row_group: int
    start: int  # rows within the row group
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


COLUMNS = ("weight", "entropy")  # what an item carries beside input_ids and mask, where the data has it


def parquet_files(paths) -> list[str]:
    """The parquet files to read for `paths` (local paths or URLs): a file itself; a stage's output
    directory through its committed parts (schemas/datadir.py: refused while incomplete); an
    `export-data --format hf` output (or its data directory) through the parquet files its record
    lists; a directory no stage wrote (other tools' data) through its `*.parquet`."""
    return _data(paths)[0]


def _hf_export(d: DataDir) -> tuple[list[str], dict, str | None] | None:
    """Where `d` (no stage's output) is an `export-data --format hf` output, its data directory or one
    of its files: the parquet files it names, as the export's record lists them, the metadata of the
    weighted data they were exported from and where that lies (its record's `source`) (the files carry none: their rows hold the real tokens
    only, which the reader left-pads back to that n_ctx). None where it is no export's; an export of
    another format, or one whose record is not as export-data sealed it, is refused."""
    if d.record is not None or d.holds_stage_files:
        return None
    here, top = storage.key(d.root), d.root
    for _ in range(3):  # the export itself, its data directory, a file in that
        record = storage.json_record(top / EXPORT_RECORD)
        below = here[len(storage.key(top)) :].strip("/")
        if record is not None and isinstance(record.get("files"), dict) and "format" in record:
            if record["format"] != "hf":
                if below:
                    return None
                raise DataError(
                    f"{storage.url(d.root)} is an `export-data --format {record['format']}` export, which "
                    f"that trainer's own reader reads: give the weighted data it was exported from "
                    f"({record.get('source')}), or its --format hf export"
                )
            names = [n for n in sorted(record["files"]) if fnmatch.fnmatchcase(n, HF_DATA_FILES)]
            names = [n for n in names if not below or n == below or n.startswith(below + "/")]
            if not names:  # beside the export's files, not one of them
                return None
            if output.edited(record) or not isinstance(record.get("metadata"), dict):
                raise DataError(
                    f"{storage.url(top / EXPORT_RECORD)} is not the record export-data sealed (an export cut "
                    "short, or edited): export again (`entroweight export-data ... --overwrite`)"
                )
            return [storage.url(top / n) for n in names], record["metadata"], record.get("source")
        top = top.parent
    return None


def _data(
    paths,
    parts: dict[str, Part] | None = None,
    given: dict[str, int] | None = None,
    exported: dict[str, dict] | None = None,
    sources: dict[int, str] | None = None,
) -> tuple[list[str], list[list[int] | None]]:
    """(files, each file's rows per row group as its manifest records them, or None); `parts`, when
    given, gains the committed part (with its manifest) of each file that is a stage's output,
    `given` each file's input (the index into `paths`) and `exported` the metadata of each file of an
    hf export (`_hf_export`), `sources` the data each input that is an hf export was exported from."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[str] = []
    groups: list[list[int] | None] = []
    parts = {} if parts is None else parts
    given = {} if given is None else given  # each file (canonical key) -> the input it came through
    exported = {} if exported is None else exported
    sources = {} if sources is None else sources
    for i, p in enumerate(paths):
        try:
            d = data_dir(p)
            export = _hf_export(d)
            if export is None:
                d, found = data_files(d, hint="tokenize (and score) data first", foreign=True)
            else:
                found, metadata, sources[i] = export
                exported.update((f, metadata) for f in found)
        except DataDirError as e:
            raise DataError(str(e)) from None
        for f in found:  # one directory twice, or a directory and a file in it: its rows read twice
            first = given.setdefault(storage.key(f), i)
            if first != i:
                raise DataError(
                    f"{f} would be read twice (through {paths[first]} and {p}): give each input once; to "
                    "weigh some data more, weigh it (`entroweight weigh`) rather than repeat it"
                )
        files += found
        by_location = {part.location: part for part in d.parts}
        groups += [by_location[f].manifest.output_row_groups if f in by_location else None for f in found]
        parts.update((f, by_location[f]) for f in found if f in by_location)
    if not files:
        raise DataError(f"no parquet files in {', '.join(map(str, paths))}; tokenize (and score) data first")
    return files, groups


def _no_documents_twice(
    paths, given: dict[str, int], parts: dict[str, Part], sources: dict[int, str]
) -> None:
    """Two inputs that hold the same documents under other files (one made from the other: tokens and
    their scores, scores and their weighing; or both from the same shards: two scorings of the same
    tokens) are refused as one file given twice is: each stage shard's lineage, its own sha256 and
    those of the shards it was made from (`ShardInput.sha256`, followed through their manifests where
    they still are), may meet no other input's. An hf export's files have no manifests: the shards of
    the data it was exported from (`sources`) stand for them, where that data still is."""
    seen: dict[str, tuple[int, str]] = {}  # a shard's sha256 -> (the input, the file) whose lineage holds it
    directories: dict[str, dict[str, Part]] = {}
    held = [(given[storage.key(f)], f, part) for f, part in parts.items()]
    for i, source in sources.items():
        try:
            held += [
                (i, f"{paths[i]} (exported from {source})", part) for part in data_files(source)[0].parts
            ]
        except Exception:  # noqa: BLE001 - moved, deleted, unreadable: as a shard's lineage, it stops here
            continue
    for i, f, part in held:
        for sha in _lineage(part, directories):
            j, g = seen.setdefault(sha, (i, f))
            if j != i:
                raise DataError(
                    f"{paths[j]} and {paths[i]} hold the same documents ({g} and {f} were made from one "
                    "shard): give one of them; to weigh some data more, weigh it (`entroweight weigh`) "
                    "rather than repeat it"
                )


def _lineage(part: Part, directories: dict[str, dict[str, Part]], depth: int = 8) -> set[str]:
    """The sha256 of `part` and of every stage shard it was made from, as far as their manifests are
    found (`directories`: each directory's committed parts by location, read once)."""
    found, frontier = {part.manifest.output_sha256}, [part]
    for _ in range(depth):
        parents = []
        for p in frontier:
            for inp in p.manifest.inputs:
                if inp.sha256 is None or inp.sha256 in found:
                    continue  # a source file (no sha256), or a shard already followed
                found.add(inp.sha256)
                parent = _part_at(inp.uri, directories)
                if parent is not None and parent.manifest.output_sha256 == inp.sha256:
                    parents.append(parent)
        if not parents:
            break
        frontier = parents
    return found - {None}


def _part_at(uri: str, directories: dict[str, dict[str, Part]]) -> Part | None:
    """The committed part whose file is `uri`, or None where its directory is gone or no stage's."""
    directory = uri.rsplit("/", 1)[0] if "/" in uri else "."
    if directory not in directories:
        try:
            directories[directory] = {p.location: p for p in data_files(directory)[0].parts}
        except Exception:  # moved, deleted, unreadable: the lineage stops here
            directories[directory] = {}
    return directories[directory].get(uri)


@dataclass
class DataInfo:
    files: list[Path]
    tokenizer_sha256: str | None
    vocab_size: int | None
    n_ctx: int | None
    pad_id: int | None
    columns: set[str]
    metadata: dict
    row_groups: list[list[int]] = dataclasses.field(default_factory=list, repr=False)  # per file
    # the committed part (manifest: sha256) of each file that is a stage's output; other tools' files
    # have none and are read unchecked
    parts: dict[str, Part] = dataclasses.field(default_factory=dict, repr=False)
    # each file of an hf export (its rows: real tokens only) -> the n_ctx its rows are left-padded to
    padded_to: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)


def inspect_data(
    paths,
    require=(),
    tokenizer_sha256: str | None = None,
    vocab_size: int | None = None,
    tokenizer_advice: str = "give data of the model's tokenizer (re-tokenize it)",  # train words its own
) -> DataInfo:
    """Check every file's schema and provenance before any training; raise DataError saying what to do
    (`tokenizer_advice`: where the data's tokenizer is not `tokenizer_sha256`)."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    parts: dict[str, Part] = {}
    given: dict[str, int] = {}
    exported: dict[str, dict] = {}
    sources: dict[int, str] = {}
    files, recorded = _data(paths, parts, given, exported, sources)
    metas, common = [], None
    groups = recorded if all(g is not None for g in recorded) else None
    if groups is None:  # not all of them stage output with manifests: every file's footer
        read = footers(files)
        groups = [[md.row_group(i).num_rows for i in range(md.num_row_groups)] for md in read]
    else:  # one config per stage directory (verify checks it): one footer per directory
        firsts = {}
        for f in files:
            firsts.setdefault(str(f).rsplit("/", 1)[0], f)
        by_dir = dict(zip(firsts, footers(list(firsts.values())), strict=True))
        read = [by_dir[str(f).rsplit("/", 1)[0]] for f in files]
    for f, footer in zip(files, read, strict=True):
        schema = footer.schema.to_arrow_schema()
        names = set(schema.names)
        if "input_ids" not in names:
            raise DataError(f"{f} has no input_ids column: it is not token data; give tokenized parquet")
        for col in require:
            if col not in names:
                if col == "entropy" and "weight" in names:  # scored, its values dropped (--drop-entropy)
                    hint = (
                        "it was written without its values (--drop-entropy): write it again from what "
                        "it was scored or weighed from, without --drop-entropy"
                    )
                else:
                    hint = (
                        "score it first (`entroweight score`) or train with --loss ce"
                        if col in COLUMNS
                        else "give data that has it"
                    )
                raise DataError(f"{f} has no {col!r} column, which the loss needs; {hint}")
        common = names if common is None else common & names
        # an hf export's file says nothing of itself: the data it was exported from speaks for it
        metas.append({**exported.get(f, {}), **facts(schema)})
    # the inputs read together (a directory each: its first file speaks for it) must go together
    firsts: dict[str, dict] = {}
    for f, m in zip(files, metas, strict=True):
        firsts.setdefault(str(f).rsplit("/", 1)[0], m)
    try:
        check_compatible(list(firsts.items()), what="the training data's ")
    except Incompatible as e:
        raise DataError(str(e)) from None
    shas = {m.get("tokenizer_sha256") for m in metas}
    if len(shas) > 1:
        raise DataError(
            f"the data files were tokenized with {len(shas)} different tokenizers ({', '.join(map(str, shas))}); "
            "train on files of one tokenizer"
        )
    sha = shas.pop()
    if tokenizer_sha256 and sha and sha != tokenizer_sha256:
        raise DataError(
            f"the data was tokenized with tokenizer sha256 {sha[:12]}…, but the model/run uses "
            f"{tokenizer_sha256[:12]}…; {tokenizer_advice}"
        )
    vocabs = {m.get("vocab_size") for m in metas}
    data_vocab = max((v for v in vocabs if v is not None), default=None)
    if vocab_size is not None and data_vocab is not None and data_vocab != vocab_size:
        raise DataError(
            f"the data's vocabulary has {data_vocab} tokens but the model's has {vocab_size}; set the model's "
            f"vocab_size to {data_vocab} (or leave it out of --model-config to take it from the data)"
        )
    # after what makes the inputs incompatible: the same documents in two inputs is refused either way
    _no_documents_twice(paths, given, parts, sources)
    if not any(n for g in groups for n in g):
        shown = ", ".join(str(p) for p in paths)
        raise DataError(f"{no_rows(shown)}: nothing to train on")
    n_ctxs = [m["n_ctx"] for m in metas if m.get("n_ctx")]
    pads = {m.get("pad_id") for m in metas}
    return DataInfo(
        files=files,
        tokenizer_sha256=sha,
        vocab_size=data_vocab,
        n_ctx=max(n_ctxs) if n_ctxs else None,
        pad_id=pads.pop() if len(pads) == 1 else None,
        columns=common or set(),
        metadata=metas[0],
        row_groups=groups,
        parts=parts,
        padded_to={f: m["n_ctx"] for f, m in exported.items() if isinstance(m.get("n_ctx"), int)},
    )


def value_problems(
    files, columns, parts: dict[str, Part] | None = None
) -> tuple[list[tuple[Path, str]], int]:
    """(file, message) for each file whose bytes differ from its manifest (a stage's output: `parts`,
    from `inspect_data`), or whose `weight` / `entropy` values (those of `columns` it has) hold NaN or
    ±inf, or weights outside [0, 1], and how many weights are above 0 (a run whose weights are all 0
    would train on nothing). A stage's shard is read once, whole, hashed as it streams
    (`Part.read`) and its columns parsed from those bytes; another tool's file: those columns only."""
    found, positive = [], 0
    parts = parts or {}
    for f in files:
        if f in parts:
            try:
                pf = pq.ParquetFile(open_data_file(f, parts[f]))
            except DataDirError as e:  # a listed problem, not a raise: under DDP every rank raises together
                found.append((f, str(e)))
                continue
            try:  # one configuration per directory: the shard's own against its manifest's
                check_part_config(parts[f], pf.schema_arrow)
            except Incompatible as e:
                found.append((f, str(e)))
                continue
        else:
            pf = pq.ParquetFile(open_data_file(f, None))
        cols = [c for c in columns if c in pf.schema_arrow.names]
        counts: dict[str, int] = {}
        for rg in range(pf.num_row_groups) if cols else ():
            table = pf.read_row_group(rg, columns=cols)
            for c in cols:
                values = pc.list_flatten(table.column(c))
                if c == WEIGHT and weight_dtype(values.type) == "uint8":
                    # stored as round(255·w) (schemas/weighted.py): always in range
                    positive += int(pc.count(pc.filter(values, pc.greater(values, 0))))
                    continue
                v = values.to_numpy().astype(np.float32, copy=False)  # float16 math in numpy is slow
                kinds = {f"{c} NaN or infinite": int(np.count_nonzero(~np.isfinite(v)))}
                if c == "weight":
                    with np.errstate(invalid="ignore"):
                        kinds["weights outside [0, 1]"] = int(np.count_nonzero((v < 0) | (v > 1)))
                        positive += int(np.count_nonzero(v > 0))
                for kind, n in kinds.items():
                    counts[kind] = counts.get(kind, 0) + n
        bad = {k: n for k, n in counts.items() if n}
        if bad:
            what = ", ".join(f"{n:,} {k}" for k, n in bad.items())
            stage = "scoring" if any(k.startswith("entropy") for k in bad) else "scoring (or weigh)"
            found.append((f, f"{f}: {what}; re-run the {stage} stage for this file, or train without it"))
    return found, positive


def _footer(f: str) -> pq.FileMetaData:
    with storage.open_input(f) as fh:
        try:
            return pq.read_metadata(fh)
        except pa.ArrowInvalid as e:  # a cut or foreign file: say which (a read error says itself)
            raise DataError(f"{f} is not a readable parquet file ({e})") from None


def footers(files) -> list[pq.FileMetaData]:
    """Each file's parquet footer (schema, provenance, row groups), in parallel on an object store,
    where each is a round trip. inspect_data reads them once; the reader's plan reuses them."""
    names = [str(f) for f in files]
    if all(storage.is_local(n) for n in names):
        return [_footer(n) for n in names]
    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(_footer, names))


def left_padded(m: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
    """Rows filled on the right (each row's values first) moved right by their `n_pad`: the fill on
    the left, as a stage lays rows out (schemas/weighted.py)."""
    cols = np.arange(m.shape[1])[None, :] - np.asarray(n_pad)[:, None]
    return np.take_along_axis(m, cols % m.shape[1], axis=1)


def make_units(files: list[Path], n_streams: int, row_groups: list | None = None) -> list[Unit]:
    if row_groups is None:
        row_groups = [[md.row_group(i).num_rows for i in range(md.num_row_groups)] for md in footers(files)]
    units = []
    for f, groups in zip(files, row_groups, strict=True):
        for rg, n in enumerate(groups):
            if n:
                units.append(Unit(str(f), rg, 0, n))
    total = sum(u.rows for u in units)
    if total < n_streams:
        raise DataError(
            f"{total} sequences cannot feed {n_streams} ranks × data-loader workers; use fewer ranks or "
            "workers, or more data"
        )
    # fewer units than streams: split them so every rank/worker gets some
    while len(units) < n_streams:
        big = max(range(len(units)), key=lambda i: units[i].rows)
        u = units.pop(big)
        mid = u.start + u.rows // 2
        units[big:big] = [Unit(u.path, u.row_group, u.start, mid), Unit(u.path, u.row_group, mid, u.stop)]
    return units


# what a saved position depends on (WeightedTokens._plan), as a refusal names it and what to do
PLAN = {
    "seed": ("seed {}", "resume with the same seed"),
    "world_size": ("{} ranks", "resume with the same number of processes"),
    "shuffle": ("shuffle={}", "resume with the same shuffle"),
    "shuffle_buffer": ("shuffle_buffer {}", "resume with the same shuffle_buffer"),
    "batch_size": ("batch_size {}", "resume with the same batch_size"),
    "data": ("data {}", "resume on the same data (its files and their row groups)"),
}


def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class WeightedTokens(IterableDataset):
    """Token sequences (and their per-token `weight`, `entropy`) from parquet, as torch tensors.

    Yields dicts: `input_ids` int64, `mask` bool (True on real tokens, False on pads), and where
    the data has them `weight` float32 in [0, 1] (decoded by schemas/weighted.py) and `entropy`
    float32. With `batch_size` each item is a stacked batch (B, T); without, one sequence (T,).
    Values at index i describe token i (shift by one against next-token logits). An `export-data
    --format hf` output reads as the weighted data it was exported from: the same rows, left-padded.

    rank/world_size default to torch.distributed (or RANK/WORLD_SIZE); DataLoader workers split a
    rank's share further. `start`: items this rank already consumed (resume). With DataLoader
    workers, resume through torchdata's StatefulDataLoader (it saves each worker's state_dict); with
    a plain DataLoader, set `batch_size` here, use `DataLoader(ds, batch_size=None)` and `start=`.
    `epochs=None` loops forever (each epoch reshuffled).
    """

    def __init__(
        self,
        paths,
        batch_size: int | None = None,
        shuffle: bool = True,
        shuffle_buffer: int = 4096,
        seed: int = 0,
        epochs: int | None = 1,
        rank: int | None = None,
        world_size: int | None = None,
        start: int = 0,
        columns=COLUMNS,
        require=(),
        tokenizer_sha256: str | None = None,
        vocab_size: int | None = None,
        shuffle_weights: Shuffle | None = None,
    ):
        super().__init__()
        for name, value, least, optional in (
            ("batch_size", batch_size, 1, True),  # 0 once gave one batch of every row: all in memory
            ("epochs", epochs, 1, True),
            ("start", start, 0, False),
            ("shuffle_buffer", shuffle_buffer, 1, False),
            ("seed", seed, 0, False),
        ):
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ValueError(
                    f"{name} must be an integer >= {least}{' or None' * optional}, not {value!r}"
                )
        if paths is None or isinstance(columns, str) or not all(c in COLUMNS for c in columns):
            # a string would be read letter by letter, a misspelled name skipped: weights silently gone
            raise ValueError(
                "paths name the data (directories or files), and columns is a list of "
                f"{', '.join(COLUMNS)} (those the data has are read), not paths={paths!r}, columns={columns!r}"
            )
        self.info = inspect_data(paths, require, tokenizer_sha256, vocab_size)
        self.columns = [c for c in columns if c in self.info.columns]
        if shuffle_weights is not None and WEIGHT not in self.columns:
            raise ValueError(f"shuffle_weights={shuffle_weights!r} needs the weight column read (columns=)")
        self.shuffle_weights = shuffle_weights
        self.batch_size, self.shuffle, self.shuffle_buffer = batch_size, shuffle, shuffle_buffer
        self.seed, self.epochs, self.start = seed, epochs, start
        r, w = _dist()
        told = torch.distributed.is_available() and torch.distributed.is_initialized() or "RANK" in os.environ
        if rank is None and world_size is not None and world_size > 1 and not told:
            # every process would read rank 0's share: the others' rows lost, its own read twice over
            raise ValueError(
                f"world_size {world_size} without rank: give each process its rank= (under torchrun "
                "both come from the environment)"
            )
        self.rank = r if rank is None else rank
        self.world_size = w if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        self.pad_id = self.info.pad_id if self.info.pad_id is not None else -1
        self._units_cache: dict[int, list[Unit]] = {}
        self._file_index = {str(f): i for i, f in enumerate(self.info.files)}
        # where this process's iteration stands: (workers, role, items of that role's stream consumed);
        # None until it iterates. A worker's own saved place, restored in that worker, is `_resume`.
        self._at: tuple[int, int, int] | None = None
        self._resume: tuple[int, int, int] | None = None

    # -- the deterministic plan
    def _units(self, n_streams: int) -> list[Unit]:
        if n_streams not in self._units_cache:
            self._units_cache[n_streams] = make_units(self.info.files, n_streams, self.info.row_groups)
        return self._units_cache[n_streams]

    def _blocks(self, epoch: int, stream: int, n_streams: int) -> list[list[Unit]]:
        units = self._units(n_streams)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(units)) if self.shuffle else None
        mine = [units[i] for i in (order if order is not None else range(len(units)))][stream::n_streams]
        blocks, cur, rows = [], [], 0
        for u in mine:
            cur.append(u)
            rows += u.rows
            if rows >= self.shuffle_buffer or not self.shuffle:
                blocks.append(cur)
                cur, rows = [], 0
        if cur:
            blocks.append(cur)
        return blocks

    def _read_block(self, block: list[Unit]) -> dict[str, np.ndarray]:
        cols = ["input_ids", *(["n_pad"] if "n_pad" in self.info.columns else []), *self.columns]
        if self.shuffle_weights and EXCLUDED in self.info.columns:  # a control keeps them where they are
            cols.append(EXCLUDED)
        parts = []
        for u in block:
            with storage.open_input(u.path) as fh:
                pf = self._unchanged(u.path, fh)
                t = pf.read_row_group(u.row_group, columns=cols)
            parts.append(self._to_numpy(t.slice(u.start, u.rows), u))
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def _unchanged(self, location: str, fh) -> pq.ParquetFile:
        """The file opened, if it is the one the reader planned: a stage that rewrote the directory
        meanwhile (`weigh --overwrite`) gave rows of two weightings, no error. Its size and its row
        groups are the ones planned, and a stage's shard holds its manifest's configuration (the config
        hash its footer records: a rewrite under another config may have the very same size)."""
        part = self.info.parts.get(location)
        size = fh.seek(0, os.SEEK_END)
        fh.seek(0)
        pf = pq.ParquetFile(fh)
        groups = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
        planned = self.info.row_groups[self._file_index[location]]
        what = None
        if part is not None and size != part.size:  # as listed when planned (the manifest's)
            what = f"{size} bytes, its manifest {part.size}"
        elif groups != planned:
            what = f"rows per row group {groups}, planned {planned}"
        elif part is not None:
            try:
                check_part_config(part, pf.schema_arrow)
            except Incompatible as e:
                what = e.fact
        if what is not None:
            raise DataError(
                f"{location} changed since the reader planned it ({what}): a stage rewrote the data "
                "while it was read; start the reader again"
            )
        return pf

    def _to_numpy(self, table: pa.Table, u: Unit) -> dict[str, np.ndarray]:
        where = f"{u.path} (row group {u.row_group}, rows {u.start}..{u.stop})"
        ids_col = table.column("input_ids").combine_chunks()
        lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False)
        width = int(lengths.max()) if len(lengths) else 0
        # the one real-token mask (schemas/weighted.py): from n_pad; other tools' data without the
        # column: every position within the row's length
        n_pad = table.column("n_pad").to_numpy() if "n_pad" in table.column_names else None
        n_ctx = self.info.padded_to.get(u.path)
        if n_ctx is not None:  # an hf export's rows: the pads it dropped go back on the left, as in ours
            if width > n_ctx:
                raise DataError(f"{where}: a row is longer than its export's n_ctx {n_ctx}: export it again")
            width, n_pad = n_ctx, n_ctx - lengths

        def laid(m: np.ndarray) -> np.ndarray:  # `matrix` fills short rows on the right
            return left_padded(m, n_pad) if n_ctx is not None else m

        ids = laid(matrix(ids_col, np.int64, fill=max(self.pad_id, 0), width=width))
        out = {"input_ids": ids, "mask": real_mask(n_pad, width, None if n_ctx is not None else lengths)}
        for c in self.columns:
            col = table.column(c).combine_chunks()
            if not np.array_equal(pc.list_value_length(col).to_numpy(zero_copy_only=False), lengths):
                raise DataError(
                    f"{where}: the {c!r} lists differ in length from input_ids; the file is corrupt or was "
                    "written by another tool: re-run the scoring stage for it"
                )
            if c == WEIGHT:
                m = laid(weights_matrix(col, width))
                if np.isnan(m).any() or (m < 0).any() or (m > 1).any():
                    raise DataError(
                        f"{where}: weights must lie in [0, 1] (found "
                        f"{'NaN' if np.isnan(m).any() else f'{np.nanmin(m):g}..{np.nanmax(m):g}'}); "
                        "re-run the weigh stage (it clips and min-max normalises)"
                    )
            else:
                m = laid(matrix(col, np.float32, width=width))
                if not np.isfinite(m).all():
                    raise DataError(
                        f"{where}: {c} has NaN or infinite values; re-run the scoring stage for this file"
                    )
            out[c] = m
        if self.shuffle_weights:
            # a fresh permutation per training seed, the same for a unit whenever it is read (resume)
            where_in = self._file_index.get(str(u.path), 0)
            rng = np.random.default_rng([self.seed, where_in, u.row_group, u.start])
            excluded = (
                excluded_mask(table.column(EXCLUDED), width) if EXCLUDED in table.column_names else None
            )
            weighable = out["mask"] & ~excluded if excluded is not None else out["mask"]
            pads = n_pad if n_pad is not None else np.zeros(len(ids), np.int64)
            out[WEIGHT] = shuffle_weights(out[WEIGHT], weighable, pads, self.shuffle_weights, rng)
        return out

    # -- iteration
    @property
    def position(self) -> int:
        """Items this rank consumed, counted where they are made: by an iteration in this process
        (without DataLoader workers; with them the main process never iterates and stays at `start`)."""
        return self._at[2] if self._at is not None and self._at[0] == 1 else self.start

    def __iter__(self):
        # not a generator itself: the place is fixed when iter() is called, so a state_dict taken
        # before the first item (StatefulDataLoader snapshots every worker at start) already says it
        info = get_worker_info()
        n_workers, worker = (info.num_workers, info.id) if info else (1, 0)
        role, consumed = self._origin(n_workers, worker)
        self._at = (n_workers, role, consumed)
        return self._stream(n_workers, role, consumed)

    def _origin(self, n_workers: int, worker: int) -> tuple[int, int]:
        """(the stream role this worker plays, how many of that stream's items are consumed)."""
        if self._resume is not None:  # StatefulDataLoader gives each worker back its own saved place
            workers, role, consumed = self._resume
            if workers != n_workers:
                raise DataError(
                    f"the saved data position is for {workers} DataLoader workers, not {n_workers}; "
                    "resume with the same num_workers"
                )
            return role, consumed
        # DataLoader hands out workers' items round robin, always starting at worker 0: after `start`
        # items, the next item is stream (start % n_workers)'s, so a resumed worker takes that role
        role = (worker + self.start) % n_workers
        return role, self.start // n_workers + (1 if role < self.start % n_workers else 0)

    def _stream(self, n_workers: int, role: int, consumed: int):
        per_item = self.batch_size or 1
        stream = self.rank * n_workers + role
        for item in self._items(stream, self.world_size * n_workers, consumed * per_item):
            consumed += 1
            self._at = (n_workers, role, consumed)
            yield item

    def _items(self, stream: int, n_streams: int, skip: int):
        batch = []
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            for b, block in enumerate(self._blocks(epoch, stream, n_streams)):
                rows = sum(u.rows for u in block)
                if skip >= rows:  # consumed before the resume point: not read at all
                    skip -= rows
                    continue
                data = self._read_block(block)
                order = (
                    np.random.default_rng([self.seed, epoch, stream, b]).permutation(rows)
                    if self.shuffle
                    else np.arange(rows)
                )
                for i in order[skip:]:
                    row = {k: v[i] for k, v in data.items()}
                    if self.batch_size is None:
                        yield self._tensors(row)
                        continue
                    batch.append(row)
                    if len(batch) == self.batch_size:
                        yield self._tensors({k: np.stack([r[k] for r in batch]) for k in batch[0]})
                        batch = []
                skip = 0
            epoch += 1
        if batch:
            yield self._tensors({k: np.stack([r[k] for r in batch]) for k in batch[0]})

    def _tensors(self, row: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in row.items()}

    def _plan(self) -> dict:
        """What orders the rows besides the position (PLAN): a saved place means nothing under others."""
        groups = [
            [str(f).rsplit("/", 1)[-1], g] for f, g in zip(self.info.files, self.info.row_groups, strict=True)
        ]
        return {
            "seed": self.seed,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "batch_size": self.batch_size,
            "data": hashlib.sha256(json.dumps(groups).encode()).hexdigest()[:16],
        }

    def state_dict(self) -> dict:
        """Where this rank's reading stands. In the main process: `position`, the items it consumed.
        In a DataLoader worker (torchdata's StatefulDataLoader saves each worker's): that worker's
        place, `workers`, `role` (the stream it reads) and `consumed` (that stream's items made)."""
        info = get_worker_info()
        if info is None:
            return {"position": self.position, **self._plan()}
        workers, role, consumed = self._at or (info.num_workers, *self._origin(info.num_workers, info.id))
        return {"workers": workers, "role": role, "consumed": consumed, **self._plan()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()`'s place, exactly; a place saved under another plan is refused."""
        for key, value in self._plan().items():
            if key in state and state[key] != value:  # a key a state lacks: saved before it was recorded
                said, hint = PLAN[key]
                raise DataError(
                    f"the saved data position is for {said.format(state[key])}, not {value}; {hint}"
                )
        self._at = None
        if "workers" in state:  # one worker's place: it belongs in that worker
            if get_worker_info() is None:
                raise DataError(
                    "this state is a DataLoader worker's: give the loader's state_dict to "
                    "torchdata's StatefulDataLoader.load_state_dict, which hands each worker its own"
                )
            self._resume = (int(state["workers"]), int(state["role"]), int(state["consumed"]))
        else:
            self._resume = None
            self.start = int(state["position"])
