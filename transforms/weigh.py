"""Raw per-token values (entropy, loss) -> loss weights in [0, 1]; pads weigh 0.

`minmax` (the write-up): per sequence, e = (x - min) / (max - min) over non-pad positions, w = 1 - e.
`quantile`: e = the rank of x among reference quantiles of a whole scored dataset (one scale for
all sequences: a calm sequence keeps high weights instead of being stretched to [0, 1]).
`raw`: e = x clipped to [0, 1], not normalised: the write-up's cosine weight w = 1 − m_cos (for
scores whose unit is already a [0, 1]-ish distance, e.g. occlusion's cosine).
`topk` (Rho-1's selection): w = 1 on the tokens whose value is in the top `keep` fraction of the
whole dataset (x >= the (1 − keep) quantile of the reference quantiles), 0 on the rest.
Then, in order: `clip` e to [lo, hi] and rescale, `invert` (w = e: Rho-1-style "keep the
learnable" when the values are excess losses), `floor` (w >= floor on real tokens).
A sequence whose values are all equal gets e = 0 (w = 1: unweighted).

A NaN or infinite value on a real token is refused (NonFiniteScores names the rows): a weight
derived from it would be arbitrary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from entroweight.schemas.arrow import WEIGHTED_COLUMNS
from entroweight.schemas.weighted import ENTROPY, encode_excluded, encode_weights, lists, weighable


class NonFiniteScores(ValueError):
    """A scorer returned NaN or inf on real tokens; the message names the rows."""


class WeighConfig(BaseModel):
    """Recorded in the file metadata (`weighting`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["minmax", "quantile", "raw", "topk"] = "minmax"
    quantiles: tuple[float, ...] | None = None  # reference values at evenly spaced ranks (quantile, topk)
    keep: float | None = None  # topk: the fraction of the dataset's tokens that weigh 1
    clip: tuple[float, float] | None = None  # on e, before 1 - e; then rescaled to [0, 1]
    floor: float = 0.0
    invert: bool = False
    dtype: Literal["float16", "uint8"] = "float16"

    @field_validator("floor")
    @classmethod
    def _floor(cls, v):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"floor must be in [0, 1], not {v}")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.method in ("quantile", "topk"):
            q = self.quantiles
            if not q or len(q) < 2 or np.any(np.diff(q) < 0):
                raise ValueError(
                    f"{self.method} weighting needs reference quantiles (at least 2, ascending): "
                    "compute them with entropy_quantiles(SCORED_DIR)"
                )
        if self.method == "topk":
            if self.keep is None or not 0.0 < self.keep <= 1.0:
                raise ValueError(f"topk weighting needs keep in (0, 1] (the fraction kept), not {self.keep}")
            if self.clip is not None or self.invert:
                raise ValueError("topk weights are 0 or 1: clip and invert do not apply")
        elif self.keep is not None:
            raise ValueError(f"keep is a topk option, not one of {self.method} weighting")
        if self.clip is not None and not 0.0 <= self.clip[0] < self.clip[1] <= 1.0:
            raise ValueError(f"clip must be 0 <= lo < hi <= 1, not {self.clip}")
        return self


def check_finite(values: np.ndarray, n_pad: np.ndarray, first_row: int = 0) -> None:
    """Raise NonFiniteScores naming the rows (counted from `first_row`) with NaN/inf on real tokens."""
    x = np.asarray(values)
    bad = ~np.isfinite(x) & weighable(n_pad, x.shape[1])
    if bad.any():
        rows = np.flatnonzero(bad.any(axis=1)) + first_row
        shown = ", ".join(map(str, rows[:10])) + (f" and {len(rows) - 10} more" if len(rows) > 10 else "")
        raise NonFiniteScores(
            f"the scorer returned NaN or inf on {int(bad.sum())} real token(s) of {len(rows)} row(s) "
            f"(rows {shown}): no weight can be derived from them; check the model and its dtype "
            "(e.g. --dtype fp32)"
        )


def topk_threshold(cfg: WeighConfig) -> float:
    """The value at rank 1 − keep of the reference quantiles (linear between them)."""
    q = np.asarray(cfg.quantiles, dtype=np.float64)
    return float(np.interp(1.0 - cfg.keep, np.linspace(0.0, 1.0, len(q)), q))


