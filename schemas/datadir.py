"""A data directory: one stage's committed output, on a local path or any URL the storage layer opens.

The one way the project lists a data directory. Its parts are the shards whose manifest was
committed for the directory's configuration (`.stage.json`) and whose parquet is listed with the size
the manifest records; everything else in the directory (a shard still being written, a stale temp
file, a foreign `*.parquet`) is not data. What kind of data a directory holds is read from its stage
record, not from which command wrote it: the output of `score` and of `weigh` are both weighted
sequences, readable by every command that reads weighted data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from entroweight import storage

from .arrow import DocumentRowsMissing, require_row_in_doc, schema_metadata
from .compat import Incompatible, check_part_config
from .manifest import (
    REJECTS_DIR,
    SHARDS_FILE,
    STAGE_FILE,
    ShardInput,
    ShardManifest,
    StageRecord,
    is_manifest,
    lineage_problem,
)
from .weighted import WEIGHT, weight_dtype

# what each stage's output is: the table of schemas/arrow.py its shards hold
STAGE_KINDS = {"tokenize": "sequences", "score": "weighted", "weigh": "weighted", "synthesize": "weighted"}


class DataDirError(ValueError):
    """A directory that is not (or not wholly) a stage's committed output; the message says what to do."""


class ShardMismatch(DataDirError):
    """A committed shard whose bytes are not those its manifest records (a flipped bit, a file replaced
    by hand): a reader refuses it rather than use it."""


@dataclass(frozen=True)
class Part:
    """A committed shard: its parquet (`location`, local path or URL), size and manifest."""

    location: str
    name: str
    size: int
    manifest: ShardManifest

    def read(self) -> pa.Buffer:
        """The shard's bytes, checked against its manifest's sha256 as they stream: `read_checked`."""
        return read_checked(self.location, self.size, self.manifest.output_sha256)


def read_checked(location: str, size: int | None, sha256: str | None) -> pa.Buffer:
    """A committed shard's bytes, checked against the sha256 its manifest records as they stream (one
    read: `storage.read_hashed`); parse them with `pyarrow.BufferReader`. What every reader of a
    stage's output reads a shard with (`Part.read`; a stage's worker from its `ShardInput`). Raises
    ShardMismatch naming the shard and what to do."""
    data, sha = storage.read_hashed(location, size)
    if sha256 and sha != sha256:
        directory = location.rsplit("/", 1)[0]
        raise ShardMismatch(
            f"{location}: its bytes differ from its manifest (sha256 {sha[:12]}…, recorded "
            f"{sha256[:12]}…): the shard is corrupt or was changed; run "
            f"`entroweight verify {directory}`, then rerun the command that wrote it with --overwrite"
        )
    return data


def undecodable(location: str, error: Exception) -> DataDirError:
    """The refusal of a file whose pages do not decode (pyarrow's error on one line)."""
    return DataDirError(
        f"{location} could not be read whole ({' '.join(str(error).split())}); if a stage wrote it, run "
        "`entroweight verify` on its directory"
    )


class Unreadable(DataDirError):
    """A bookkeeping file (a shard manifest, `.shards.json`) that does not parse; `location` names it."""

    def __init__(self, message: str, location: str):
        super().__init__(message)
        self.location = location


def unreadable(location: str, what: str, error: Exception) -> Unreadable:
    """The refusal of a bookkeeping file (a manifest, `.shards.json`) that does not parse: one line
    naming it, and what to do."""
    if isinstance(error, ValidationError):  # its first line names only the model: say what failed
        e = error.errors()[0]
        where = ".".join(map(str, e["loc"]))
        first = f"{where}: {e['msg']}" if where else e["msg"]
    else:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return Unreadable(
        f"{location} is not {what} (it does not parse: {first}): {_damaged(location)}", location
    )


def _damaged(location: str) -> str:
    directory = location.rsplit("/", 1)[0]
    return (
        f"the directory's bookkeeping was changed or damaged; run `entroweight verify {directory}`, then "
        "rerun the command that wrote it with --overwrite"
    )


def counts_off(location: str, m: ShardManifest) -> Unreadable | None:
    """The refusal of a manifest whose document counts do not add up, its own or those it carries of
    the stages before (`lineage_problem`: in = out + rejected, each stage reading what the one before
    kept), as every stage writes them: edited by hand, and so not what it records; None where they
    add up."""
    problem = lineage_problem(m.lineage())
    if problem is None:
        return None
    return Unreadable(f"{location}: its counts do not add up ({problem}): {_damaged(location)}", location)


