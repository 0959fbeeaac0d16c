"""stored: the values another score run already stored (its `entropy` column), for weighing them anew.

A weighting that needs the whole dataset's values first (`topk`, `quantile`) would otherwise score
twice: once to store the values and learn their quantiles, once to weigh. With `scores=DIR` (a scored
directory of the same tokenized data), each row gets the stored values of the row with the same ids
and padding; a row that DIR does not hold is refused. Rows are matched by content, so any sharding
works; identical rows have identical values. DIR's rows are held in memory (about 4 bytes per token):
for a dataset that does not fit, score twice instead.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from .base import Scorer, ScorerError, ScorerOptions


def _row_key(ids: np.ndarray, n_pad: int) -> bytes:
    return hashlib.blake2b(
        np.asarray(ids, dtype=np.int64).tobytes() + int(n_pad).to_bytes(8, "little")
    ).digest()


class StoredScorer(Scorer):
    name = "stored"
    _heavy = (*Scorer._heavy, "_values")

    class Options(ScorerOptions):
        scores: str = Field(description="A scored directory of the same data (a workflow's values_from).")

    def __init__(self, scores: str | None = None, batch_size: int = 16, device: str = "cpu", **options: Any):
        super().__init__(batch_size=batch_size, device=device, **options)
        if scores is None:
            raise ScorerError("the stored scorer needs scores=DIR: a scored directory with an entropy column")
        self.scores = Path(scores)
        self.files = sorted(self.scores.glob("part-*.parquet"))
        if not self.files:
            raise ScorerError(f"{scores} holds no part-*.parquet: score the data first")
        from entroweight.schemas import read_file_metadata

        self._meta = read_file_metadata(self.files[0])
        self._values = None

    @property
    def unit(self) -> str:
        return self._meta.get("unit", "unknown")

    def config(self) -> dict[str, Any]:
        from entroweight.transforms.writer import sha256_file

        return {
            "scorer": self.name,
            "source_scorer": self._meta.get("scorer"),
            "source_config_hash": self._meta.get("config_hash"),
            "source_sha256": [sha256_file(f) for f in self.files],
        }

    def check_data_tokenizer(self, sha256: str, data_tokenizer=None) -> None:
        if self._meta.get("tokenizer_sha256") != sha256:
            raise ScorerError(f"{self.scores} was scored on data of another tokenizer than this data")

    def metadata(self) -> dict[str, Any]:
        keep = ("scorer", "model", "checkpoint", "reference", "start_token")
        return {**super().metadata(), "source": {k: self._meta[k] for k in keep if k in self._meta}}

    def setup(self, data_tokenizer=None) -> None:
        if self._values is not None:
            return
        import pyarrow.parquet as pq

        values = {}
        for f in self.files:
            t = pq.read_table(f, columns=["input_ids", "n_pad", "entropy"])
            ids = np.stack(t.column("input_ids").to_numpy(zero_copy_only=False))
            ent = np.stack(t.column("entropy").to_numpy(zero_copy_only=False)).astype(np.float32)
            for row, pad, e in zip(ids, t.column("n_pad").to_numpy(), ent, strict=True):
                values[_row_key(row, pad)] = e
        self._values = values

    def score(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
        out = np.zeros(np.shape(input_ids), dtype=np.float32)
        for r, (row, pad) in enumerate(zip(np.asarray(input_ids), np.asarray(n_pad), strict=True)):
            v = self._values.get(_row_key(row, pad))
            if v is None or v.shape != row.shape:
                raise ScorerError(
                    f"row {r} of this batch is not in {self.scores}: score the same tokenized data"
                )
            out[r] = v
        return out