def normalize(
    values: np.ndarray, n_pad: np.ndarray, cfg: WeighConfig, exclude: np.ndarray | None = None
) -> np.ndarray:
    """(B, T) raw values -> e in [0, 1] (float32); pads (and `exclude`) 0. For `topk`, e = 0 on kept
    tokens, 1 on the rest."""
    x = np.asarray(values, dtype=np.float64)
    mask = weighable(n_pad, x.shape[1], exclude)
    if cfg.method == "topk":
        e = np.where(x >= topk_threshold(cfg), 0.0, 1.0)
    elif cfg.method == "raw":
        e = x
    elif cfg.method == "minmax":
        lo = np.where(mask, x, np.inf).min(axis=1, keepdims=True)
        hi = np.where(mask, x, -np.inf).max(axis=1, keepdims=True)
        span = hi - lo
        ok = np.isfinite(span) & (span > 0)
        e = np.where(ok, (x - np.where(ok, lo, 0)) / np.where(ok, span, 1), 0.0)
    else:
        q = np.asarray(cfg.quantiles, dtype=np.float64)
        e = np.interp(x, q, np.linspace(0.0, 1.0, len(q)))
    if cfg.clip is not None:
        lo, hi = cfg.clip
        e = (np.clip(e, lo, hi) - lo) / (hi - lo)
    return np.where(mask, np.clip(e, 0.0, 1.0), 0.0).astype(np.float32)


def weigh(
    values: np.ndarray,
    n_pad: np.ndarray,
    cfg: WeighConfig,
    first_row: int = 0,
    exclude: np.ndarray | None = None,
) -> np.ndarray:
    """(B, T) raw values -> weights in [0, 1] (float32); pads and `exclude`d positions 0. NaN/inf on a
    real token is refused (NonFiniteScores names the rows, counted from `first_row`)."""
    check_finite(values, n_pad, first_row)
    e = normalize(values, n_pad, cfg, exclude)
    w = e if cfg.invert else 1.0 - e
    if cfg.floor:
        w = np.maximum(w, cfg.floor)
    return np.where(weighable(n_pad, w.shape[1], exclude), w, 0.0).astype(np.float32)


def weighted_batch(
    sequences: pa.RecordBatch,
    values: np.ndarray,
    excluded: np.ndarray | None,
    cfg: WeighConfig,
    schema: pa.Schema,
    first_row: int = 0,
) -> pa.RecordBatch:
    """The one path from a batch of sequences and their raw values to weighted sequences: weigh
    (exclusions honoured), encode, and lay out as `schema` (a weighted_sequence_schema; its entropy
    column kept or not). The score stage, the weigh stage and a workflow's `values_from` all come
    here, so the same values and options give the same bytes whichever command wrote them."""
    n_pad = sequences.column("n_pad").to_numpy().astype(np.int64)
    weights = encode_weights(weigh(values, n_pad, cfg, first_row, excluded), cfg.dtype)
    columns = {name: sequences.column(name) for name in schema.names if name not in WEIGHTED_COLUMNS}
    columns[ENTROPY] = lists(np.asarray(values, dtype=np.float32), pa.float32())
    columns["excluded"] = encode_excluded(excluded, len(values))
    columns["weight"] = lists(weights, schema.field("weight").type.value_type)
    arrays = [columns[name].cast(schema.field(name).type) for name in schema.names]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def entropy_quantiles(scored: str | Path, n: int = 101, max_tokens: int = 5_000_000) -> tuple[float, ...]:
    """`n` evenly spaced quantiles of the `entropy` column of a scored directory's real tokens
    (the reference for `quantile` weighting; read from the first `max_tokens` real tokens)."""
    import pyarrow.parquet as pq

    files = sorted(Path(scored).glob("part-*.parquet")) if Path(scored).is_dir() else [Path(scored)]
    chunks, total = [], 0
    for f in files:
        table = pq.read_table(f, columns=["entropy", "n_pad"])
        if "entropy" not in table.column_names or table.num_rows == 0:
            continue
        e = np.stack(table.column("entropy").to_numpy(zero_copy_only=False))
        vals = e[weighable(table.column("n_pad").to_numpy(), e.shape[1])]
        chunks.append(vals)
        total += vals.size
        if total >= max_tokens:
            break
    if not chunks:
        raise ValueError(f"{scored} holds no `entropy` column: score it without --drop-entropy first")
    q = np.quantile(np.concatenate(chunks), np.linspace(0.0, 1.0, n))
    return tuple(float(v) for v in q)
