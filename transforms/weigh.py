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
A sequence whose values are all equal gets e = 0 (w = 1: unweighted); so does one whose values
span no more than float32 noise (`FLAT_RTOL`, `FLAT_ATOL`), which min-max would stretch to [0, 1].
`shuffle` (a control): the row's weights, as above, permuted among its weighable positions (real and
not excluded; pads and excluded positions keep weight 0 where they are), seeded by the shuffle seed and
the row's `seq_id`: the same weights, with no information about which token gets which. The stored
`entropy` stays the scorer's, so re-weighing it reproduces the same permutation.

A NaN or infinite value on a real token is refused (NonFiniteScores names the rows): a weight
derived from it would be arbitrary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from entroweight.options import Options, Seed
from entroweight.schemas.arrow import WEIGHTED_COLUMNS
from entroweight.schemas.weighted import (
    ENTROPY,
    encode_excluded,
    encode_weights,
    lists,
    stored_at_least,
    weighable,
)


class NonFiniteScores(ValueError):
    """A scorer returned NaN or inf on real tokens; the message names the rows."""


METHODS = ("minmax", "quantile", "raw", "topk")
# `minmax`: a row whose values span no more than this is flat (weight 1 everywhere). Scores agree to
# ~1e-5 relative across batch shapes (fp32; tests/test_token_budget.py): a row of a repetitive text,
# its values equal but for that noise, was stretched to [0, 1] by it, and its weights changed with
# --batch-tokens (values 17.2233 ± 5e-5 gave weights 1, 0, 0.5, 1 and then 0.67, 0, 1, 1)
FLAT_RTOL, FLAT_ATOL = 1e-4, 1e-5
# the methods on one scale for a whole dataset: they read reference quantiles of its values
GLOBAL_SCALE = ("quantile", "topk")


class WeighOptions(Options):
    """How raw values become weights, as a user chooses it: the one declaration from which `score`'s
    and `weigh`'s flags, a workflow's `weighting:` keys and the docs' tables are generated. Each
    refusal is attributed to the field it is about, so every front end names it its own way."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal[METHODS] = Field(  # type: ignore[valid-type]
        "minmax",
        description="minmax: per row; quantile: ranks on the dataset's scale; raw: w = 1 − value clipped "
        "to [0, 1] (the write-up's cosine weight); topk: w = 1 on the dataset's top keep fraction by "
        "value, 0 elsewhere (Rho-1).",
    )
    keep: float | None = Field(
        None, gt=0, le=1, validate_default=True, description="topk: the fraction of the tokens kept (0.6)."
    )
    clip: tuple[float, float] | None = Field(
        None, description="Clip the normalised value to [LO, HI], then rescale to [0, 1]."
    )
    floor: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Minimum weight of a real token, rounded up to the next weight the dtype stores "
        "(uint8: a multiple of 1/255).",
    )
    invert: bool = Field(False, description="w = e instead of 1 − e (Rho-1: keep the high-excess tokens).")
    dtype: Literal["float16", "uint8"] = Field(
        "float16", description="Storage of the weights: float16, or uint8 holding round(255·w)."
    )
    shuffle: Seed | None = Field(
        None,
        description="Control: permute each row's weights among its real tokens, seeded by this and the "
        "row's seq_id (same weights, no information about which token is which).",
    )

    @field_validator("shuffle", mode="before")
    @classmethod
    def _seed(cls, v):
        # YAML's `shuffle: false` would otherwise be seed 0, which shuffles
        if isinstance(v, bool):
            raise ValueError("is a seed (an integer >= 0), not true/false; leave it out not to shuffle")
        return v

    @model_validator(mode="after")
    def _floor_as_stored(self):
        # the floor the weights are held to is one the dtype stores (schemas/weighted.py), and it is
        # recorded so: a floor that changes the bytes changes the config hash too
        stored = stored_at_least(self.floor, self.dtype)
        if stored != self.floor:
            self.__dict__["floor"] = stored  # frozen: set once, here, while validating
        return self

    @field_validator("keep")
    @classmethod
    def _keep(cls, v, info: ValidationInfo):
        method = info.data.get("method")  # absent when the method itself was refused
        if method == "topk" and v is None:
            raise ValueError("topk weighting needs it: the fraction of the tokens kept, in (0, 1]")
        if method not in (None, "topk") and v is not None:
            raise ValueError(f"applies to topk weighting only, not {method}")
        return v

    @field_validator("clip")
    @classmethod
    def _clip(cls, v, info: ValidationInfo):
        if v is not None and info.data.get("method") == "topk":
            raise ValueError("topk weights are 0 or 1: clip does not apply")
        if v is not None and not 0.0 <= v[0] < v[1] <= 1.0:
            raise ValueError(f"must be 0 <= LO < HI <= 1, not {v}")
        return v

    @field_validator("invert")
    @classmethod
    def _invert(cls, v, info: ValidationInfo):
        if v and info.data.get("method") == "topk":
            raise ValueError("topk weights are 0 or 1: invert does not apply")
        return v


class WeighConfig(WeighOptions):
    """The options and, for a method on a global scale, the reference quantiles read from a scored
    dataset. Recorded in the file metadata (`weighting`)."""

    quantiles: tuple[float, ...] | None = Field(
        None, validate_default=True, description="Reference values at evenly spaced ranks (quantile, topk)."
    )

    @field_validator("quantiles")
    @classmethod
    def _quantiles(cls, q, info: ValidationInfo):
        method = info.data.get("method")
        if method in GLOBAL_SCALE and (not q or len(q) < 2 or np.any(np.diff(q) < 0)):
            raise ValueError(
                f"{method} weighting needs reference quantiles (at least 2, ascending): "
                "compute them with entropy_quantiles(SCORED_DIR)"
            )
        return q


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
        ok = np.isfinite(span) & (
            span > np.maximum(FLAT_RTOL * np.maximum(np.abs(lo), np.abs(hi)), FLAT_ATOL)
        )
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
    keys: list[str] | None = None,
) -> np.ndarray:
    """(B, T) raw values -> weights in [0, 1] (float32); pads and `exclude`d positions 0. NaN/inf on a
    real token is refused (NonFiniteScores names the rows, counted from `first_row`). `keys`: each
    row's seq_id, which seeds a `shuffle` (required then)."""
    check_finite(values, n_pad, first_row)
    e = normalize(values, n_pad, cfg, exclude)
    w = e if cfg.invert else 1.0 - e
    if cfg.floor:  # one the dtype stores (WeighOptions rounds it up): no stored weight falls below it
        w = np.maximum(w, stored_at_least(cfg.floor, cfg.dtype))
    mask = weighable(n_pad, w.shape[1], exclude)
    w = np.where(mask, w, 0.0).astype(np.float32)
    if cfg.shuffle is not None:
        if keys is None:
            raise ValueError("a shuffled weighting needs each row's seq_id (weighted_batch passes them)")
        w = shuffle_rows(w, mask, keys, cfg.shuffle)
    return w


