"""Each loss against values computed by hand (math.log/exp per term) on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from entroweight.trainers.losses import compute_loss, per_token_ce
from entroweight.trainers.prefix import prefix_table


def lse(*xs):
    return math.log(sum(math.exp(x) for x in xs))


# one sequence, two target positions, vocabulary of 3
LOGITS = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.0, -1.0]]])
TARGETS = torch.tensor([[0, 2]])
MASK = torch.tensor([[True, True]])
CE0 = lse(0, 0, 0) - 0.0  # log 3
CE1 = lse(1, 0, -1) - (-1.0)


def test_per_token_ce_and_ce():
    assert per_token_ce(LOGITS, TARGETS).tolist()[0] == pytest.approx([CE0, CE1], rel=1e-6)
    assert compute_loss("ce", LOGITS, TARGETS, MASK).item() == pytest.approx((CE0 + CE1) / 2, rel=1e-6)
    # a pad target leaves the mean
    assert compute_loss("ce", LOGITS, TARGETS, torch.tensor([[True, False]])).item() == pytest.approx(
        CE0, rel=1e-6
    )


def test_weighted_ce_by_tokens_and_by_weight():
    w = torch.tensor([[0.5, 0.25]])
    by_tokens = compute_loss("weighted_ce", LOGITS, TARGETS, MASK, weight=w)
    assert by_tokens.item() == pytest.approx((0.5 * CE0 + 0.25 * CE1) / 2, rel=1e-6)
    by_weight = compute_loss("weighted_ce", LOGITS, TARGETS, MASK, weight=w, normalize="weight")
    assert by_weight.item() == pytest.approx((0.5 * CE0 + 0.25 * CE1) / 0.75, rel=1e-6)
    # weight 1 everywhere is plain CE; a masked position counts neither in the sum nor the count
    ones = torch.ones(1, 2)
    assert compute_loss("weighted_ce", LOGITS, TARGETS, MASK, weight=ones).item() == pytest.approx(
        (CE0 + CE1) / 2
    )
    half = compute_loss("weighted_ce", LOGITS, TARGETS, torch.tensor([[False, True]]), weight=w)
    assert half.item() == pytest.approx(0.25 * CE1, rel=1e-6)


def test_rescaled():
    e = torch.tensor([[1.0, 3.0]])
    got = compute_loss("rescaled", LOGITS, TARGETS, MASK, entropy=e).item()
    assert got == pytest.approx((abs(CE0 - 1.0) + abs(CE1 - 3.0)) / 2, rel=1e-6)


def test_hard_negative_masks_far_logits_and_their_gradient():
    logits = torch.tensor([[[3.0, -2.0, 1.0, 0.5]]], requires_grad=True)
    target = torch.tensor([[2]])
    mask = torch.tensor([[True]])
    # threshold 1 - 2 = -1: logit -2 is dropped; 3, 1, 0.5 stay
    loss = compute_loss("hard_negative", logits, target, mask, margin=2.0)
    assert loss.item() == pytest.approx(lse(3.0, 1.0, 0.5) - 1.0, rel=1e-6)
    loss.backward()
    assert logits.grad[0, 0, 1].item() == 0.0  # the masked logit takes no gradient
    assert logits.grad[0, 0, 0].item() > 0  # a hard negative is pushed down
    # a huge margin masks nothing: plain CE
    big = compute_loss("hard_negative", LOGITS, TARGETS, MASK, margin=1e9).item()
    assert big == pytest.approx(compute_loss("ce", LOGITS, TARGETS, MASK).item(), rel=1e-6)


def test_prefix_table_and_prefix_smooth():
    tok_bytes = [b"", b"a", b"ab", b"abc", b"b"]
    table = prefix_table(tok_bytes)
    rows = [[i for i in r if i >= 0] for r in table.tolist()]
    assert rows == [[], [], [1], [1, 2], []]
    logits = torch.tensor([[[0.0, 1.0, 2.0, 0.5, -1.0]]])
    z = lse(0.0, 1.0, 2.0, 0.5, -1.0)
    nll = {i: z - v for i, v in enumerate([0.0, 1.0, 2.0, 0.5, -1.0])}
    mask = torch.tensor([[True]])
    # target "abc": mass 1 on it, 0.5 on "a" and "ab", normalised by 1 + 2·0.5
    got = compute_loss(
        "prefix_smooth", logits, torch.tensor([[3]]), mask, prefix_table=table, prefix_weight=0.5
    )
    assert got.item() == pytest.approx((nll[3] + 0.5 * nll[1] + 0.5 * nll[2]) / 2, rel=1e-6)
    # a token without prefixes, or pw = 0, is plain CE
    got = compute_loss(
        "prefix_smooth", logits, torch.tensor([[4]]), mask, prefix_table=table, prefix_weight=0.5
    )
    assert got.item() == pytest.approx(nll[4], rel=1e-6)
    got = compute_loss(
        "prefix_smooth", logits, torch.tensor([[3]]), mask, prefix_table=table, prefix_weight=0.0
    )
    assert got.item() == pytest.approx(nll[3], rel=1e-6)


def test_token_bytes_of_a_real_tokenizer(tokenizer_dir):
    from entroweight.trainers.prefix import token_bytes
    from entroweight.transforms.tokenizer import load_tokenizer

    # the trainer's copy of the byte map agrees with the tokenizer module's
    assert token_bytes(tokenizer_dir / "tokenizer.json") == load_tokenizer(tokenizer_dir).token_bytes


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="unknown loss"):
        compute_loss("focal", LOGITS, TARGETS, MASK)
