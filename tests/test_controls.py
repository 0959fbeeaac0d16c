"""The shuffled controls (trainers/controls.py): each keeps every weight and Σw (the treatment's
normaliser and step), leaves pads and excluded positions alone, breaks the weight's link to the
token, and changes nothing else; `position` keeps the mean weight at each position. In the reader,
a fresh permutation per training seed, the same one for a seed whenever it is read."""

from __future__ import annotations

import numpy as np
import pytest
from test_trainer_fixtures import make_weighted

from entroweight.trainers.config import TrainConfig
from entroweight.trainers.controls import shuffle_weights
from entroweight.trainers.data import WeightedTokens, parquet_files

ROWS, WIDTH = 200, 48


def _batch(seed: int = 0):
    """Left-padded rows whose weight is a function of the token and falls with the position."""
    rng = np.random.default_rng(seed)
    n_pad = rng.integers(0, WIDTH - 4, ROWS)
    ids = rng.integers(1, 50, (ROWS, WIDTH))
    cols = np.arange(WIDTH)[None, :]
    real = cols >= n_pad[:, None]
    pos = cols - n_pad[:, None]
    w = np.where(real, (ids % 7) / 12 + 0.4 * np.exp(-pos / 6), 0.0)
    excluded = real & (pos == 0)  # a first token the scorer gave no value: weight 0, kept there
    w[excluded] = 0.0
    return ids, w.astype(np.float32), real & ~excluded, n_pad, pos


def _by_position(w, weighable, pos):
    return {p: np.sort(w[weighable & (pos == p)]) for p in range(WIDTH)}


@pytest.mark.parametrize("by", ["row", "position"])
def test_a_control_keeps_every_weight_and_breaks_the_token_link(by):
    ids, w, weighable, n_pad, pos = _batch()
    out = shuffle_weights(w, weighable, n_pad, by, np.random.default_rng(1))
    assert np.array_equal(out[~weighable], w[~weighable])  # pads and excluded positions untouched
    assert np.sort(out[weighable]) == pytest.approx(np.sort(w[weighable]))  # every weight kept: Σw too
    link = np.corrcoef(w[weighable], (ids % 7)[weighable])[0, 1]
    broken = np.corrcoef(out[weighable], (ids % 7)[weighable])[0, 1]
    assert link > 0.8 and abs(broken) < 0.15
    rows_kept = all(np.array_equal(np.sort(out[r]), np.sort(w[r])) for r in range(ROWS))
    before, after = _by_position(w, weighable, pos), _by_position(out, weighable, pos)
    positions_kept = all(np.allclose(before[p], after[p]) for p in range(WIDTH))
    # each control keeps what it says and breaks the other: row keeps rows, position keeps positions
    assert (rows_kept, positions_kept) == ((True, False) if by == "row" else (False, True))


def test_the_position_control_keeps_the_position_trend_the_row_control_breaks():
    _, w, weighable, n_pad, pos = _batch()
    trend = [w[weighable & (pos == p)].mean() for p in range(1, 12)]
    for by, kept in (("position", True), ("row", False)):
        out = shuffle_weights(w, weighable, n_pad, by, np.random.default_rng(2))
        again = [out[weighable & (pos == p)].mean() for p in range(1, 12)]
        assert np.allclose(again, trend) == kept


def test_a_fresh_permutation_per_training_seed_and_the_same_one_when_read_again(tokenized_dir, tmp_path):
    d = make_weighted(tokenized_dir, tmp_path / "w", files=1)
    files = parquet_files([d])

    def weights(seed, shuffle):
        ds = WeightedTokens(files, batch_size=4, seed=seed, columns=("weight",), shuffle_weights=shuffle)
        return [b["weight"].numpy() for b in ds]

    plain0, a0, b0, a1 = weights(0, None), weights(0, "row"), weights(0, "row"), weights(1, "row")
    assert all(np.array_equal(x, y) for x, y in zip(a0, b0, strict=True))  # deterministic: resumable
    assert not all(np.array_equal(x, y) for x, y in zip(a0, plain0, strict=True))
    for x, y in zip(a0, plain0, strict=True):  # same rows, same order, each row's weights permuted
        assert np.sort(x, axis=1) == pytest.approx(np.sort(y, axis=1))
    assert not all(
        np.array_equal(np.sort(x, axis=1), np.sort(y, axis=1)) for x, y in zip(a1, plain0, strict=False)
    )


def test_a_control_needs_a_loss_that_reads_the_weights():
    with pytest.raises(ValueError, match="shuffle_weights .* --loss ce does not read"):
        TrainConfig(data="d", out="o", loss="ce", shuffle_weights="row")
    assert (
        TrainConfig(data="d", out="o", loss="weighted_ce", shuffle_weights="position").shuffle_weights
        == "position"
    )