def open_data_file(location: str, part: Part | None) -> pa.NativeFile:
    """A reader's handle on `location`: `part`'s bytes checked against its manifest (`Part.read`,
    ShardMismatch) when it is a committed shard, else the file as it is."""
    return pa.BufferReader(part.read()) if part is not None else storage.open_input(location)


class DataDir:
    """One listing of `location`, then its record and manifests on demand (read in parallel)."""

    def __init__(self, location, names: dict[str, int] | None = None):
        """`names`: a listing of `location` already made (the stage planner's), so none is made again."""
        if storage.blank(location):
            raise DataDirError(
                "a data location is empty (an unset variable?): name a directory or a parquet file"
            )
        self.root = storage.path(location)
        self.location = storage.url(self.root)
        if names is not None:
            self.__dict__["names"] = names

    def __repr__(self) -> str:
        return f"DataDir({self.location!r})"

    def child(self, name: str) -> str:
        return storage.url(self.root / name)

    @cached_property
    def names(self) -> dict[str, int]:
        """{file name: size} directly in the directory (one listing)."""
        return storage.listing(self.root)

    @cached_property
    def tree(self) -> dict[str, int]:
        """{path relative to the directory (with /): size} of every file under it (one recursive
        listing): what a checker of strays (`verify`) needs besides the parts."""
        return storage.walk(self.root)

    @cached_property
    def is_file(self) -> bool:
        """The location names one file, not a directory (a single parquet file given to a reader)."""
        if self.names:
            return False
        if storage.is_local(self.root):
            return self.root.is_file()
        try:
            return bool(self.root.is_file())
        except (OSError, ValueError):
            return False

    @property
    def exists(self) -> bool:
        return bool(self.names) or (storage.is_local(self.root) and self.root.is_dir()) or self.is_file

    @property
    def foreign_files(self) -> list[str]:
        """The parquet files of a directory no stage wrote (other tools' data, which the trainer reads
        as it is): its non-hidden `*.parquet`, sorted. [] for a stage's output (read its `parts`)."""
        if self.record is not None or self.bookkeeping_without_record:
            return []
        return [
            self.child(n)
            for n in sorted(self.names)
            if n.endswith(".parquet") and not n.startswith((".", "_"))
        ]

    @property
    def holds_stage_files(self) -> bool:
        """Whether anything a stage writes is here (its record, registry, manifests or shards): a
        stage's output, whole or damaged, rather than some other directory."""
        return any(n in (STAGE_FILE, SHARDS_FILE) or n.startswith(("part-", ".part-")) for n in self.names)

    @property
    def bookkeeping_without_record(self) -> bool:
        """A stage's shard bookkeeping (manifests, the registry) with its `.stage.json` gone: not other
        tools' data, but a stage's output that cannot say what it is (every reader refuses it)."""
        return STAGE_FILE not in self.names and any(
            n == SHARDS_FILE or (n.startswith(".part-") and n.endswith(".manifest.json")) for n in self.names
        )

    @cached_property
    def record(self) -> StageRecord | None:
        """The stage record (`.stage.json`), or None when the directory holds none."""
        if STAGE_FILE not in self.names:
            return None
        raw = (self.root / STAGE_FILE).read_bytes()
        try:
            return StageRecord.model_validate_json(raw)
        except ValidationError:
            raise DataDirError(
                f"{self.child(STAGE_FILE)} is not a stage record (not the JSON entroweight writes): the "
                "directory was changed by another tool; point at a stage's output directory"
            ) from None

    @property
    def stage(self) -> str | None:
        return self.record.stage if self.record else None

    @property
    def kind(self) -> str | None:
        """'sequences' (tokenized) or 'weighted' (scored or weighed), from the stage record; None: no stage's output."""
        return STAGE_KINDS.get(self.stage) if self.stage else None

    @property
    def is_weighted(self) -> bool:
        return self.kind == "weighted"

    @cached_property
    def manifests(self) -> list[ShardManifest]:
        """Every shard manifest in the directory (whatever its config), in shard order; one that does
        not parse, or whose counts do not add up, is refused (DataDirError naming it: `unreadable`,
        `counts_off`)."""
        names = sorted(n for n in self.names if is_manifest(n))
        out = []
        for name, raw in zip(names, storage.read_many([self.root / n for n in names]), strict=True):
            try:
                m = ShardManifest.model_validate_json(raw)
            except ValidationError as e:
                raise unreadable(self.child(name), "a shard manifest", e) from None
            if off := counts_off(self.child(name), m):
                raise off
            out.append(m)
        return out

    @cached_property
    def parts(self) -> list[Part]:
        """The committed shards, in shard order: a manifest of the directory's config whose parquet is
        listed with the size the manifest records."""
        if self.record is None:
            return []
        out = []
        for m in self.manifests:
            size = self.names.get(m.output)
            if m.config_hash != self.record.config_hash or size is None:
                continue
            if m.output_bytes is not None and size != m.output_bytes:
                continue
            out.append(Part(self.child(m.output), m.output, size, m))
        return out

    @cached_property
    def schema(self) -> pa.Schema | None:
        """The Arrow schema of its first part (one footer read); None when it holds no part."""
        if not self.parts:
            return None
        with storage.open_input(self.parts[0].location) as f:
            return pq.read_schema(f)

    @cached_property
    def weight_dtype(self) -> str | None:
        """How a weighted directory stores its weights ('uint8' or 'float16'), from its first part's
        stored type (schemas/weighted.py decides); None when it holds no weighted part."""
        if not self.is_weighted or not self.parts:
            return None
        return weight_dtype(self.schema) if WEIGHT in self.schema.names else None

    @cached_property
    def part_schemas(self) -> list[pa.Schema]:
        """The Arrow schema (with its metadata) of every part, one footer read each."""

        def read(location: str) -> pa.Schema:
            with storage.open_input(location) as f:
                return pq.read_schema(f)

        return [self.schema, *(read(p.location) for p in self.parts[1:])] if self.parts else []

    @cached_property
    def metadata(self) -> dict:
        """The `entroweight` metadata of its first part ({} when it holds none): no read beyond `schema`."""
        return schema_metadata(self.schema)

    def require_one_config(self) -> DataDir:
        """This directory, refused (DataDirError) when a part's own metadata records another
        configuration than its manifest (a shard of another run copied in): `schemas.compat`."""
        try:
            for part, schema in zip(self.parts, self.part_schemas, strict=True):
                check_part_config(part, schema)
        except Incompatible as e:
            raise DataDirError(str(e)) from None
        return self

    def require_documents(self) -> DataDir:
        """This directory, refused (DataDirError) unless its rows record where each document starts
        (`row_in_doc`): what a reader that groups rows into documents needs."""
        try:
            require_row_in_doc(self.schema, self.location)
        except DocumentRowsMissing as e:
            raise DataDirError(str(e)) from None
        return self

    @property
    def files(self) -> list[str]:
        return [p.location for p in self.parts]

    @cached_property
    def _part_at(self) -> dict[str, Part]:
        return {p.location: p for p in self.parts}

    def open(self, location: str) -> pa.NativeFile:
        """A reader's handle on one of the files `data_files` gave for this location: a committed
        shard's bytes checked against its manifest (`Part.read`, ShardMismatch), else the file as it is
        (one parquet file named alone, another tool's data)."""
        return open_data_file(location, None if self.is_file else self._part_at.get(location))

    def read_table(self, location: str, columns: tuple[str, ...] | None = None) -> pa.Table:
        """The table of one of its files (those of `columns` it has), opened by `open`; a file whose
        pages do not decode is refused (DataDirError) as a shard that differs from its manifest is."""
        try:
            with self.open(location) as fh:
                pf = pq.ParquetFile(fh)
                names = pf.schema_arrow.names
                return pf.read(columns=None if columns is None else [c for c in columns if c in names])
        except (pa.ArrowException, OSError) as e:
            raise undecodable(location, e) from None

    @property
    def registry_lost(self) -> bool:
        """A stage's output holding shards but no `.shards.json` (copied without its dotfiles?): which
        shards its run planned is unknown, so whether it is complete cannot be shown."""
        return self.record is not None and SHARDS_FILE not in self.names and bool(self.manifests)

    @cached_property
    def registry(self) -> dict[str, str]:
        """What the stage planned (`.shards.json`): each input's key (`uri[start:stop]`) -> its shard;
        one that does not parse is refused (DataDirError naming it)."""
        if SHARDS_FILE not in self.names:
            return {}
        raw = (self.root / SHARDS_FILE).read_bytes()
        try:
            registry = json.loads(raw)
            if not isinstance(registry, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in registry.items()
            ):
                raise ValueError("not a mapping of input keys to shard names")
            for key in registry:
                ShardInput.parse_key(key)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise unreadable(self.child(SHARDS_FILE), "a shard registry", e) from None
        return registry

    @cached_property
    def planned(self) -> list[str]:
        """Every shard the stage planned (`.shards.json`), done or not."""
        return sorted(set(self.registry.values()))

    @property
    def missing(self) -> list[str]:
        """Planned inputs whose rows are not all in committed parts, by their shard: a shard not done
        (a run that has not finished, a deleted part), or a file read as a stream of shards whose
        committed shards stop short of its end (a run killed mid-file; its later shards are registered
        only when the run ends). An input counts as done when committed parts' manifests cover its
        row range from its start to its stop, contiguously."""
        covered: dict[str, dict[int, int | None]] = {}  # uri -> start -> stop, of committed parts
        for p in self.parts:
            for i in p.manifest.inputs:
                covered.setdefault(i.uri, {})[i.start] = i.stop
        missing = []
        for key, shard in self.registry.items():
            uri, start, end = ShardInput.parse_key(key)
            ranges, pos, seen = covered.get(uri, {}), start, set()
            while pos in ranges and ranges[pos] != end and ranges[pos] is not None and pos not in seen:
                seen.add(pos)
                pos = ranges[pos]
            if ranges.get(pos, -1) != end:  # a stream stopped short: named by where it stops
                missing.append(shard if pos == start else f"{shard}… (its rows from {pos} on)")
        return sorted(set(missing))

    def rejects_location(self, name: str) -> str:
        return storage.url(self.root / REJECTS_DIR / name)

    # -- what readers require

    def require(self, kind: str | None = None, complete: bool = True, hint: str = "") -> DataDir:
        """This directory, refused with the reason unless it is a stage's committed output (of `kind`,
        when given: 'sequences' or 'weighted'), with every planned shard done when `complete`."""
        hint = f"; {hint}" if hint else ""
        if self.record is None:
            what = (
                "does not exist"
                if not self.names and not storage.is_local(self.root)
                else "is not a stage's output"
            )
            if storage.is_local(self.root) and not self.root.exists():
                what = "does not exist"
            if what == "does not exist" and storage.has_glob_chars(self.location):
                raise DataDirError(storage.glob_not_expanded(self.location))
            if self.bookkeeping_without_record:
                what = "holds a stage's shards whose record is gone"
                hint = "; rerun the stage that made it into a new directory"
            raise DataDirError(f"{self.location} {what} (no {STAGE_FILE}){hint}")
        if kind is not None and self.kind != kind:
            wanted = {
                "sequences": "tokenized data",
                "weighted": "weighted data (the output of score or weigh)",
            }
            raise DataDirError(
                f"{self.location} holds the output of `{self.stage}`, not {wanted[kind]}{hint}"
            )
        if not self.parts:
            raise DataDirError(f"{self.location} holds no committed shard (its run has not finished){hint}")
        self.registry  # noqa: B018 - damaged bookkeeping is refused by every reader, complete or not
        foreign = [m for m in self.manifests if m.config_hash != self.record.config_hash]
        if complete and foreign:  # a shard of another run, copied in with its manifest
            m = foreign[0]
            raise DataDirError(
                f"{self.location}: one directory, two configurations: {m.shard}'s manifest records config "
                f"{m.config_hash[:12]}…, the directory's {STAGE_FILE} {self.record.config_hash[:12]}…; "
                "move that shard elsewhere, or rerun the command that wrote the directory with --overwrite "
                "(which drops it)"
            )
        if complete and self.registry_lost:  # `missing` would be empty: nothing says what is planned
            raise DataDirError(
                f"{self.location} has no {SHARDS_FILE} (the registry of the shards its run planned; was it "
                "copied without its dotfiles?), so whether it is complete cannot be shown: copy it whole, "
                "or rerun the command that writes it"
            )
        if complete and self.missing:
            shown = ", ".join(self.missing[:5]) + (" ..." if len(self.missing) > 5 else "")
            raise DataDirError(
                f"{self.location} is incomplete ({shown} not done): rerun the command that writes it, so "
                "that no document is left out"
            )
        return self


def no_rows(location) -> str:
    """How every reader says that `location` holds no rows to read (each reader adds what it cannot
    do without them): its documents were all rejected or dropped, which the manifests count."""
    return (
        f"{location} holds no rows (every document was rejected or dropped, or none was given: "
        f"`entroweight inspect {location}` counts them)"
    )


def data_dir(location) -> DataDir:
    return location if isinstance(location, DataDir) else DataDir(location)


def data_files(
    location, kind: str | None = None, complete: bool = True, hint: str = "", foreign: bool = False
) -> tuple[DataDir, list[str]]:
    """What a reader given `location` reads: the file itself when it names one parquet file; else the
    directory's committed parts (refused as `DataDir.require` says); with `foreign`, a directory no
    stage wrote gives its `*.parquet` (other tools' data) instead of being refused."""
    d = data_dir(location)
    if d.is_file:
        return d, [d.location]
    if foreign and d.record is None and d.foreign_files:
        return d, d.foreign_files
    return d, d.require(kind, complete, hint).files
