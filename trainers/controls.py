"""The shuffled controls of an experiment: the same weights with a link broken, drawn afresh for each
training seed (`LossSettings.shuffle_weights`, applied by the reader, trainers/data.py).

A control must change one thing the treatment changes and nothing else. Both keep every weight the
data holds (so Σw, the loss's normaliser and the step size stay the treatment's) and leave pads and
excluded positions at 0; they differ in which link they break:

- `row`: each row's weights permuted among its own weighable tokens. Breaks the link to the token
  *and* to its position in the row (the weights keep the row, its mean and spread).
- `position`: at each position of the document (the column less the row's left padding), the
  weights permuted across the rows that have a weighable token there. Breaks the link to the token
  alone: the mean weight at each position, the trend the report's "mean entropy by position" shows,
  is kept.

A difference from the reference that the `position` control shows too is the position trend, not
the token's entropy; one the `row` control shows too is re-weighting as such.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Shuffle = Literal["row", "position"]


def shuffle_weights(
    w: np.ndarray, weighable: np.ndarray, n_pad: np.ndarray, by: Shuffle, rng: np.random.Generator
) -> np.ndarray:
    """(rows, width) weights with `by`'s link broken (module docstring); positions outside
    `weighable` keep their value. `n_pad`: each row's left padding (0 for packed rows)."""
    out = w.copy()
    if by == "row":
        for r in range(w.shape[0]):
            idx = np.flatnonzero(weighable[r])
            out[r, idx] = w[r, idx[rng.permutation(len(idx))]]
        return out
    if by != "position":
        raise ValueError(f"shuffle_weights is row or position, not {by!r}")
    rows, width = w.shape
    col = (
        np.arange(width)[None, :] + np.asarray(n_pad, np.int64)[:, None]
    )  # position p of row r is column p + n_pad
    inside = col < width
    col = np.minimum(col, width - 1)
    at = np.take_along_axis(weighable, col, axis=1) & inside
    values = np.take_along_axis(w, col, axis=1)
    for p in range(width):
        r = np.flatnonzero(at[:, p])
        if len(r) > 1:
            out[r, col[r, p]] = values[r[rng.permutation(len(r))], p]
    return out
