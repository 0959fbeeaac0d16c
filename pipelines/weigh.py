"""The weigh stage: a scored directory's shards -> the same shards with new weights, no re-scoring.

Scoring is the expensive step; the weighting (minmax, quantile, clip, floor, invert, dtype, ...) is a
cheap function of the stored `entropy` column, so trying another one reads the entropies back and
writes `part-NNNNN.parquet` again with a new `weight` column (same rows, same ids, same entropies)
and its manifest. The file metadata is the input's with the new weighting; the data stays
self-describing (its tokenizer is carried forward).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from entroweight import __version__, storage
from entroweight.schemas import (
    ShardManifest,
    read_file_metadata,
    weighted_sequence_schema,
    with_file_metadata,
)
from entroweight.schemas.manifest import ShardInput
from entroweight.schemas.weighted import excluded_mask
from entroweight.transforms.tokenize import fixed_lists
from entroweight.transforms.tokenizer import TokenizerError, carry_tokenizer, data_tokenizer
from entroweight.transforms.weigh import WeighConfig, encode_weights, weigh
from entroweight.transforms.writer import AtomicParquetWriter

from .score import (
    READ_ROWS,
    _sequence_columns,
    input_files,
    open_parquet,
    parquet_options,
    plan_part_inputs,
    row_manifest,
)
from .stage import ShardTask, Stage, StageError

# what a scored file's metadata says about its weighting: replaced, not inherited
_WEIGHT_KEYS = ("weighting", "weight_dtype")


class WeighStage(Stage):
    name = "weigh"

    def __init__(self, scored_dir: str | Path, weighting: WeighConfig, with_entropy: bool = True):
        self.data_dir = storage.key(scored_dir)
        self.weighting, self.with_entropy = weighting, with_entropy
        files = input_files(scored_dir, after="score")
        self.input_meta = read_file_metadata(files[0])
        for f in files:
            _check_scored(f, self.input_meta)
        try:
            path = data_tokenizer(scored_dir, self.input_meta["tokenizer_sha256"])
        except TokenizerError as e:
            raise StageError(str(e)) from None
        self.tokenizer_path = storage.key(path) if path else None

    def config(self) -> dict[str, Any]:
        # the input's config hash names its scorer and tokenizer; a re-scored input is another config
        return {
            "input_config_hash": self.input_meta["config_hash"],
            "weighting": self.weighting.model_dump(mode="json"),
            "with_entropy": self.with_entropy,
        }

    def plan_inputs(self) -> list[ShardInput]:
        return plan_part_inputs(self.data_dir, "scored")

    def carry(self, out_dir) -> None:
        if self.tokenizer_path is not None:
            carry_tokenizer(self.tokenizer_path, out_dir)

    def file_metadata(self) -> dict[str, Any]:
        inherited = {k: v for k, v in self.input_meta.items() if k not in _WEIGHT_KEYS}
        return {
            **inherited,
            "stage": self.name,
            "config_hash": self.config_hash,
            "code_version": __version__,
            "scored_config_hash": self.input_meta["config_hash"],
            "weighting": self.weighting.model_dump(mode="json"),
            "weight_dtype": self.weighting.dtype,
        }

    def process(self, task: ShardTask) -> ShardManifest:
        (inp,) = task.inputs
        source = open_parquet(inp.uri)
        meta = self.input_meta
        dtype = self.weighting.dtype
        schema = weighted_sequence_schema(
            meta["vocab_size"], meta.get("packed", False), dtype, self.with_entropy
        )
        schema = with_file_metadata(schema, self.file_metadata())
        weight_type = schema.field("weight").type.value_type
        output = inp.uri.rsplit("/", 1)[-1]
        rows = real = n_bytes = 0
        start = time.perf_counter()
        options = parquet_options(dtype, self.with_entropy)
        with AtomicParquetWriter(storage.path(task.out_dir) / output, schema, options=options) as writer:
            for batch in source.iter_batches(batch_size=READ_ROWS):
                n = batch.num_rows
                n_pad = batch.column("n_pad").to_numpy().astype(np.int64)
                entropy = pc.list_flatten(batch.column("entropy")).to_numpy(zero_copy_only=False)
                values = entropy.reshape(n, -1)
                excluded = excluded_mask(batch.column("excluded"), values.shape[1])
                weights = encode_weights(weigh(values, n_pad, self.weighting, exclude=excluded), dtype)
                arrays = [
                    batch.column(name).cast(schema.field(name).type) for name in _sequence_columns(schema)
                ]
                if self.with_entropy:
                    arrays.append(batch.column("entropy"))
                arrays.append(batch.column("excluded"))
                arrays.append(fixed_lists(weights, weight_type))
                writer.write(pa.RecordBatch.from_arrays(arrays, schema=schema))
                rows += n
                real += int(values.size - n_pad.sum())
                n_bytes += int(pc.sum(batch.column("n_bytes")).as_py() or 0)
            sha = writer.close()
        seconds = time.perf_counter() - start
        extra = {"tokens_per_s": round(real / max(seconds, 1e-9), 1)}
        return row_manifest(self, task, output, sha, rows, int(meta["n_ctx"]), real, n_bytes, extra)


def _check_scored(path: str, first: dict) -> None:
    """A shard the stage can re-weigh: scored, with its raw entropies, of the directory's tokenizer."""
    meta = read_file_metadata(path)
    names = pq.read_schema(path).names
    if not meta or "input_ids" not in names:
        raise StageError(f"{path} is not an entroweight shard (no entroweight metadata or input_ids)")
    if "entropy" not in names:
        if "weight" in names:
            raise StageError(
                f"{path} was scored with --drop-entropy: there are no stored entropies to re-weigh; "
                "score the tokenized data again without --drop-entropy"
            )
        raise StageError(f"{path} is not scored (no entropy column): score it first (`entroweight score`)")
    if meta.get("tokenizer_sha256") != first.get("tokenizer_sha256"):
        raise StageError(f"{path} was tokenized with another tokenizer than the rest of its directory")
    if meta.get("config_hash") != first.get("config_hash"):
        raise StageError(
            f"{path} was scored with another config than the rest of its directory: one config per directory"
        )
