"""The weigh stage: a weighted directory's shards -> the same shards with new weights, no re-scoring.

Scoring is the expensive step; the weighting (minmax, quantile, clip, floor, invert, dtype, ...) is a
cheap function of the stored `entropy` column and the stored `excluded` positions, so trying another
one reads them back and writes `part-NNNNN.parquet` again through the same weighing path as the
score stage (`pipelines.weighted`): the same values and options give the same bytes. Its input may
be the output of `score` or of `weigh`. The file metadata is the input's with the new weighting; the
data stays self-describing (its tokenizer is carried forward).

Given a second weighted directory and an op (`combine`), the values weighed are derived from both
(transforms/derive.py: Rho-1's excess as causal loss minus a reference's stored loss): the two must
hold the same parts, rows and tokens (refused otherwise) and their values one unit.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from entroweight import __version__, storage
from entroweight.schemas import ShardManifest
from entroweight.schemas.datadir import DataDir, DataDirError
from entroweight.schemas.manifest import ShardInput
from entroweight.schemas.weighted import ENTROPY, EXCLUDED, excluded_mask, matrix
from entroweight.transforms.derive import DeriveError, combine, derived_unit, same_tokens
from entroweight.transforms.select import DocumentStep
from entroweight.transforms.tokenizer import TokenizerError, carry_tokenizer, data_tokenizer
from entroweight.transforms.weigh import WeighConfig

from .stage import ShardTask, Stage, StageError
from .weighted import (
    WEIGHING_KEYS,
    WeightedShardWriter,
    check_steps,
    part_inputs,
    part_lineages,
    read_input,
    weighing_metadata,
)

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
        combine: tuple[str, str | Path] | None = None,
    ):
        self.data_dir = str(scored_dir)
        self.weighting, self.with_entropy = weighting, with_entropy
        self.steps = list(steps or [])
        #: (op, other weighted directory): the values weighed are op(these, those)
        self.op, self.other_dir = (combine[0], str(combine[1])) if combine else (None, None)

    @cached_property
    def data(self) -> DataDir:
        return weighted(self.data_dir)

    @cached_property
    def other(self) -> DataDir | None:
        return weighted(self.other_dir) if self.other_dir is not None else None

    @cached_property
    def other_meta(self) -> dict[str, Any]:
        return self.other.metadata

    @cached_property
    def input_meta(self) -> dict[str, Any]:
        return self.data.metadata

    def _prepare(self) -> None:
        for f, schema in zip(self.data.files, self.data.part_schemas, strict=True):
            _check_values_stored(f, schema)
        if self.other is not None:
            self._check_other()
        try:
            path = data_tokenizer(self.data_dir, self.input_meta["tokenizer_sha256"])
        except TokenizerError as e:
            raise StageError(str(e)) from None
        self.tokenizer_path = storage.key(path) if path else None
        check_steps(self.steps, self.input_meta)

    def _check_other(self) -> None:
        """The second directory of a combination: stored values of the same tokens, in the same unit."""
        for f, schema in zip(self.other.files, self.other.part_schemas, strict=True):
            _check_values_stored(f, schema)
        a, b = self.input_meta, self.other_meta
        for key in ("tokenizer_sha256", "n_ctx", "packed"):
            if a.get(key) != b.get(key):
                raise StageError(
                    f"{self.data_dir} and {self.other_dir} differ in {key} ({a.get(key)!r} vs {b.get(key)!r}): "
                    "derived values combine two scores of the same tokenized data"
                )
        mine = {p.name: p.manifest.rows_out for p in self.data.parts}
        theirs = {p.name: p.manifest.rows_out for p in self.other.parts}
        if mine != theirs:
            raise StageError(
                f"{self.data_dir} and {self.other_dir} hold other parts or rows ({len(mine)} vs "
                f"{len(theirs)} parts, {sum(mine.values())} vs {sum(theirs.values())} rows): derived values "
                "combine two scores of the same tokenized data, whole (no limit_rows/limit_shards sample)"
            )
        try:
            self.unit = derived_unit(
                self.op, a.get("unit"), b.get("unit"), (a.get("aggregate"), b.get("aggregate"))
            )
        except DeriveError as e:
            raise StageError(f"{self.data_dir} and {self.other_dir}: {e}") from None

    def config(self) -> dict[str, Any]:
        # the input's config hash names its scorer and tokenizer; a re-scored input is another config
        derived = {}
        if self.other is not None:  # the other directory's shards by content: any change recomputes
            derived = {
                "op": self.op,
                "other_config_hash": self.other_meta["config_hash"],
                "other_parts": [(p.name, p.manifest.output_sha256) for p in self.other.parts],
            }
        return {
            "input_config_hash": self.input_meta["config_hash"],
            **weighing_metadata(self.weighting, self.steps),
            "with_entropy": self.with_entropy,
            **derived,
        }

    def input_paths(self) -> list[str]:
        # the other directory is read too: --out may not be it
        theirs = [self.other_dir, *(p.location for p in self.other.parts)] if self.other is not None else []
        return list(dict.fromkeys([*super().input_paths(), *theirs]))

    def plan_inputs(self) -> list[ShardInput]:
        self.prepare()
        self.lineages = part_lineages(self.data)  # what each input shard's documents went through
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
            **(self._derived_metadata() if self.other is not None else {}),
        }

    def _derived_metadata(self) -> dict[str, Any]:
        side = ("scorer", "config_hash", "unit", "aggregate")
        return {
            "unit": self.unit,
            "derived": {
                "op": self.op,
                "a": {k: self.input_meta.get(k) for k in side},
                "b": {k: self.other_meta.get(k) for k in side},
            },
        }

    def process(self, task: ShardTask) -> ShardManifest:
        (inp,) = task.inputs
        source = read_input(inp)
        batches = source.iter_batches(batch_size=READ_ROWS)
        others = None
        if self.other is not None:  # the same part of the other directory, read alongside
            name = inp.uri.rsplit("/", 1)[-1]
            part = next(p for p in self.other.parts if p.name == name)
            others = pq.ParquetFile(pa.BufferReader(part.read())).iter_batches(batch_size=READ_ROWS)
        first = 0
        with WeightedShardWriter(
            self, task, self.file_metadata(), self.weighting, self.with_entropy, self.steps
        ) as out:
            for batch in batches:
                values, excluded = _values(batch)
                if others is not None:
                    theirs = next(others)
                    same_tokens(batch, theirs, f"{inp.uri} rows {first}..")
                    values_b, excluded_b = _values(theirs)
                    values, excluded = combine(self.op, values, values_b, excluded, excluded_b)
                out.add(batch, values, excluded, first)
                first += batch.num_rows
            return out.finish()


def _values(batch) -> tuple:
    """(values, excluded) stored in a weighted batch."""
    values = matrix(batch.column(ENTROPY))
    return values, excluded_mask(batch.column(EXCLUDED), values.shape[1])


def _check_values_stored(path: str, schema) -> None:
    """A shard the stage can re-weigh: its raw values are stored (not scored with --drop-entropy)."""
    if ENTROPY not in schema.names:
        raise StageError(
            f"{path} was written with --drop-entropy (by score or weigh): there are no stored entropies to re-weigh; "
            "score the tokenized data again without --drop-entropy"
        )
