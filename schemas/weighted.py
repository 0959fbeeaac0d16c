"""The weighted-sequence codec: how per-token weights, the row matrix, the real-token mask and the
positions a scorer excluded are stored in parquet and read back. Every writer and reader of the
project goes through here, so the encoding is decided in one place and stored weights are decoded in
this module alone.

Facts:
- weights are stored as float16, or as uint8 holding round(255·w); which one is decided from the
  stored values' own type (an Arrow or numpy dtype), never from metadata or from who wrote them;
- a row is `n_ctx` positions, left-padded: position j of a row is a real token iff j >= n_pad (and,
  for rows of other tools that are shorter than the widest, j < the row's length);
- `excluded` (list<int32>) holds, per row, the real positions the scorer gave no value (separators
  of packed documents, a row-edge partial character): they weigh 0 and stay outside every
  normalisation and statistic, for whichever step reads the data later.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

WEIGHT = "weight"
ENTROPY = "entropy"
EXCLUDED = "excluded"
# a synthetic corpus's second value per token (the synthesize stage): −log p of the token drawn, in nats
SURPRISAL = "surprisal"
WEIGHT_TYPES: dict[str, pa.DataType] = {"float16": pa.float16(), "uint8": pa.uint8()}
WEIGHT_DTYPES = tuple(WEIGHT_TYPES)
UINT8_SCALE = 255.0
EXCLUDED_TYPE = pa.int32()


class CodecError(ValueError):
    """Stored data that does not follow the weighted-sequence contract."""


# -- weights


def check_weight_dtype(dtype: str) -> str:
    if dtype not in WEIGHT_TYPES:
        raise CodecError(f"weight dtype must be one of {', '.join(WEIGHT_DTYPES)}, not {dtype!r}")
    return dtype


def weight_type(dtype: str) -> pa.DataType:
    """The Arrow type a weight of `dtype` is stored as."""
    return WEIGHT_TYPES[check_weight_dtype(dtype)]


def weight_dtype(stored: pa.Schema | pa.Field | pa.DataType | np.dtype | np.ndarray) -> str:
    """'uint8' or 'float16': how these weights are stored, from their own type (a schema with a
    `weight` column, that column's field or list type, an element type, or a numpy array/dtype)."""
    t = stored
    if isinstance(t, pa.Schema):
        if WEIGHT not in t.names:
            raise CodecError("no weight column: not a weighted dataset")
        t = t.field(WEIGHT)
    if isinstance(t, pa.Field):
        t = t.type
    if isinstance(t, pa.DataType):
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            t = t.value_type
        t = np.dtype(t.to_pandas_dtype())
    if isinstance(t, np.ndarray):
        t = t.dtype
    t = np.dtype(t)
    if t == np.uint8:
        return "uint8"
    if t.kind == "f":
        return "float16"  # float32 weights of other tools read the same way: w itself
    raise CodecError(f"weights stored as {t} are neither uint8 (round(255·w)) nor floats in [0, 1]")


def describe_encoding(dtype: str) -> str:
    """How a reader of exported data turns stored weights back into w (for a dataset card)."""
    if check_weight_dtype(dtype) == "uint8":
        return f"uint8: w = value / {UINT8_SCALE:g}"
    return "float16 in [0, 1]"


def stored_at_least(value: float, dtype: str) -> float:
    """The smallest weight `dtype` stores that is at least `value` (in [0, 1]): what a floor becomes,
    so that no stored weight is below it. Else uint8's steps of 1/255 store a floor of 0.001 as 0 and
    round 0.3 down to 76/255, and float16 stores 0.1 as 0.09998."""
    if check_weight_dtype(dtype) == "uint8":
        k = int(np.ceil(value * UINT8_SCALE))  # then exact in float64: 0.2 · 255 is 51.000000000000007
        while k > 0 and (k - 1) / UINT8_SCALE >= value:
            k -= 1
        while k / UINT8_SCALE < value:
            k += 1
        return k / UINT8_SCALE
    stored = np.float16(value)
    if float(stored) < value:
        stored = np.nextafter(stored, np.float16(np.inf))
    return float(stored)


def encode_weights(w: np.ndarray, dtype: str) -> np.ndarray:
    """Weights in [0, 1] -> their stored form: float16, or uint8 holding round(255·w)."""
    if check_weight_dtype(dtype) == "uint8":
        return np.rint(np.clip(w, 0.0, 1.0) * UINT8_SCALE).astype(np.uint8)
    return np.asarray(w).astype(np.float16)


def decode_weights(stored: np.ndarray) -> np.ndarray:
    """Stored weights (uint8 or float, any shape) -> float32 weights in [0, 1]."""
    stored = np.asarray(stored)
    if weight_dtype(stored) == "uint8":
        return stored.astype(np.float32) / np.float32(UINT8_SCALE)
    return stored.astype(np.float32, copy=False)


# -- rows


def lists(matrix: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """A (rows, n) matrix as an Arrow list column, without a Python loop."""
    rows, n = matrix.shape
    offsets = pa.array(np.arange(0, rows * n + 1, n, dtype=np.int32))
    return pa.ListArray.from_arrays(
        offsets, pa.array(np.ascontiguousarray(matrix).reshape(-1), type=value_type)
    )


def row_lengths(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)


def matrix(col: pa.Array | pa.ChunkedArray, dtype=None, fill=0, width: int | None = None) -> np.ndarray:
    """A list column as a (rows, width) matrix (width: the longest row, or `width`); rows shorter than
    the width (other tools' data) are filled on the right with `fill`. Stage output is fixed-width:
    one reshape, no copy per row."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    values = pc.list_flatten(col).to_numpy(zero_copy_only=False)
    if dtype is not None:
        values = values.astype(dtype, copy=False)
    n = len(col)
    lengths = row_lengths(col)
    w = int(lengths.max()) if n and width is None else (width or 0)
    if n and (lengths == w).all():
        return values.reshape(n, w)
    out = np.full((n, w), fill, dtype=values.dtype)
    starts = np.cumsum(lengths) - lengths  # no rows (a shard whose documents were all rejected): none
    for i, (s, k) in enumerate(zip(starts, lengths, strict=True)):
        out[i, :k] = values[s : s + k]
    return out


def weights_matrix(col: pa.Array | pa.ChunkedArray, width: int | None = None) -> np.ndarray:
    """A stored `weight` column as float32 (rows, width) weights in [0, 1]."""
    return decode_weights(matrix(col, width=width))


def real_mask(n_pad: np.ndarray | None, width: int, lengths: np.ndarray | None = None) -> np.ndarray:
    """(rows, width) bool: True on real tokens. Left padding: position j is real iff j >= n_pad; rows
    shorter than `width` (`lengths`) are real up to their length only. `n_pad` None (other tools' data,
    without the column): no left padding, every position within the row's length is real."""
    j = np.arange(width)[None, :]
    if n_pad is None:
        if lengths is None:
            raise CodecError("real_mask needs n_pad or the rows' lengths")
        return j < np.asarray(lengths)[:, None]
    mask = j >= np.asarray(n_pad)[:, None]
    if lengths is not None:
        mask &= j < np.asarray(lengths)[:, None]
    return mask


# -- excluded positions


def encode_excluded(excluded: np.ndarray | None, rows: int) -> pa.ListArray:
    """(rows, width) bool, or None for no exclusions -> the `excluded` column (positions per row)."""
    if excluded is None or not np.any(excluded):
        return pa.ListArray.from_arrays(
            pa.array(np.zeros(rows + 1, dtype=np.int32)), pa.array([], EXCLUDED_TYPE)
        )
    excluded = np.asarray(excluded, dtype=bool)
    r, c = np.nonzero(excluded)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(r, minlength=rows))]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(c.astype(np.int32), EXCLUDED_TYPE))


def excluded_mask(col: pa.Array | pa.ChunkedArray | None, width: int) -> np.ndarray | None:
    """The `excluded` column -> (rows, width) bool, or None when nothing is excluded (or no column)."""
    if col is None:
        return None
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    positions = pc.list_flatten(col).to_numpy(zero_copy_only=False)
    if positions.size == 0:
        return None
    rows = np.repeat(np.arange(len(col)), row_lengths(col))
    out = np.zeros((len(col), width), dtype=bool)
    out[rows, positions.astype(np.int64)] = True
    return out


def weighable(n_pad: np.ndarray, width: int, excluded: np.ndarray | None = None) -> np.ndarray:
    """Positions that get a weight: real tokens the scorer did not exclude."""
    mask = real_mask(n_pad, width)
    return mask if excluded is None else mask & ~np.asarray(excluded, dtype=bool)
