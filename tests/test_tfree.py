"""T-FREE-style head: trigram hashing, the multi-label BCE, the decode rule and its distribution, training."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from entroweight.models import build_model
from entroweight.models.tfree import token_positions, trigram_keys
from entroweight.trainers.losses import compute_loss

TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "n_ctx": 16}


def softplus(x):
    return math.log1p(math.exp(x))


def test_trigram_hashing_by_hand():
    # b"a" is one trigram (boundary, 'a', boundary): 256·258² + 97·258 + 256
    assert trigram_keys(b"a", 7) == [17065666]
    # h_0 = (1103515245·x + 12345) mod (2³¹−1) mod 64, h_1 = (48271·x + 11) mod (2³¹−1) mod 64
    assert token_positions(b"a", 7, 64, 1) == [48]
    assert token_positions(b"a", 7, 64, 2) == [40, 48]
    # a special (no bytes) hashes its id past every trigram key: 258³ + 2
    assert trigram_keys(b"", 2) == [17173514]
    assert token_positions(b"", 2, 64, 2) == [19, 35]
    # "ab" -> trigrams [^ab], [ab$]: two keys, sorted; shared trigrams give shared positions
    assert trigram_keys(b"ab", 0) == sorted([256 * 258**2 + 97 * 258 + 98, 97 * 258**2 + 98 * 258 + 256])
    assert set(token_positions(b"xab", 0, 4096, 3)) & set(token_positions(b"ab", 0, 4096, 3))


def test_bce_by_hand_with_pads_and_masked_positions():
    z = torch.tensor([[[0.5, -1.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0]]])
    codes = torch.tensor([[0, 2], [3, -1]])  # token 0 -> {0, 2}; token 1 -> {3} (padded)
    targets = torch.tensor([[0, 1]])
    # position 0: y = [1, 0, 1, 0]; BCE(z, 1) = softplus(-z), BCE(z, 0) = softplus(z)
    p0 = softplus(-0.5) + softplus(-1.0) + softplus(-2.0) + softplus(0.0)
    # position 1: y = [0, 0, 0, 1]; the pad must not set position 3's neighbour or clear a 1
    p1 = 3 * softplus(1.0) + softplus(-1.0)
    both = compute_loss("tfree_bce", z, targets, torch.tensor([[True, True]]), codes=codes)
    assert both.item() == pytest.approx((p0 + p1) / 2, rel=1e-6)
    one = compute_loss("tfree_bce", z, targets, torch.tensor([[True, False]]), codes=codes)
    assert one.item() == pytest.approx(p0, rel=1e-6)


def tiny_model(**kw):
    # five tokens: 3 specials' worth of empty bytes would be ties-free anyway (ids hash)
    tb = [b"", b"a", b"b", b"ab", b"abc"]
    cfg = {**TINY, "vocab_size": 5, "n_hash": 32, "n_active": 2, "token_bytes": [b.hex() for b in tb], **kw}
    return build_model("tfree", cfg), tb


def test_decode_rule_and_its_distribution():
    torch.manual_seed(0)
    model, tb = tiny_model()
    assert model.codes.shape[0] == 5 and model.lm_head.weight.shape == (32, 32)
    z = torch.randn(1, 1, 32)
    s = model.scores(z)[0, 0]
    # score of v = mean of the head logits at v's positions
    for v, b in enumerate(tb):
        assert s[v].item() == pytest.approx(z[0, 0, token_positions(b, v, 32, 2)].mean().item(), rel=1e-5)
    # decode: argmax of the scores; set the head logits to favour "ab"'s positions
    z = torch.full((1, 1, 32), -3.0)
    z[0, 0, token_positions(b"ab", 3, 32, 2)] = 3.0
    assert int(model.scores(z)[0, 0].argmax()) == 3
    # a prefix of a token scores below it when only the token's positions are on: b"a" shares only
    # some positions with b"ab", so its mean is lower
    assert model.scores(z)[0, 0, 1] < model.scores(z)[0, 0, 3]
    # the BPB distribution: softmax of the scores, a proper distribution over the 5 tokens
    p = F.softmax(model(torch.tensor([[1, 2, 3]])), -1)
    assert p.shape == (1, 3, 5) and torch.allclose(p.sum(-1), torch.ones(1, 3))


def test_forward_shapes_and_config_checks():
    model, _ = tiny_model()
    ids = torch.randint(0, 5, (2, 7))
    assert model(ids).shape == (2, 7, 5)
    assert model(ids, hashed=True).shape == (2, 7, 32)
    assert model.decode(ids).shape == (2, 7)
    with pytest.raises(ValueError, match="tie_embeddings"):
        tiny_model(tie_embeddings=True)
    with pytest.raises(ValueError, match="token_bytes lists"):
        tiny_model(vocab_size=6)


def test_tfree_trains_on_the_bundled_data_and_eval_bpb_runs(tokenized_dir, tokenizer_dir, tmp_path):
    from entroweight.models.checkpoint import load_checkpoint
    from entroweight.trainers import TrainConfig, TrainError, train
    from entroweight.trainers.bpb import eval_bpb
    from entroweight.transforms.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    out = tmp_path / "tfree"
    mc = {"d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 128, "n_hash": 256, "n_active": 2}
    cfg = dict(data=str(tokenized_dir), model="tfree", model_config=mc, batch_size=8, lr=3e-3, quiet=True)
    train(
        TrainConfig(
            out=str(out), loss="tfree_bce", steps=30, log_every=5, tokenizer=str(tokenizer_dir), **cfg
        )
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] * 0.7  # BCE summed over the 256-wide head
    assert rows[-1]["ce"] < rows[0]["ce"]  # the vocabulary softmax learns through the BCE
    # the checkpoint rebuilds the same patterns from the tokenizer's bytes recorded in its config
    model, config = load_checkpoint(out)
    tb = load_tokenizer(tokenizer_dir).token_bytes
    assert config["model"]["token_bytes"] == [b.hex() for b in tb]
    assert (
        model.codes[300, :4].tolist()[: len(token_positions(tb[300], 300, 256, 2))]
        == token_positions(tb[300], 300, 256, 2)[:4]
    )
    res = eval_bpb(out, max_bytes=20_000, n_ctx=16, stride=16, device="cpu")
    assert 0 < res["bpb"] < 8 * math.log2(1024) and res["bytes"] > 19_000
    # the T-FREE loss needs the T-FREE head
    with pytest.raises(TrainError, match="--model tfree"):
        train(
            TrainConfig(
                out=str(tmp_path / "x"),
                loss="tfree_bce",
                steps=1,
                **{**cfg, "model": "llama", "model_config": {**TINY, "n_ctx": 128}},
            )
        )


def test_tfree_trains_from_the_cli(tokenized_dir, tokenizer_dir, tmp_path):
    from click.testing import CliRunner

    from entroweight.workflows.cli.main import main

    cfg = tmp_path / "tfree.yaml"
    cfg.write_text("{d_model: 32, n_layers: 1, n_heads: 2, d_ff: 64, n_hash: 128, n_active: 2}")
    args = [
        "train",
        str(tokenized_dir),
        "--model",
        "tfree",
        "--model-config",
        str(cfg),
        "--loss",
        "tfree_bce",
    ]
    args += [
        "--tokenizer",
        str(tokenizer_dir),
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--out",
        str(tmp_path / "m"),
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "m" / "model.safetensors").exists()
