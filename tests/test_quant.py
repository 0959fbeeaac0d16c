"""models/quant: embedding casts (fp8 e4m3fn / e5m2 saturating, int8 absmax), uniform noise, the
sequence code length, and evaluate_quantized's losses and amortized bits per byte."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from entroweight.models import build_model
from entroweight.models.quant import (
    FORMATS,
    embedding_bits,
    evaluate_quantized,
    quantize,
    sequence_nats,
    uniform_noise,
)


def test_fp8_casts_round_and_saturate():
    e = torch.tensor([[0.0, 1.0, 1.06, -3.3, 1000.0, -1e6]])
    q = quantize(e, "float8_e4m3fn")
    assert q.dtype == torch.float32
    assert q[0, 0] == 0 and q[0, 1] == 1.0 and q[0, 2] == 1.0  # 3 mantissa bits: 1.06 -> 1.0
    assert q[0, 4] == 448 and q[0, 5] == -448  # saturates at e4m3fn's max instead of NaN
    assert torch.isfinite(q).all()
    q5 = quantize(e, "float8_e5m2")
    assert q5[0, 5] == -57344 and q5[0, 3] == -3.5  # 2 mantissa bits: 3.3 -> 3.5
    x = torch.randn(64, 32)
    x = x[x.abs() > 0.1]  # normal numbers of both formats (e4m3fn's smallest normal is 2^-6)
    for fmt, bits in (("float8_e4m3fn", 3), ("float8_e5m2", 2), ("bfloat16", 7)):
        rel = ((quantize(x, fmt) - x).abs() / x.abs()).max()
        assert rel <= 2 ** -(bits + 1) + 1e-6, fmt  # round to nearest: half a mantissa step


def test_int8_absmax_per_sequence():
    e = torch.tensor([[0.5, -1.0, 0.25, 0.0], [10.0, 3.0, -7.0, 0.01]])
    q = quantize(e, "int8")
    scale = e.abs().amax(1, keepdim=True) / 127
    assert torch.allclose(q, (e / scale).round() * scale)
    assert torch.allclose(q[:, :2].abs().amax(1), e.abs().amax(1))  # the max is exact
    assert ((q - e).abs() <= scale / 2 + 1e-7).all()
    assert torch.equal(quantize(torch.zeros(1, 4), "int8"), torch.zeros(1, 4))  # no 0/0


def test_formats_bits_and_errors():
    assert quantize(torch.ones(1, 2), "float32").equal(torch.ones(1, 2))
    assert embedding_bits(64, "float8_e4m3fn") == 512 and embedding_bits(64, "int8") == 512 + 32
    assert embedding_bits(64, "float32") == 2048
    with pytest.raises(ValueError, match="unknown embedding format 'float4'"):
        quantize(torch.ones(1, 2), "float4")
    assert set(FORMATS) >= {"float8_e4m3fn", "float8_e5m2", "int8"}


def test_uniform_noise_bounds():
    torch.manual_seed(0)
    x = torch.zeros(10000)
    n = uniform_noise(x, 2**-4)
    assert n.abs().max() <= 2**-4 and n.abs().max() > 0.9 * 2**-4
    assert abs(n.mean()) < 2e-3 and n.var() == pytest.approx((2**-4) ** 2 / 3, rel=0.1)


def test_sequence_nats_counts_real_tokens_only():
    V = 5
    logits = torch.randn(2, 4, V)
    ids = torch.tensor([[0, 0, 3, 1], [2, 4, 1, 3]])  # row 0 left-padded (pad 0); row 1 a full window
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none").view(2, 3)
    got = sequence_nats(logits, ids, pad_id=0)
    assert got[0] == pytest.approx(float(ce[0, 1:].sum()), rel=1e-6)
    # the full window's first token has no prediction: a uniform code, log V nats
    assert got[1] == pytest.approx(float(ce[1].sum()) + math.log(V), rel=1e-6)


@pytest.fixture(scope="module")
def tiny_estimator():
    torch.manual_seed(0)
    cfg = {"vocab_size": 50, "n_ctx": 12, "injection": "combination", "encoder": "mixer", "decoder": "mixer"}
    cfg |= {
        "encoder_config": {"d_model": 16, "n_layers": 1},
        "decoder_config": {"d_model": 16, "n_layers": 1},
    }
    m = build_model("estimator", cfg)
    with torch.no_grad():  # make the embedding matter, so casting it changes the loss
        m.up.weight.mul_(50)
    return m


def batches(n=3, B=4, T=12, V=50):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids = torch.randint(1, V, (B, T), generator=g)
        ids[:, :3] = 0  # left padding
        yield ids, torch.full((B,), 40)


def test_evaluate_quantized(tiny_estimator):
    m = tiny_estimator
    r = evaluate_quantized(m, batches(), pad_id=0, formats=("float8_e4m3fn", "float8_e5m2", "int8"))
    assert r["sequences"] == 12 and r["bytes"] == 480 and r["targets"] == 12 * 9 and r["embed_dim"] == 4
    assert r["float32"]["delta"] == 0
    for fmt in ("float32", "float8_e4m3fn", "float8_e5m2", "int8"):
        q = r[fmt]
        assert q["embed_bpb"] == pytest.approx(12 * embedding_bits(4, fmt) / 480)
        assert q["bpb"] == pytest.approx(q["embed_bpb"] + q["token_bpb"])
        # with left padding every real token is predicted: token bits = loss · targets / ln 2
        assert q["token_bpb"] == pytest.approx(q["loss"] * 108 / math.log(2) / 480, rel=1e-6)
    # the casts change the decoder's input: e5m2 (2 mantissa bits) moves it at least as far as e4m3
    assert r["float8_e5m2"]["delta"] != 0 and r["float8_e4m3fn"]["delta"] != 0
    # and the loss matches a hand-computed decode with the cast embedding
    ids, _ = next(batches(1))
    with torch.no_grad():
        logits = m.decode(ids, quantize(m.encode(ids), "float8_e4m3fn"))
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1), reduction="none")
    real = (ids[:, 1:] != 0).reshape(-1)
    one = evaluate_quantized(m, batches(1), pad_id=0, formats=("float8_e4m3fn",))
    assert one["float8_e4m3fn"]["loss"] == pytest.approx(float((ce * real).sum() / real.sum()), rel=1e-5)
