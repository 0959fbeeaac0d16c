"""The masked mixer: causality of every variant (and of the llama decoder), masking on every forward,
prefix consistency, shapes, config errors, learning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from entroweight.models import build_model
from entroweight.models.llama import Llama
from entroweight.models.mixer import MaskedMixer

V = 61
BASE = {"vocab_size": V, "n_ctx": 24, "d_model": 32, "n_layers": 2}
VARIANTS = {
    "flat": {},
    "kernel2": {"kernel": 2},  # even kernel: asymmetric "same" padding
    "kernel3": {"kernel": 3},
    "heads2": {"n_heads": 2},
    "heads4": {"n_heads": 4},
    "heads2_kernel3": {"n_heads": 2, "kernel": 3},
}
LLAMA = {"vocab_size": V, "n_ctx": 24, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64}


def models():
    torch.manual_seed(0)
    out = {name: MaskedMixer(MaskedMixer.Config(**BASE, **extra)) for name, extra in VARIANTS.items()}
    out["llama"] = Llama(Llama.Config(**LLAMA))
    for m in out.values():
        # non-zero biases: a zero-initialised bias would hide a leak through it
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.uniform_(p.data, -0.5, 0.5)
    return out


MODELS = models()


@pytest.mark.parametrize("name", list(MODELS))
def test_changing_token_j_never_changes_outputs_before_j(name):
    model = MODELS[name].eval()
    x = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    for j in (0, 5, 23):
        y = x.clone()
        y[:, j] = (y[:, j] + 1) % V
        with torch.no_grad():
            a, b = model(x), model(y)
        assert torch.allclose(a[:, :j], b[:, :j], atol=1e-6, rtol=0), (name, j)
        assert not torch.allclose(a[:, j:], b[:, j:]), (name, j)  # token j itself does matter


@pytest.mark.parametrize("name", list(MODELS))
def test_jacobian_is_lower_triangular_in_positions(name):
    # stronger than one token swap: no output position reads any later input position, by gradients
    model = MODELS[name].eval()
    x = torch.randn(1, 16, 32, requires_grad=True)
    h = model.forward_hidden(x)
    r = torch.randn(32)  # a plain sum of a LayerNorm output is constant: project on a random direction
    for i in (0, 7, 15):
        (g,) = torch.autograd.grad((h[0, i] * r).sum(), x, retain_graph=True)
        if i < 15:
            assert g[0, i + 1 :].abs().max().item() == 0, (name, i)
        assert g[0, : i + 1].abs().sum() > 0


@pytest.mark.parametrize("extra", [{}, {"kernel": 3}, {"n_heads": 2}])
def test_mask_is_applied_every_forward(extra):
    # an optimizer (or weight decay) may write to the upper triangle: it must stay without effect
    torch.manual_seed(0)
    model = MaskedMixer(MaskedMixer.Config(**BASE, **extra)).eval()
    x = torch.randint(0, V, (2, 24))
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % V
    with torch.no_grad():
        for layer in model.layers:
            layer.mixer.conv.weight.add_(torch.ones(24, 24).triu(1)[None, :, :, None] * 100)
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_short_sequence_equals_the_prefix_of_a_long_one(name):
    model = MODELS[name].eval()
    x = torch.randint(0, V, (2, 24))
    with torch.no_grad():
        assert torch.allclose(model(x[:, :9]), model(x)[:, :9], atol=1e-5)


def test_shapes_registry_hooks_and_params():
    m = build_model("mixer", {**BASE, "n_heads": 4, "kernel": 2})
    assert isinstance(m, MaskedMixer)
    x = torch.randint(0, V, (3, 20))
    with torch.no_grad():
        assert m(x).shape == (3, 20, V)
        assert torch.equal(m.head(m.forward_hidden(m.embed(x))), m(x))
    # inter-token parameters: n_ctx² per head per kernel tap
    conv = m.layers[0].mixer.conv.weight
    assert conv.shape == (4, 24, 24, 2)
    flat = build_model("mixer", BASE)
    assert flat.layers[0].mixer.conv.weight.shape == (1, 24, 24, 1)
    assert not hasattr(flat.layers[0].mixer, "in_proj")  # flat: no projections


def test_config_errors_and_too_long_input():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        MaskedMixer.Config(**{**BASE, "n_heads": 5})
    with pytest.raises(ValueError, match="kernel"):
        MaskedMixer.Config(**{**BASE, "kernel": 0})
    with pytest.raises(ValueError, match="heads, which mixer does not take"):
        build_model("mixer", {**BASE, "heads": 2})  # unknown keys refused
    with pytest.raises(ValueError, match="longer than the mixer's n_ctx"):
        MODELS["flat"](torch.zeros(1, 25, dtype=torch.long))


@pytest.mark.parametrize("extra", [{}, {"n_heads": 2, "kernel": 2}])
def test_learns_a_repeating_sequence(extra):
    torch.manual_seed(0)
    model = MaskedMixer(MaskedMixer.Config(**BASE, **extra))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.arange(24).remainder(7).add(3).repeat(4, 1)
    for _ in range(40):
        loss = F.cross_entropy(model(x)[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5
