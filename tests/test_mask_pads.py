# ruff: noqa: F811 - pytest fixtures imported from other test modules
"""A Llama trained with `mask_pads` skips the left padding: each row's values do not depend on how
many pads precede it, so causal_loss cuts the padding of its checkpoints (token-budget batches compute
no pad columns) and gives the values of the full-width path. The write-up's models (the default)
attend to the pads and keep them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_token_budget import data, one_thread, rows, sha  # noqa: F401 - fixtures
from test_trainer_fixtures import TINY, weighted_dir  # noqa: F401 - fixtures

from entroweight.models.llama import Llama
from entroweight.scorers import Batching, make_scorer
from entroweight.trainers import TrainConfig, train


def tiny(mask_pads: bool) -> Llama:
    torch.manual_seed(0)
    cfg = Llama.Config(
        vocab_size=64, n_ctx=24, d_model=32, n_layers=2, n_heads=2, d_ff=64, mask_pads=mask_pads
    )
    return Llama(cfg).eval()


def values(model: Llama, real: torch.Tensor, n_pad: int) -> torch.Tensor:
    """Logits of the last pad (it predicts the first real token) and of every real token."""
    ids = torch.cat([torch.zeros(1, n_pad, dtype=torch.long), real], 1)
    with torch.no_grad():
        return model(ids, attention_mask=ids != 0)[0, n_pad - 1 :]


def test_a_pad_masking_model_gives_a_row_the_same_values_whatever_its_padding():
    real = torch.randint(1, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    masked = tiny(mask_pads=True)
    torch.testing.assert_close(values(masked, real, 1), values(masked, real, 12), rtol=1e-5, atol=1e-5)
    plain = tiny(mask_pads=False)  # the write-up's: the pads are context, so their number matters
    assert not torch.allclose(values(plain, real, 1), values(plain, real, 12), atol=1e-3)


@pytest.fixture(scope="module")
def masked_ckpt(weighted_dir, tmp_path_factory):
    """A tiny Llama trained with mask_pads (the trainer hands it each batch's real-token mask)."""
    out = tmp_path_factory.mktemp("masked")
    res = train(
        TrainConfig(
            data=str(weighted_dir),
            out=str(out),
            model_config={**TINY, "mask_pads": True},
            steps=3,
            batch_size=4,
            lr=3e-3,
            quiet=True,
        )
    )
    assert res.loss is not None and np.isfinite(res.loss)
    return out


def test_causal_loss_cuts_the_padding_of_a_pad_masking_checkpoint(masked_ckpt, rows):
    ids, n_pad = rows

    def scorer():
        s = make_scorer("causal_loss", checkpoint=str(masked_ckpt), dtype="fp32")
        s.setup()
        return s

    full = scorer()
    full.batch_width = lambda longest, T: T  # every row at the data's full width, pads and all
    full.pack = False
    full_scored = full.score(ids, n_pad)
    want = full_scored.values
    cut = scorer()
    cut_scored = cut.score(ids, n_pad, Batching(batch_tokens=100))
    got = cut_scored.values
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    real = int((ids.shape[1] - n_pad).sum())
    # pad columns computed: the full-width path all of them, the cut path one per row and the batches' ragged ends
    assert cut_scored.computed - real < 0.6 * (full_scored.computed - real)


def test_hf_llama_computes_the_same_real_token_logits_with_a_mask_and_positions():
    from transformers import LlamaForCausalLM

    from entroweight.trainers.export import hf_config

    ours = tiny(mask_pads=True)
    hf = LlamaForCausalLM(hf_config(ours.config, {})).eval()
    state = {(k if k.startswith("lm_head") else "model." + k): v for k, v in ours.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    ids = torch.cat([torch.zeros(2, 5, dtype=torch.long), torch.randint(1, 64, (2, 7))], 1)
    ids[1, 3:5] = 9  # the second row has 3 pads, the first 5
    mask = (torch.arange(12)[None] >= torch.tensor([[5], [3]])).long()
    with torch.no_grad():
        a = ours(ids, attention_mask=mask)
        b = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], rtol=1e-5, atol=1e-5)
