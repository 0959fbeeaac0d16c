"""The weigh stage: a weighted directory's shards -> the same shards with new weights, no re-scoring.

Scoring is the expensive step; the weighting (minmax, quantile, clip, floor, invert, dtype, ...) is a
cheap function of the stored `entropy` column and the stored `excluded` positions, so trying another
one reads them back and writes `part-NNNNN.parquet` again through the same weighing path as the
score stage (`pipelines.weighted`): the same values and options give the same bytes. Its input may
be the output of `score` or of `weigh`. The file metadata is the input's with the new weighting; the
data stays self-describing (its tokenizer is carried forward).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from entroweight import __version__, storage
from entroweight.schemas import ShardManifest, read_file_metadata
from entroweight.schemas.datadir import DataDir, DataDirError
from entroweight.schemas.manifest import ShardInput
from entroweight.schemas.weighted import ENTROPY, excluded_mask, matrix
from entroweight.transforms.select import DocumentStep
from entroweight.transforms.tokenizer import TokenizerError, carry_tokenizer, data_tokenizer
from entroweight.transforms.weigh import WeighConfig

from .stage import ShardTask, Stage, StageError
from .weighted import WEIGHING_KEYS, WeightedShardWriter, check_steps, part_inputs, weighing_metadata

READ_ROWS = 4096  # rows read, weighed and written at a time


def weighted(data_dir) -> DataDir:
    """The weighted directory a weigh stage reads, refused unless it is one, complete."""
    try:
        return (
            DataDir(data_dir)
            .require("weighted", hint="score it first (`entroweight score`)")
            .require_documents()
            .require_one_config()
        )
    except DataDirError as e:
        raise StageError(str(e)) from None


class WeighStage(Stage):
    name = "weigh"

    def __init__(
        self,
        scored_dir: str | Path,
        weighting: WeighConfig,
        with_entropy: bool = True,
        steps: list[DocumentStep] | None = None,
    ):
        self.data_dir = str(scored_dir)
        self.weighting, self.with_entropy = weighting, with_entropy
        self.steps = list(steps or [])

    @cached_property
    def data(self) -> DataDir:
        return weighted(self.data_dir)

    @cached_property
    def input_meta(self) -> dict[str, Any]:
        return read_file_metadata(self.data.files[0])

    def _prepare(self) -> None:
        for f, schema in zip(self.data.files, self.data.part_schemas, strict=True):
            _check_values_stored(f, schema)
        try:
            path = data_tokenizer(self.data_dir, self.input_meta["tokenizer_sha256"])
        except TokenizerError as e:
            raise StageError(str(e)) from None
        self.tokenizer_path = storage.key(path) if path else None
        check_steps(self.steps, self.input_meta)

    def config(self) -> dict[str, Any]:
        # the input's config hash names its scorer and tokenizer; a re-scored input is another config
        return {
            "input_config_hash": self.input_meta["config_hash"],
            **weighing_metadata(self.weighting, self.steps),
            "with_entropy": self.with_entropy,
        }

    def plan_inputs(self) -> list[ShardInput]:
        self.prepare()
        return part_inputs(self.data, "scored")

    def carry(self, out_dir) -> None:
        if self.tokenizer_path is not None:
            carry_tokenizer(self.tokenizer_path, out_dir)

    def file_metadata(self) -> dict[str, Any]:
        inherited = {k: v for k, v in self.input_meta.items() if k not in WEIGHING_KEYS}
        return {
            **inherited,
            "stage": self.name,
            "config_hash": self.config_hash,
            "code_version": __version__,
            "scored_config_hash": self.input_meta.get("scored_config_hash", self.input_meta["config_hash"]),
            **weighing_metadata(self.weighting, self.steps),
        }

    def process(self, task: ShardTask) -> ShardManifest:
        (inp,) = task.inputs
        source = pq.ParquetFile(storage.open_input(inp.uri))
        first = 0
        with WeightedShardWriter(
            self, task, self.file_metadata(), self.weighting, self.with_entropy, self.steps
        ) as out:
            for batch in source.iter_batches(batch_size=READ_ROWS):
                values = matrix(batch.column(ENTROPY))
                out.add(batch, values, excluded_mask(batch.column("excluded"), values.shape[1]), first)
                first += batch.num_rows
            return out.finish()


def _check_values_stored(path: str, schema) -> None:
    """A shard the stage can re-weigh: its raw values are stored (not scored with --drop-entropy)."""
    if ENTROPY not in schema.names:
        raise StageError(
            f"{path} was scored with --drop-entropy: there are no stored entropies to re-weigh; "
            "score the tokenized data again without --drop-entropy"
        )
