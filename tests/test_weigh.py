"""entropy -> weight: per-sequence min-max, quantile, clip, floor, invert; pads 0; float16 / uint8."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from entroweight.transforms.weigh import WeighConfig, encode_weights, normalize, weigh

VALUES = np.array([[0.0, 0.0, 1.0, 3.0, 5.0], [9.0, 2.0, 4.0, 6.0, 2.0], [0.0, 0.0, 0.0, 0.0, 7.0]])
N_PAD = np.array([2, 0, 4])


def test_minmax_per_sequence_over_real_tokens_pads_zero():
    w = weigh(VALUES, N_PAD, WeighConfig())
    np.testing.assert_allclose(w[0], [0, 0, 1.0, 0.5, 0.0])  # pads 0; min 1 -> 1, max 5 -> 0
    np.testing.assert_allclose(w[1], [0.0, 1.0, 1 - 2 / 7, 1 - 4 / 7, 1.0])  # no pads: all 5 count
    np.testing.assert_allclose(w[2], [0, 0, 0, 0, 1.0])  # one real token: nothing to stretch, w = 1
    assert w.dtype == np.float32 and w.shape == VALUES.shape


def test_minmax_weights_do_not_change_with_float_noise_in_the_values():
    """Values agree to ~1e-5 relative across batch shapes: weights must not depend on that noise. A
    row flat but for it weighs 1 everywhere (min-max stretched the noise to [0, 1]: the weights of a
    repetitive text changed with --batch-tokens); any row moves by at most noise / its span."""
    rng = np.random.default_rng(0)
    flat = np.array([[17.22326, 17.22330, 17.22328, 17.22326], [1e-7, 2e-7, 0.0, 1e-6]])
    for values in (flat, flat + rng.normal(0, 5e-5, flat.shape) * [[1], [1e-3]]):
        assert np.all(weigh(values, np.zeros(2, int), WeighConfig()) == 1.0)
    values = rng.uniform(0, 20, (200, 64))  # rows with a real spread: min-max as ever
    noisy = values * (1 + rng.normal(0, 1e-5, values.shape))
    w, w_noisy = (weigh(v, np.zeros(200, int), WeighConfig()) for v in (values, noisy))
    assert np.abs(w - w_noisy).max() < 1e-3 and w.min() == 0.0 and w.max() == 1.0
    spread = np.array([[1.0, 1.01, 1.02]])  # a spread of 1 % is a spread
    np.testing.assert_allclose(weigh(spread, np.zeros(1, int), WeighConfig())[0], [1.0, 0.5, 0.0], atol=1e-6)


def test_pad_values_never_move_the_range():
    bumped = VALUES.copy()
    bumped[0, :2] = [-100.0, 100.0]  # garbage under the pads
    np.testing.assert_array_equal(weigh(bumped, N_PAD, WeighConfig()), weigh(VALUES, N_PAD, WeighConfig()))


def test_invert_floor_clip():
    base = normalize(VALUES, N_PAD, WeighConfig())
    inv = weigh(VALUES, N_PAD, WeighConfig(invert=True))
    np.testing.assert_allclose(inv, base)  # w = e
    floored = weigh(VALUES, N_PAD, WeighConfig(floor=0.2))  # float16: 0.2 rounds up to 0.20007
    assert floored[0, 4] == pytest.approx(0.2, abs=1e-3) and floored[0, 0] == 0  # real tokens only
    assert floored[0, 4] >= np.float32(0.2)
    clipped = normalize(VALUES, N_PAD, WeighConfig(clip=(0.25, 0.75)))
    np.testing.assert_allclose(clipped[0], [0, 0, 0.0, 0.5, 1.0])


def test_quantile_uses_one_global_scale():
    cfg = WeighConfig(method="quantile", quantiles=(0.0, 2.0, 10.0))
    e = normalize(VALUES, N_PAD, cfg)
    np.testing.assert_allclose(e[0], [0, 0, 0.25, 0.5 + 0.5 / 8, 0.5 + 1.5 / 8])
    np.testing.assert_allclose(e[2], [0, 0, 0, 0, 0.5 + 2.5 / 8])  # not stretched per sequence
    with pytest.raises(ValidationError, match="quantiles"):
        WeighConfig(method="quantile")


def test_encodings():
    w = weigh(VALUES, N_PAD, WeighConfig())
    u8 = encode_weights(w, "uint8")
    assert u8.dtype == np.uint8 and u8[0, 2] == 255 and u8[0, 3] == 128 and u8[0, 0] == 0
    assert np.abs(u8 / 255.0 - w).max() <= 0.5 / 255 + 1e-7
    f16 = encode_weights(w, "float16")
    assert f16.dtype == np.float16 and np.abs(f16 - w).max() < 1e-3
    with pytest.raises(ValueError, match="weight dtype"):
        encode_weights(w, "int8")


def test_bad_options_are_refused():
    with pytest.raises(ValidationError, match="floor"):
        WeighConfig(floor=1.5)
    with pytest.raises(ValidationError, match="clip"):
        WeighConfig(clip=(0.8, 0.2))


@pytest.mark.parametrize("dtype", ["uint8", "float16"])
@pytest.mark.parametrize("floor", [1e-9, 0.001, 1 / 510, 0.05, 0.1, 0.2, 0.3, 0.5, 0.999, 1.0])
def test_no_stored_weight_of_a_real_token_is_below_the_floor(floor, dtype):
    """Before: uint8 stored a floor below 1/510 as 0 (`--floor 0.001 --weight-dtype uint8` gave real
    tokens weight 0) and rounded 0.3 down to 76/255; float16 stored 0.1 as 0.09998. The floor is now
    rounded up to the next weight the dtype stores, and recorded so (the config says what was applied)."""
    from entroweight.schemas.weighted import decode_weights

    cfg = WeighConfig(floor=floor, dtype=dtype)
    assert floor <= cfg.floor <= floor + (1 / 255 if dtype == "uint8" else 1e-3)
    assert WeighConfig(floor=cfg.floor, dtype=dtype).floor == cfg.floor  # what is recorded stays
    for invert in (False, True):
        w = weigh(VALUES, N_PAD, cfg.model_copy(update={"invert": invert}))
        stored = decode_weights(encode_weights(w, dtype))
        real = np.arange(VALUES.shape[1])[None, :] >= N_PAD[:, None]
        assert stored[real].min() >= np.float32(floor), (floor, dtype, stored[real].min())
        assert (stored[~real] == 0).all()
