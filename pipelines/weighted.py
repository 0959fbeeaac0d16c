"""What the stages that write weighted sequences share (score, weigh): their inputs, the file
metadata they replace, and the shard writer that runs the one weighing path.

`WeightedShardWriter` takes a shard's sequences and raw values segment by segment, and on its own
thread weighs them (`transforms.weigh.weighted_batch`), runs the document steps
(`transforms.select`), writes the parquet and counts what the manifest records; at most one segment
is in flight, so the next one is scored (or read) while this one is written, and memory holds two
segments whatever the shard's size.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from entroweight import __version__, storage
from entroweight.schemas import REJECT_SCHEMA, ShardManifest
from entroweight.schemas.arrow import document_count, weighted_sequence_schema, with_file_metadata
from entroweight.schemas.datadir import DataDir, read_checked
from entroweight.schemas.manifest import NOT_READ, REJECTS_DIR, UPSTREAM, ShardInput
from entroweight.schemas.weighted import real_mask
from entroweight.transforms.select import DocumentStep, StepError
from entroweight.transforms.weigh import NonFiniteScores, WeighConfig, weighted_batch
from entroweight.transforms.writer import PARQUET_OPTIONS, AtomicParquetWriter, write_table_atomic

from .stage import ShardTask, Stage, StageError

# what a weighted file's metadata says about its weighting and steps: replaced, never inherited
WEIGHING_KEYS = ("weighting", "weight_dtype", "steps")


def parquet_options(weight_dtype: str, with_entropy: bool, with_surprisal: bool = False) -> dict:
    """The writer's options plus byte-stream-split where it pays: Parquet stores uint8 as INT32, and
    split streams let zstd drop the three zero bytes (C4: 0.97 vs 1.21 B per token, near the 0.92 B
    entropy of the weights); float32 entropy compresses better split as well."""
    split = {"weight.list.element": "BYTE_STREAM_SPLIT"} if weight_dtype == "uint8" else {}
    if with_entropy:
        split["entropy.list.element"] = "BYTE_STREAM_SPLIT"
    if with_surprisal:
        split["surprisal.list.element"] = "BYTE_STREAM_SPLIT"
    return {**PARQUET_OPTIONS, "column_encoding": split} if split else dict(PARQUET_OPTIONS)


def part_locations(data: DataDir) -> list[str]:
    """Where a stage that reads `data` records each committed part it reads: its canonical location
    (`storage.key`: absolute and resolved, or the URL), as tokenize records its sources, so that
    `verify` and a rerun find the same input whatever the working directory."""
    root = storage.key(data.root)  # once: it resolves the path
    return [f"{root}/{p.name}" for p in data.parts]


def part_inputs(data: DataDir, fmt: str) -> list[ShardInput]:
    """One shard per committed part of `data`, keyed by its size and sha256 (from its manifest): a
    changed part recomputes, and the worker reads it checked against that sha256 (`read_input`)."""
    return [
        ShardInput(
            uri=uri,
            fmt=fmt,
            size=p.size,
            mtime_ns=storage.stat(p.location)[1],
            sha256=p.manifest.output_sha256,
        )
        for p, uri in zip(data.parts, part_locations(data), strict=True)
    ]


def part_lineages(data: DataDir) -> dict[str, list[dict[str, Any]]]:
    """Each committed part's lineage (`ShardManifest.lineage`) by the location a stage records it
    (`part_locations`): what the weighted shard made from it carries forward."""
    return {uri: p.manifest.lineage() for p, uri in zip(data.parts, part_locations(data), strict=True)}


def read_input(inp: ShardInput) -> pq.ParquetFile:
    """The input shard of a task, read once, whole, and refused (ShardMismatch) unless its bytes are
    those its manifest recorded when it was planned. Its compressed bytes are held in memory (a
    fraction of what the stage decodes from them); its rows are still decoded batch by batch."""
    return pq.ParquetFile(pa.BufferReader(read_checked(inp.uri, inp.size, inp.sha256)))


def check_steps(steps: list[DocumentStep], meta: dict[str, Any]) -> None:
    for step in steps:
        try:
            step.check(meta)
        except StepError as e:
            raise StageError(str(e)) from None


def weighing_metadata(weighting: WeighConfig, steps: list[DocumentStep]) -> dict[str, Any]:
    return {
        "weighting": weighting.model_dump(mode="json"),
        "steps": [{"step": s.name, **s.config()} for s in steps],
    }


class WeightedShardWriter:
    """One weighted shard: `add` segments in shard order, then `finish` -> its ShardManifest."""

    def __init__(
        self,
        stage: Stage,
        task: ShardTask,
        meta: dict[str, Any],
        weighting: WeighConfig,
        with_entropy: bool,
        steps: list[DocumentStep],
        output: str | None = None,
        with_surprisal: bool = False,
    ):
        """`output`: the parquet's name (default: the input part's name, as score and weigh write);
        `with_surprisal`: the sequences added carry a `surprisal` column, written beside the entropy."""
        (self.input,) = task.inputs
        self.stage, self.task, self.weighting, self.steps = stage, task, weighting, steps
        schema = weighted_sequence_schema(
            meta["vocab_size"], meta.get("packed", False), weighting.dtype, with_entropy, with_surprisal
        )
        self.schema = with_file_metadata(schema, meta)
        self.n_ctx = int(meta["n_ctx"])
        self.output = output or self.input.uri.rsplit("/", 1)[-1]  # the input's part name
        self.out = storage.path(task.out_dir)
        self.counts = collections.Counter()
        self.rejects: list[dict] = []
        self.started = time.perf_counter()
        self._writer = AtomicParquetWriter(
            self.out / self.output,
            self.schema,
            options=parquet_options(weighting.dtype, with_entropy, with_surprisal),
        )
        self._pool = ThreadPoolExecutor(1)
        self._pending: Future | None = None

    def __enter__(self) -> WeightedShardWriter:
        self._writer.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._pool.shutdown(wait=True)
        self._writer.__exit__(exc_type, exc, tb)

    def add(
        self, sequences: pa.RecordBatch, values: np.ndarray, excluded: np.ndarray | None, first_row: int
    ) -> None:
        """Weigh and write these rows (rows `first_row`.. of the shard) on the writer thread, once the
        previous segment is written."""
        self._wait()
        self._pending = self._pool.submit(self._write, sequences, values, excluded, first_row)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _write(self, sequences: pa.RecordBatch, values: np.ndarray, excluded, first_row: int) -> None:
        try:  # a NaN or inf value is refused with its rows, never given a weight
            batch = weighted_batch(sequences, values, excluded, self.weighting, self.schema, first_row)
        except NonFiniteScores as e:
            raise NonFiniteScores(f"{self.input.uri}: {e}") from None
        self.counts["rows_in"] += batch.num_rows
        self.counts["docs_in"] += document_count(batch)  # as tokenize counted them: packed rows too
        kept: pa.Table | pa.RecordBatch = batch
        for step in self.steps:
            kept, rejects = step.feed(_batch(kept), self.input.uri)
            self._reject(rejects)
        self._emit(kept)

    def _reject(self, rejects: list[dict]) -> None:
        self.rejects += rejects
        self.counts["docs_rejected"] += len(rejects)

    def _emit(self, kept) -> None:
        batch = _batch(kept)
        if batch is None or batch.num_rows == 0:
            return
        self._writer.write(batch)
        n_pad = batch.column("n_pad").to_numpy()
        self.counts["rows_out"] += batch.num_rows
        self.counts["real"] += int(real_mask(n_pad, self.n_ctx).sum())
        self.counts["n_bytes"] += int(pc.sum(batch.column("n_bytes")).as_py() or 0)

    def finish(self, extra: dict[str, Any] | None = None) -> ShardManifest:
        self._wait()
        for i, step in enumerate(self.steps):  # what each step held back, through the steps after it
            kept, rejects = step.finish(self.input.uri)
            self._reject(rejects)
            for later in self.steps[i + 1 :]:
                if kept is None:
                    break
                kept, rejects = later.feed(_batch(kept), self.input.uri)
                self._reject(rejects)
            self._emit(kept)
        sha = self._writer.close()
        rejects_file = rejects_sha = rejects_size = None
        rejected = collections.Counter(r["reason"] for r in self.rejects)
        if self.rejects:
            rejects_file = f"{REJECTS_DIR}/{self.task.shard}.parquet"
            table = pa.Table.from_pylist(self.rejects, schema=REJECT_SCHEMA)
            rejects_sha, rejects_size = write_table_atomic(table, self.out / rejects_file)
        c = self.counts
        seconds = time.perf_counter() - self.started
        upstream = self.stage.lineages[self.input.uri]
        # a sample (score's first rows of each shard): the documents of the input shard left unread
        not_read = upstream[-1]["docs_out"] - c["docs_in"] if upstream else 0
        return ShardManifest(
            shard=self.task.shard,
            stage=self.stage.name,
            inputs=list(self.task.inputs),
            output=self.output,
            output_sha256=sha,
            rows_in=c["rows_in"],
            rows_out=c["rows_out"],
            docs_in=c["docs_in"],
            docs_out=c["docs_in"] - c["docs_rejected"],
            rejected=dict(rejected),
            rejects_file=rejects_file,
            rejects_sha256=rejects_sha,
            rejects_bytes=rejects_size,
            n_tokens=c["rows_out"] * self.n_ctx,
            n_real_tokens=c["real"],
            n_bytes=c["n_bytes"],
            config_hash=self.stage.config_hash,
            code_version=__version__,
            seconds=round(seconds, 3),
            extra={
                "tokens_per_s": round(c["real"] / max(seconds, 1e-9), 1),
                UPSTREAM: upstream,
                **({NOT_READ: not_read} if not_read > 0 else {}),
                **(extra or {}),
            },
        )


def _batch(kept) -> pa.RecordBatch | None:
    """A step's rows (a Table) as one record batch; None when there are none."""
    if kept is None or isinstance(kept, pa.RecordBatch):
        return kept
    batches = kept.combine_chunks().to_batches()
    return batches[0] if batches else None


__all__ = [
    "WeightedShardWriter",
    "parquet_options",
    "part_inputs",
    "part_lineages",
    "weighing_metadata",
    "check_steps",
]