def shuffle_rows(w: np.ndarray, mask: np.ndarray, keys: list[str], seed: int) -> np.ndarray:
    """Each row's values at its `mask` positions permuted among those positions; the rest in place.
    The permutation depends on `seed` and the row's key alone (not on the batch, segment or engine)."""
    import hashlib

    out = w.copy()
    for r, key in enumerate(keys):
        idx = np.flatnonzero(mask[r])
        if len(idx) < 2:
            continue
        digest = hashlib.blake2b(str(key).encode(), digest_size=16).digest()
        rng = np.random.default_rng([seed, *np.frombuffer(digest, dtype=np.uint32).tolist()])
        out[r, idx] = w[r, idx[rng.permutation(len(idx))]]
    return out


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
    keys = sequences.column("seq_id").to_pylist() if cfg.shuffle is not None else None
    weights = encode_weights(weigh(values, n_pad, cfg, first_row, excluded, keys), cfg.dtype)
    columns = {name: sequences.column(name) for name in schema.names if name not in WEIGHTED_COLUMNS}
    columns[ENTROPY] = lists(np.asarray(values, dtype=np.float32), pa.float32())
    columns["excluded"] = encode_excluded(excluded, len(values))
    columns["weight"] = lists(weights, schema.field("weight").type.value_type)
    arrays = [columns[name].cast(schema.field(name).type) for name in schema.names]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def entropy_quantiles(scored: str | Path, n: int = 101, max_tokens: int = 5_000_000) -> tuple[float, ...]:
    """`n` evenly spaced quantiles of the `entropy` column of a weighted directory's (score or weigh
    output, local or a URL) or one file's real tokens, the positions its scorer excluded left out (the
    reference for `quantile` weighting; read from the first `max_tokens` such tokens)."""

    from entroweight.schemas.datadir import data_files, no_rows
    from entroweight.schemas.weighted import ENTROPY, EXCLUDED, excluded_mask, matrix

    hint = "quantiles are read from the entropies of a scored directory"
    d, files = data_files(scored, kind="weighted", hint=hint)  # a reference whole, as every reader reads
    chunks, total, entropies = [], 0, False
    for f in files:
        table = d.read_table(f, (ENTROPY, "n_pad", EXCLUDED))  # each shard checked (DataDirError)
        entropies |= ENTROPY in table.column_names
        if ENTROPY not in table.column_names or table.num_rows == 0:
            continue
        e = matrix(table.column(ENTROPY), np.float32)
        has_excluded = EXCLUDED in table.column_names
        excluded = excluded_mask(table.column(EXCLUDED), e.shape[1]) if has_excluded else None
        vals = e[weighable(table.column("n_pad").to_numpy(), e.shape[1], excluded)]
        chunks.append(vals)
        total += vals.size
        if total >= max_tokens:
            break
    if not total:  # no column, or a column of no real tokens: each says what to do about it
        if entropies:
            raise ValueError(f"{no_rows(scored)}: no entropies to take quantiles from")
        raise ValueError(
            f"{scored} holds no `entropy` column: score it without --drop-entropy first (in a workflow, "
            "with_entropy: true)"
        )
    q = np.quantile(np.concatenate(chunks), np.linspace(0.0, 1.0, n))
    return tuple(float(v) for v in q)
