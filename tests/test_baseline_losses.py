"""Related-work losses (issue 11) beyond test_losses.py: exact gradients, limits, hand-computed batches.

Prefix smoothing is a control reported to hurt BPB, not a recommendation; these tests pin what it
computes so the report's row is reproducible.
"""

from __future__ import annotations

import math

import pytest
import torch

from entroweight.trainers.losses import compute_loss
from entroweight.trainers.prefix import prefix_table


def lse(xs):
    return math.log(sum(math.exp(x) for x in xs))


def test_hard_negative_gradient_is_exactly_zero_on_every_masked_logit():
    torch.manual_seed(0)
    logits = (torch.randn(2, 5, 11) * 3).requires_grad_()
    targets = torch.randint(0, 11, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    margin = 1.5
    compute_loss("hard_negative", logits, targets, mask, margin=margin).backward()
    tgt = logits.detach().gather(-1, targets.unsqueeze(-1))
    dropped = logits.detach() < tgt - margin
    assert dropped.sum() > 10  # the case actually masks something
    assert torch.all(logits.grad[dropped] == 0.0)  # exactly zero, not small
    # every kept non-target logit is pushed down, every target pulled up (or left alone when it
    # is the only survivor: then the loss is already 0)
    kept = ~dropped
    kept.scatter_(-1, targets.unsqueeze(-1), False)
    assert torch.all(logits.grad[kept] > 0)
    assert torch.all(logits.grad.gather(-1, targets.unsqueeze(-1)) <= 0)


def test_hard_negative_with_a_huge_margin_is_ce_in_value_and_gradient():
    torch.manual_seed(1)
    base = torch.randn(3, 4, 7) * 5
    targets = torch.randint(0, 7, (3, 4))
    mask = torch.rand(3, 4) > 0.3
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    hn = compute_loss("hard_negative", a, targets, mask, margin=1e9)
    ce = compute_loss("ce", b, targets, mask)
    hn.backward()
    ce.backward()
    assert hn.item() == pytest.approx(ce.item(), rel=1e-6)
    assert torch.allclose(a.grad, b.grad, atol=1e-7)


def test_hard_negative_hand_computed_batch_with_a_pad():
    logits = torch.tensor([[[0.0, 5.0, -3.0], [2.0, 2.5, -0.5]]])
    targets = torch.tensor([[0, 1]])
    mask = torch.tensor([[True, True]])
    # row 0: target 0.0, threshold -2: -3 dropped; row 1: target 2.5, threshold 0.5: -0.5 dropped
    want = ((lse([0.0, 5.0]) - 0.0) + (lse([2.0, 2.5]) - 2.5)) / 2
    assert compute_loss("hard_negative", logits, targets, mask).item() == pytest.approx(want, rel=1e-6)
    pad = compute_loss("hard_negative", logits, targets, torch.tensor([[False, True]]))
    assert pad.item() == pytest.approx(lse([2.0, 2.5]) - 2.5, rel=1e-6)


def test_prefix_smooth_hand_computed_batch():
    # tokens: specials "", bytes "a" "b", and "ab", "abb" — "abb" has prefixes "a", "ab"
    tok_bytes = [b"", b"a", b"b", b"ab", b"abb"]
    table = prefix_table(tok_bytes)
    row = [[1.0, 0.0, 2.0, -1.0, 0.5], [0.3, 0.3, 0.3, 0.3, 0.3]]
    logits = torch.tensor([row])
    targets = torch.tensor([[4, 3]])
    mask = torch.tensor([[True, True]])
    pw = 0.1

    def nll(r, i):
        return lse(r) - r[i]

    # position 0: target "abb" (1), "a" and "ab" (pw each), normalised by 1 + 2 pw
    p0 = (nll(row[0], 4) + pw * (nll(row[0], 1) + nll(row[0], 3))) / (1 + 2 * pw)
    # position 1: target "ab" (1), "a" (pw), normalised by 1 + pw; uniform logits: every nll is log 5
    p1 = (nll(row[1], 3) + pw * nll(row[1], 1)) / (1 + pw)
    assert p1 == pytest.approx(math.log(5))
    got = compute_loss("prefix_smooth", logits, targets, mask, prefix_table=table, prefix_weight=pw)
    assert got.item() == pytest.approx((p0 + p1) / 2, rel=1e-6)
    # the default weight is the 0.1
    dflt = compute_loss("prefix_smooth", logits, targets, mask, prefix_table=table)
    assert dflt.item() == pytest.approx(got.item(), rel=1e-7)


def test_prefix_smooth_moves_mass_to_prefixes_so_it_pays_in_ce():
    """Why it is only a control: its optimum puts mass on prefix tokens, which costs CE (and BPB)."""
    tok_bytes = [b"", b"a", b"ab"]
    table = prefix_table(tok_bytes)
    logits = torch.zeros(1, 1, 3, requires_grad=True)
    target = torch.tensor([[2]])
    mask = torch.tensor([[True]])
    opt = torch.optim.SGD([logits], lr=1.0)
    for _ in range(300):
        opt.zero_grad()
        compute_loss("prefix_smooth", logits, target, mask, prefix_table=table, prefix_weight=0.1).backward()
        opt.step()
    p = torch.softmax(logits.detach()[0, 0], -1)
    # the soft target's optimum: 1/1.1 on "ab", 0.1/1.1 on "a", so CE stays above log(1.1)
    assert p[2].item() == pytest.approx(1 / 1.1, abs=2e-3)
    assert p[1].item() == pytest.approx(0.1 / 1.1, abs=2e-3)
    assert compute_loss("ce", logits.detach(), target, mask).item() > math.log(1.1) - 1e-3
