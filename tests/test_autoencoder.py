"""The autoencoder: the decoder reads only the embedding (repeated or unrolled windows), shapes,
causality of its decoder over its inputs, QAT noise in train() only, and it learns to regenerate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from entroweight.models import build_model
from entroweight.models.autoencoder import Unroll

V, T = 61, 16
MIXER = {"d_model": 32, "n_layers": 2}
LLAMA = {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64}
PARTS = {"mixer": MIXER, "llama": LLAMA}


def autoencoder(encoder="mixer", decoder="mixer", **kw):
    torch.manual_seed(0)
    cfg = {
        "vocab_size": V,
        "n_ctx": T,
        "encoder": encoder,
        "decoder": decoder,
        "encoder_config": PARTS[encoder],
        "decoder_config": PARTS[decoder],
        **kw,
    }
    return build_model("autoencoder", cfg)


def ids(B=2, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("encoder", ["mixer", "llama"])
@pytest.mark.parametrize("decoder", ["mixer", "llama"])
def test_shapes_and_defaults(encoder, decoder):
    m = autoencoder(encoder, decoder).eval()
    x = ids(3)
    e = m.encode(x)
    assert e.shape == (3, 32) and m.embed_dim == 32  # no compression: the encoder state itself
    assert m.decode(x, e).shape == (3, T, V) and m(x).shape == (3, T, V)
    assert m.unroll == (decoder == "llama")  # unroll by default for attention decoders only
    assert not hasattr(m.decoder, "embed_tokens")  # the decoder never sees tokens


def test_decoder_reads_only_the_embedding():
    m = autoencoder().eval()
    x, y = ids(seed=1), ids(seed=2)
    with torch.no_grad():
        e = m.encode(x)
        assert torch.equal(m.decode(x, e), m.decode(y, e))  # ids only give the length
        assert not torch.allclose(m(x), m(y))


@pytest.mark.parametrize("decoder", ["mixer", "llama"])
def test_decoder_is_causal_over_its_inputs(decoder):
    # the decoder stack stays causal: perturbing input position j leaves outputs < j unchanged
    m = autoencoder(decoder=decoder, unroll=True).eval()
    with torch.no_grad():
        x = m.inject(m.encode(ids()), T)
        for j in (3, 10):
            y = x.clone()
            y[:, j] += torch.randn(32)  # not a constant shift: LayerNorm would remove it
            a, b = m.decoder.forward_hidden(x), m.decoder.forward_hidden(y)
            assert torch.allclose(a[:, :j], b[:, :j], atol=1e-5) and not torch.allclose(a[:, j:], b[:, j:])


def test_unroll_windows():
    u = Unroll(d_emb=8, n_ctx=T, d_out=4, init_std=0.02)
    assert u.enlarge is not None and u.D == T and u.window == T // 2  # small embedding enlarged first
    assert u.idx[0].tolist() == list(range(8)) and u.idx[T - 1].tolist() == [15, 0, 1, 2, 3, 4, 5, 6]
    e = torch.randn(2, 8)
    out = u(e, T)
    assert out.shape == (2, T, 4)
    big = u.enlarge(e)
    assert torch.allclose(out[:, 5], u.proj(big[:, 5:13]), atol=1e-6)  # position i: window starting at i
    assert Unroll(d_emb=40, n_ctx=T, d_out=4, init_std=0.02).enlarge is None  # D >= n_ctx: no enlarge
    assert len({tuple(r) for r in u.idx.tolist()}) == T  # every position gets its own window


def test_compression_and_noise_train_only():
    m = autoencoder(compression=4, noise="embedding")
    x = ids()
    m.train()
    a, b = m.encode(x), m.encode(x)
    m.eval()
    c, d = m.encode(x), m.encode(x)
    assert a.shape == (2, 8)
    assert not torch.equal(a, b) and torch.equal(c, d)
    assert (a - c).abs().max() <= 2**-4 + 1e-6


def test_learns_to_regenerate_a_few_sequences():
    torch.manual_seed(0)
    m = autoencoder()
    x = ids(B=4, seed=3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    first = None
    for _ in range(80):
        logits = m(x)[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first, (first, loss.item())
