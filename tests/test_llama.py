"""The llama decoder: shapes, causality, the hidden-level hooks, tying, GQA, config errors."""

from __future__ import annotations

import pytest
import torch
from test_trainer_fixtures import one_thread  # noqa: F401 - fixture

from entroweight.models import build_model
from entroweight.models.llama import Llama

CFG = {"vocab_size": 97, "n_ctx": 32, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64}


def test_shapes_and_registry():
    torch.manual_seed(0)
    model = build_model("llama", CFG)
    assert isinstance(model, Llama) and model.config.d_model == 32
    x = torch.randint(0, 97, (3, 20))
    assert model(x).shape == (3, 20, 97)


@pytest.mark.parametrize("extra", [{}, {"n_kv_heads": 2}, {"tie_embeddings": True}])
def test_changing_token_j_never_changes_outputs_before_j(extra):
    torch.manual_seed(0)
    model = Llama(Llama.Config(**{**CFG, **extra})).eval()
    x = torch.randint(0, 97, (2, 24))
    j = 13
    y = x.clone()
    y[:, j] = (y[:, j] + 1) % 97
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :j], b[:, :j])
    assert not torch.allclose(a[:, j:], b[:, j:])


def test_hidden_hooks_compose_to_forward():
    torch.manual_seed(0)
    model = Llama(Llama.Config(**CFG)).eval()
    x = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        h = model.forward_hidden(model.embed(x))
        assert h.shape == (2, 16, 32)
        assert torch.equal(model.head(h), model(x))


def test_tied_embeddings_share_one_tensor():
    model = Llama(Llama.Config(**CFG, tie_embeddings=True))
    assert model.lm_head.weight is model.embed_tokens.weight
    untied = Llama(Llama.Config(**CFG))
    assert untied.num_params() - model.num_params() == 97 * 32


def test_config_errors_and_too_long_input():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        Llama.Config(**{**CFG, "n_heads": 5})
    with pytest.raises(ValueError, match="n_kv_heads"):
        Llama.Config(**{**CFG, "n_kv_heads": 3})
    model = Llama(Llama.Config(**CFG))
    with pytest.raises(ValueError, match="longer than the model's n_ctx"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_learns_a_repeating_sequence():
    # a few dozen steps on a fixed pattern: the loss must fall well below uniform (log 97 ≈ 4.6)
    torch.manual_seed(0)
    model = Llama(Llama.Config(**CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.arange(32).remainder(7).add(3).repeat(4, 1)
    for _ in range(40):
        loss = torch.nn.functional.cross_entropy(model(x)[:, :-1].reshape(-1, 97), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5
