"""JSON models written beside the parquet: file metadata, shard manifests, the stage record."""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# Bumped when the bytes a stage writes change for the same config: old shards then recompute.
# 2: weighted shards carry `excluded`; a special token's string in a document is tokenized as text
# 3: sequences carry `row_in_doc` (where each document starts); cross_tokenizer scores a split
#    document as one text and excludes tokens holding part of a character cut at a row edge
FORMAT_VERSION = 3


def config_hash(config: dict[str, Any]) -> str:
    """A short stable hash of a stage's config (JSON with sorted keys)."""
    blob = json.dumps({"format": FORMAT_VERSION, **config}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class FileMetadata(BaseModel):
    """The `entroweight` key-value entry of every output parquet file. Scorers add fields."""

    model_config = ConfigDict(extra="allow")

    stage: str
    tokenizer: str
    tokenizer_sha256: str
    vocab_size: int
    n_ctx: int
    padding_side: str = "left"
    pad_id: int
    eos_id: int | None = None
    packed: bool = False
    config_hash: str
    code_version: str


class ShardInput(BaseModel):
    """Where a shard's documents come from: a file (or hub shard) and a row range in it."""

    model_config = ConfigDict(frozen=True)

    uri: str  # absolute path, or hf:REPO:CONFIG for a hub dataset
    fmt: str  # parquet | jsonl | jsonl.gz | jsonl.zst | hub | sequences
    start: int = 0  # first row (document) of the range
    stop: int | None = None  # one past the last row; None: to the end
    size: int | None = None  # file size when planned: a changed file recomputes
    mtime_ns: int | None = None
    version: str | None = None  # an object's version in its store's listing (an ETag): a rewrite recomputes
    # a stage's output read by another stage: the shard's sha256 as its manifest records it, checked as
    # the worker reads it (schemas/datadir.py `read_checked`); a changed shard is another input
    sha256: str | None = None
    # tokenize: a digest of which of its rows repeat a document id seen before in the run, and where
    # first (transforms/duplicates.py `digest`): what its shard holds beyond its own rows, so a change
    # (an earlier input that now holds a first copy) redoes the shard; None: no row repeats one
    repeats: str | None = None

    @property
    def key(self) -> str:
        return f"{self.uri}[{self.start}:{'' if self.stop is None else self.stop}]"

    @staticmethod
    def parse_key(key: str) -> tuple[str, int, int | None]:
        """(uri, start, stop) of a `key` (`.shards.json` records inputs by it)."""
        uri, rows = key.rsplit("[", 1)
        start, stop = rows.rstrip("]").split(":")
        return uri, int(start), int(stop) if stop else None


class ShardManifest(BaseModel):
    """Written last, beside `part-NNNNN.parquet`: the shard is done iff this matches the config."""

    shard: str  # part-NNNNN
    stage: str
    inputs: list[ShardInput]
    output: str  # file name of the parquet, relative to the output directory
    output_sha256: str
    output_bytes: int | None = None  # its size: planning checks it against one listing of --out
    # rows per parquet row group: the trainer plans its reading from the manifests, opening no footer
    output_row_groups: list[int] | None = None
    rows_out: int
    rows_in: int | None = None  # row-to-row stages (score, weigh): the input shard's rows
    docs_in: int
    docs_out: int  # distinct documents with at least one row
    rejected: dict[str, int] = Field(default_factory=dict)
    rejects_file: str | None = None
    rejects_sha256: str | None = None
    rejects_bytes: int | None = None  # its size: planning checks it against one listing of .rejects/
    n_tokens: int = 0  # all positions, pads included
    n_real_tokens: int = 0
    n_bytes: int = 0
    config_hash: str
    code_version: str
    seconds: float = 0.0
    extra: dict[str, Any] = Field(default_factory=dict)

    @property
    def n_rejected(self) -> int:
        return sum(self.rejected.values())

    def lineage(self) -> list[dict[str, Any]]:
        """What each stage this shard's documents went through read, kept and rejected, the first
        (tokenize) first and this one last: a stage that reads another's shard carries that shard's
        lineage (`UPSTREAM`), so a weighted shard still accounts for the documents tokenize rejected."""
        own = {
            "stage": self.stage,
            "docs_in": self.docs_in,
            "docs_out": self.docs_out,
            "rejected": self.rejected,
        }
        own |= {k: self.extra[k] for k in MORE_COUNTS if self.extra.get(k)}
        return [*self.extra.get(UPSTREAM, []), own]


#: ShardManifest.extra's key for the lineage of the shard a stage read (`ShardManifest.lineage`)
UPSTREAM = "upstream"
#: what tokenize --overflow truncate cut: the documents and their bytes of text dropped
CUT_COUNTS = ("n_truncated", "bytes_dropped")
#: the documents of its input shard a stage did not read: score's sample of each shard's first rows
NOT_READ = "not_read"
#: tokenize: the documents whose id was seen before in the run, kept (without --reject-duplicates)
DUPLICATES_KEPT = "duplicate_ids_kept"
#: the counts besides documents in, out and rejected that a stage's lineage entry may hold
MORE_COUNTS = (*CUT_COUNTS, NOT_READ, DUPLICATES_KEPT)


def lineage_problem(lineage: list[dict[str, Any]]) -> str | None:
    """Where a lineage's counts do not add up, in words; None where they do: each stage's documents
    in = out + rejected, and each reads what the one before kept (but what a sample left unread)."""
    for c in lineage:
        if c["docs_in"] != c["docs_out"] + sum(c["rejected"].values()):
            return (
                f"{c['stage']}: {c['docs_in']} documents in, {c['docs_out']} out + "
                f"{sum(c['rejected'].values())} rejected"
            )
    for before, after in itertools.pairwise(lineage):
        if after["docs_in"] + after.get(NOT_READ, 0) != before["docs_out"]:
            return (
                f"{after['stage']} read {after['docs_in']} documents of the {before['docs_out']} "
                f"{before['stage']} kept"
            )
    return None


def sum_counts(counts: list[dict[str, Any]]) -> dict[str, Any]:
    """The counts of several shards of one stage added up: documents in and out, rejects by reason."""
    total: dict[str, Any] = {"docs_in": 0, "docs_out": 0, "rejected": {}}
    for c in counts:
        total["docs_in"] += c["docs_in"]
        total["docs_out"] += c["docs_out"]
        for reason, n in c["rejected"].items():
            total["rejected"][reason] = total["rejected"].get(reason, 0) + n
        for k in MORE_COUNTS:
            if c.get(k):
                total[k] = total.get(k, 0) + c[k]
    return total


def counts_line(counts: dict[str, Any]) -> str:
    """One stage's counts in words: `tokenize: 41 docs in, 36 out, 5 rejected (empty 4, invalid_json 1)`."""
    rejected = counts["rejected"]
    why = f" ({', '.join(f'{k} {v}' for k, v in sorted(rejected.items()))})" if rejected else ""
    cut = (
        f"; {counts['n_truncated']} truncated, {counts['bytes_dropped']} bytes of text dropped"
        if counts.get("n_truncated")
        else ""
    )
    sample = f"; {counts[NOT_READ]} not read (a sample of the first rows)" if counts.get(NOT_READ) else ""
    kept = f"; {counts[DUPLICATES_KEPT]} duplicate ids kept" if counts.get(DUPLICATES_KEPT) else ""
    return (
        f"{counts['stage']}: {counts['docs_in']} docs in, {counts['docs_out']} out, "
        f"{sum(rejected.values())} rejected{why}{cut}{sample}{kept}"
    )


def sum_lineage(manifests: list[ShardManifest]) -> list[dict[str, Any]]:
    """The lineage of a directory's shards added up stage by stage (`ShardManifest.lineage`). Shards
    of one run share their stages; a shard whose lineage is shorter (its input made before lineages
    were recorded) adds to the stages it names, counted from the last."""
    lineages = [m.lineage() for m in manifests]
    depth = max((len(x) for x in lineages), default=0)
    out = []
    for back in range(depth, 0, -1):
        at = [x[-back] for x in lineages if len(x) >= back]
        out.append({"stage": at[0]["stage"], **sum_counts(at)})
    return out


# The layout of a stage's output directory. Everything that is not data starts with a dot:
# `datasets.load_dataset("parquet", data_dir=OUT)` skips hidden files and directories.
STAGE_FILE = ".stage.json"  # the StageRecord: what marks a directory as a stage's output
SHARDS_FILE = ".shards.json"  # input key -> shard name, fixed when an input is first planned
REJECTS_DIR = ".rejects"


def manifest_name(shard: str) -> str:
    """The file name of a shard's manifest: hidden, beside `part-NNNNN.parquet`."""
    return f".{shard}.manifest.json"


def is_manifest(name: str) -> bool:
    return name.startswith(".part-") and name.endswith(".manifest.json")


class StageRecord(BaseModel):
    """`.stage.json` at the root of a stage's output directory: one config per directory."""

    stage: str
    config: dict[str, Any]
    config_hash: str
    code_version: str
