"""The score stage: a tokenized directory's shards -> weighted shards (ids + entropy + weight).

Each `part-NNNNN.parquet` of sequences becomes a `part-NNNNN.parquet` of weighted sequences (the
same name) in the output directory, with its manifest. The file metadata is the input's plus the
scorer, its model id / checkpoint sha256, the aggregate and the weighting. Input whose tokenizer is
not the one the scorer reads is refused before any work.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from entroweight import __version__, storage
from entroweight.schemas import (
    ShardManifest,
    read_file_metadata,
    weighted_sequence_schema,
    with_file_metadata,
)
from entroweight.schemas.arrow import WEIGHTED_COLUMNS
from entroweight.schemas.manifest import ShardInput
from entroweight.schemas.weighted import encode_excluded
from entroweight.scorers import Scorer, ScorerError, make_scorer
from entroweight.transforms.tokenize import fixed_lists
from entroweight.transforms.tokenizer import (
    TokenizerError,
    carry_tokenizer,
    data_tokenizer,
    load_tokenizer,
    tokenizer_from_bytes,
)
from entroweight.transforms.weigh import NonFiniteScores, WeighConfig, encode_weights, weigh
from entroweight.transforms.writer import PARQUET_OPTIONS, AtomicParquetWriter

from .stage import ShardTask, Stage, StageError

WRITE_ROWS = 256  # rows weighed and written at a time
# rows planned and scored together: the whole shard up to this (batches sorted by length over all of
# it), else segments of it in shard order, so that memory stays bounded and the writer thread weighs
# and writes one segment while the next is scored
SEGMENT_ROWS = 16384
READ_ROWS = 256  # the segment of a scorer that batches its own way (nothing to plan over the shard)


def parquet_options(weight_dtype: str, with_entropy: bool) -> dict:
    """The writer's options plus byte-stream-split where it pays: Parquet stores uint8 as INT32, and
    split streams let zstd drop the three zero bytes (C4: 0.97 vs 1.21 B per token, near the 0.92 B
    entropy of the weights); float32 entropy compresses better split as well."""
    split = {"weight.list.element": "BYTE_STREAM_SPLIT"} if weight_dtype == "uint8" else {}
    if with_entropy:
        split["entropy.list.element"] = "BYTE_STREAM_SPLIT"
    return {**PARQUET_OPTIONS, "column_encoding": split} if split else dict(PARQUET_OPTIONS)


def check_device(device: str) -> None:
    """Where the scorer runs (a worker, or the local engine's driver): is its device here?"""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise StageError(f"--device {device} but no CUDA device is visible here; use --device cpu")


def max_id(files: list[str]) -> tuple[int, str | None]:
    """The largest token id in the shards, and the first file holding it (one read of input_ids)."""
    top, where = -1, None
    for f in files:
        for batch in open_parquet(f).iter_batches(batch_size=4096, columns=["input_ids"]):
            m = pc.max(pc.list_flatten(batch.column("input_ids"))).as_py()
            if m is not None and m > top:
                top, where = m, f
    return top, where


def open_parquet(path: str) -> pq.ParquetFile:
    return pq.ParquetFile(storage.open_input(path))


def input_sizes(data_dir: str, after: str = "tokenize") -> dict[str, int]:
    """{shard file: size} of a stage's output directory, local or a URL, from one listing."""
    d = storage.path(data_dir)
    sizes = {
        storage.url(d / n): size
        for n, size in sorted(storage.listing(d).items())
        if n.startswith("part-") and n.endswith(".parquet")
    }
    if not sizes:
        raise StageError(f"{data_dir} holds no part-*.parquet: {after} first (`entroweight {after}`)")
    return sizes


def input_files(data_dir: str, after: str = "tokenize") -> list[str]:
    return list(input_sizes(data_dir, after))


def plan_part_inputs(data_dir: str, fmt: str) -> list[ShardInput]:
    """One shard per input part file, keyed by its size (and local mtime): a changed file recomputes."""
    out = []
    for f, size in input_sizes(data_dir).items():
        mtime_ns = os.stat(f).st_mtime_ns if storage.is_local(f) else None
        out.append(ShardInput(uri=f, fmt=fmt, size=size, mtime_ns=mtime_ns))
    return out


class ScoreStage(Stage):
    name = "score"
    _heavy = ("_tok",)
    #: a progress bar of rows per shard (the local engine, whose workers share the terminal)
    row_progress: bool = False

    def __init__(
        self,
        data_dir: str | Path,
        scorer: str | Scorer,
        scorer_options: dict[str, Any] | None = None,
        weighting: WeighConfig | None = None,
        with_entropy: bool = True,
        tokenizer: str | None = None,
        batch_tokens: int | None = None,
        cpus_per_worker: int = 1,
    ):
        if cpus_per_worker < 1:
            raise StageError(f"--cpus-per-worker must be at least 1, not {cpus_per_worker}")
        #: CPUs each worker asks for (its tokenizing/aligning/writing threads beside the model)
        self.cpus_per_worker = cpus_per_worker
        if batch_tokens is not None and batch_tokens < 1:
            raise StageError(f"--batch-tokens must be at least 1, not {batch_tokens}")
        #: token budget per forward (rows × width); None: the scorer's batch_size rows. Speed, not values
        self.batch_tokens = batch_tokens
        self.data_dir = storage.key(data_dir)
        self.weighting = weighting or WeighConfig()
        self.with_entropy = with_entropy
        files = input_files(data_dir)
        self.input_meta = read_file_metadata(files[0])
        self._check_inputs(files)
        sha = self.input_meta["tokenizer_sha256"]
        try:  # --tokenizer, else the copy the data carries; either checked against the data's sha256
            path = data_tokenizer(data_dir, sha, tokenizer)
        except TokenizerError as e:
            raise StageError(str(e)) from None
        self.tokenizer_path = storage.key(path) if path else None  # carried forward into --out
        # its bytes travel with the stage: workers may share no disk with the driver
        self.tokenizer_json = path.read_bytes() if path else None
        self.scorer = scorer if isinstance(scorer, Scorer) else make_scorer(scorer, **(scorer_options or {}))
        self._tok = load_tokenizer(path) if path and (tokenizer or self.scorer.needs_data_tokenizer) else None
        if self.scorer.needs_data_tokenizer and self._tok is None:
            raise StageError(
                f"the {self.scorer.name} scorer reads the data's text and {data_dir} carries no tokenizer "
                "(it was made before data carried one): pass --tokenizer (the tokenizer.json that tokenized it)"
            )
        self.scorer.check_data_tokenizer(sha, self._tok)
        self._check_vocab(files)

    def _check_vocab(self, files: list[str]) -> None:
        """A model must have a row for every id of the data: refused here, not as an IndexError per shard.
        The data's ids are below its tokenizer's size, so the scan runs only when the model is smaller."""
        model_vocab = self.scorer.vocab_size()
        if model_vocab is None or model_vocab >= int(self.input_meta["vocab_size"]):
            return
        top, where = max_id(files)
        if top >= model_vocab:
            raise StageError(
                f"{where} holds token id {top}, but the {self.scorer.name} scorer's model reads ids below "
                f"{model_vocab} only (its vocab_size): score with a model of the data's tokenizer "
                f"({self.input_meta['vocab_size']} ids)"
            )

    def _check_inputs(self, files: list[str]) -> None:
        meta = self.input_meta
        if not meta or "input_ids" not in open_parquet(files[0]).schema_arrow.names:
            raise StageError(f"{files[0]} is not a tokenized shard (no entroweight metadata or input_ids)")
        if meta.get("padding_side", "left") != "left":
            raise StageError(f"{files[0]} is {meta['padding_side']}-padded; the scorers read left padding")
        for f in files[1:]:
            other = read_file_metadata(f).get("tokenizer_sha256")
            if other != meta["tokenizer_sha256"]:
                raise StageError(
                    f"{f} was tokenized with another tokenizer than {files[0]}: one per directory"
                )

    def setup(self) -> None:
        check_device(self.scorer.device)
        if getattr(self, "_tok", None) is None:
            self._tok = None
        if self._tok is None and self.tokenizer_json is not None:
            self._tok = tokenizer_from_bytes(self.tokenizer_json, self.tokenizer_path)
        self.scorer.setup(self._tok)

    def carry(self, out_dir) -> None:
        if self.tokenizer_path is not None:  # the weighted data stays self-describing
            carry_tokenizer(self.tokenizer_path, out_dir)

    def resources(self) -> dict[str, float]:
        # one accelerator per worker: one model copy on each, never several on one
        return {
            "num_cpus": self.cpus_per_worker,
            "num_gpus": 1 if self.scorer.device.startswith("cuda") else 0,
        }

    def config(self) -> dict[str, Any]:
        # batch size and device change speed, not values (to float tolerance): not hashed
        return {
            "input_tokenizer_sha256": self.input_meta["tokenizer_sha256"],
            "n_ctx": self.input_meta["n_ctx"],
            "packed": self.input_meta.get("packed", False),
            **self.scorer.config(),
            "weighting": self.weighting.model_dump(mode="json"),
            "with_entropy": self.with_entropy,
        }

    def plan_inputs(self) -> list[ShardInput]:
        return plan_part_inputs(self.data_dir, "sequences")

    def file_metadata(self) -> dict[str, Any]:
        cfg = self.scorer.config()
        return {
            **self.input_meta,
            "stage": self.name,
            "config_hash": self.config_hash,
            "code_version": __version__,
            **cfg,
            **self.scorer.metadata(),
            "weighting": self.weighting.model_dump(mode="json"),
            "weight_dtype": self.weighting.dtype,
            "value_convention": "value i is about predicting token i; pads 0 (docs/scoring.md)",
        }

    def process(self, task: ShardTask) -> ShardManifest:
        (inp,) = task.inputs
        source = open_parquet(inp.uri)
        meta = self.input_meta
        schema = weighted_sequence_schema(
            meta["vocab_size"], meta.get("packed", False), self.weighting.dtype, self.with_entropy
        )
        schema = with_file_metadata(schema, self.file_metadata())
        weight_type = schema.field("weight").type.value_type
        output = inp.uri.rsplit("/", 1)[-1]  # the input's part name
        self.scorer.reset_report()
        self.scorer.reset_padding_counts()
        n_bytes = 0
        start = time.perf_counter()
        options = parquet_options(self.weighting.dtype, self.with_entropy)
        # the shard's rows are planned at once (up to SEGMENT_ROWS): sorted by real length into
        # token-budget batches, each cut to its longest real row, values put back in row order
        table = source.read()
        rows = table.num_rows
        flat = pc.list_flatten(table.column("input_ids")).to_numpy(zero_copy_only=False)
        ids = flat.reshape(rows, -1) if rows else np.zeros((0, int(meta["n_ctx"])), dtype=np.int64)
        n_pad = table.column("n_pad").to_numpy().astype(np.int64)

        def write(writer, s: int, values: np.ndarray) -> int:
            """Weigh and write rows s.. of the shard (on the writer thread); returns their bytes."""
            n_bytes = 0
            for a in range(0, len(values), WRITE_ROWS):
                v = values[a : a + WRITE_ROWS]
                batch, pads = table.slice(s + a, len(v)), n_pad[s + a : s + a + len(v)]
                try:  # a NaN or inf value is refused with its rows, never given a weight
                    exclude = self.scorer.excluded(ids[s + a : s + a + len(v)], pads)
                    w = weigh(v, pads, self.weighting, first_row=s + a, exclude=exclude)
                except NonFiniteScores as e:
                    raise NonFiniteScores(f"{inp.uri}: {e}") from None
                weights = encode_weights(w, self.weighting.dtype)
                arrays = [
                    batch.column(name).combine_chunks().cast(schema.field(name).type)
                    for name in _sequence_columns(schema)
                ]
                if self.with_entropy:
                    arrays.append(fixed_lists(v.astype(np.float32), pa.float32()))
                arrays.append(encode_excluded(exclude, len(v)))
                arrays.append(fixed_lists(weights, weight_type))
                writer.write(pa.RecordBatch.from_arrays(arrays, schema=schema))
                n_bytes += int(pc.sum(batch.column("n_bytes")).as_py() or 0)
            return n_bytes

        # rows as they are scored, not only when the shard ends (mininterval 0: a batch takes seconds)
        bar = tqdm(
            total=rows, unit="row", desc=output, leave=False, mininterval=0, disable=not self.row_progress
        )
        path = storage.path(task.out_dir) / output
        with bar, AtomicParquetWriter(path, schema, options=options) as writer, ThreadPoolExecutor(1) as pool:
            self.scorer.set_batching(self.batch_tokens, bar.update)
            pending = None  # the previous segment's write: at most one in flight, in shard order
            step = self._segment_rows()
            try:
                for s in range(0, rows, step):
                    values = self.scorer.score(ids[s : s + step], n_pad[s : s + step])
                    bar.update(s + len(values) - bar.n)  # for scorers that report no batches
                    if pending is not None:
                        n_bytes += pending.result()
                    pending = pool.submit(write, writer, s, values)
                if pending is not None:
                    n_bytes += pending.result()
            finally:
                self.scorer.set_batching(self.batch_tokens, None)
            sha = writer.close()
        real = int(ids.size - n_pad.sum())
        computed, scored = self.scorer.padding_counts()
        seconds = time.perf_counter() - start
        from entroweight.scorers.forward import resolved_device

        return row_manifest(
            self,
            task,
            output,
            sha,
            rows,
            int(meta["n_ctx"]),
            real,
            n_bytes,
            {
                "scorer": self.scorer.name,
                "tokens_per_s": round(real / max(seconds, 1e-9), 1),
                # of the row positions the forwards computed, the share that were padding (for
                # cross_tokenizer, of its windows of model tokens; None: a scorer that counts none)
                "pad_fraction": round(1 - scored / computed, 4) if computed else None,
                "batch_tokens": self.batch_tokens,
                # resolved here, in the worker that ran the model (a driver may have no accelerator)
                "device": resolved_device(self.scorer.device),
                "dtype": getattr(self.scorer, "dtype", None),
            }
            | self.scorer.report(),
        )

    def _segment_rows(self) -> int:
        """A scorer whose rows go through `plan_batches` (Scorer.score, or scorers made of such) is
        planned over the whole shard; one that batches its own way (cross_tokenizer's windows of
        text) is given the shard 256 rows at a time, so its progress and memory stay as they were."""
        s = self.scorer
        return SEGMENT_ROWS if type(s).score is Scorer.score or s.parts() else READ_ROWS


def _sequence_columns(schema: pa.Schema) -> list[str]:
    return [n for n in schema.names if n not in WEIGHTED_COLUMNS]


__all__ = ["ScoreStage", "ScorerError", "input_files"]


def row_manifest(
    stage: Stage,
    task: ShardTask,
    output: str,
    sha: str,
    rows: int,
    n_ctx: int,
    real: int,
    n_bytes: int,
    extra: dict,
) -> ShardManifest:
    """The manifest of a row-to-row shard (score, weigh): every input row is written, none rejected."""
    return ShardManifest(
        shard=task.shard,
        stage=stage.name,
        inputs=list(task.inputs),
        output=output,
        output_sha256=sha,
        rows_out=rows,
        docs_in=rows,
        docs_out=rows,
        n_tokens=rows * n_ctx,
        n_real_tokens=real,
        n_bytes=n_bytes,
        config_hash=stage.config_hash,
        code_version=__version__,
        extra=extra,
    )
