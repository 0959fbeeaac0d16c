"""Training losses over next-token logits, all masked to real (non-pad) target positions.

Shapes: `logits` (B, T, V) already aligned with `targets` (B, T) (i.e. the model's logits[:, :-1]
against input_ids[:, 1:]); `mask` (B, T) bool, True on real targets; `weight` and `entropy` (B, T)
are the data's per-token columns aligned with the targets. Every loss returns a scalar.

Normalisation: each loss is a sum over real target tokens divided by a normaliser: their count
(`weighted_ce` can instead divide by the sum of their weights), so a batch with more pads does not
get a smaller loss. Called alone, a loss divides by its own batch's normaliser; the training loop
passes `denominator`, the normaliser of the whole optimizer step (every micro-batch of every rank:
`Loss.normaliser`), so that a token's share of a step never depends on which micro-batch it fell in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported inside each function: the registry at the end (names and needs) loads without it,
# since the CLI's options and the workflow schema are built from it at start-up


def per_token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in nats per position (B, T), computed in fp32."""
    import torch.nn.functional as F

    B, T, V = logits.shape
    ce = F.cross_entropy(logits.reshape(B * T, V).float(), targets.reshape(B * T), reduction="none")
    return ce.view(B, T)


def floor(normaliser: torch.Tensor) -> torch.Tensor:
    """A normaliser made safe to divide by: a batch of only pads (or of weight 0) gives 0, not NaN."""
    return normaliser.clamp(min=1e-8)


def real_tokens(mask, **_) -> torch.Tensor:
    """The normaliser of every loss that is a mean over real target tokens: their count."""
    return mask.sum().float()


def weight_normaliser(mask, weight, normalize: str = "tokens", **_) -> torch.Tensor:
    """`weighted_ce`'s normaliser: the real target tokens' count, or (`normalize="weight"`) their Σ w."""
    import torch

    if normalize == "tokens":
        return real_tokens(mask)
    if normalize == "weight":
        return torch.where(mask.bool(), weight.float(), 0.0).sum()
    raise ValueError(f"weighted_ce normalize must be 'tokens' or 'weight', not {normalize!r}")


def _mean(values: torch.Tensor, mask: torch.Tensor, denominator=None) -> torch.Tensor:
    return (values * mask).sum() / (floor(real_tokens(mask)) if denominator is None else denominator)


def ce(logits, targets, mask, denominator=None, **_):
    return _mean(per_token_ce(logits, targets), mask, denominator)


def weighted_ce(logits, targets, mask, weight, normalize: str = "tokens", denominator=None, **_):
    """Σ w_i·CE_i over real tokens, divided by their count (`normalize="tokens"`) or by Σ w_i ("weight"),
    or by `denominator` where given (the step's normaliser: `weight_normaliser` summed over it).

    At its edges: a position of weight 0 (pads included) contributes exactly 0, even where its CE is
    not finite, so a batch (or one DDP rank's share) whose weights are all 0 gives loss 0 and zero
    gradients, never NaN, under both normalizations; `weight` must be floating point (w in [0, 1]: an
    integer tensor would be the stored round(255·w) or weights truncated to 0 and 1), else TypeError."""
    import torch

    if not weight.is_floating_point():
        raise TypeError(f"weighted_ce takes floating-point weights in [0, 1], not {weight.dtype}")
    w = torch.where(mask.bool(), weight.float(), 0.0)
    ce = per_token_ce(logits, targets)
    total = torch.where(w > 0, ce * w, 0.0).sum()
    own = floor(weight_normaliser(mask, w, normalize))  # (refuses an unknown normalize either way)
    return total / (own if denominator is None else denominator)


def rescaled(logits, targets, mask, entropy, denominator=None, **_):
    """mean |CE_i − e_i| over real tokens: fit each token down to its estimated entropy, not below."""
    return _mean((per_token_ce(logits, targets) - entropy.float()).abs(), mask, denominator)


def hard_negative(logits, targets, mask, margin: float = 2.0, denominator=None, **_):
    """CE after setting logits below `logit[target] − margin` to −inf (selfish tokens).

    Masked logits get no gradient, so only near-competitors of the target are pushed down.
    """
    logits = logits.float()
    target_logit = logits.gather(-1, targets.unsqueeze(-1))
    # the target itself is never below its own threshold, so each row keeps a finite logit
    logits = logits.masked_fill(logits < target_logit - margin, float("-inf"))
    return _mean(per_token_ce(logits, targets), mask, denominator)


def prefix_smooth(
    logits, targets, mask, prefix_table: torch.Tensor, prefix_weight: float = 0.1, denominator=None, **_
):
    """CE against a soft target: 1 on the target, `prefix_weight` on each vocabulary token that is a
    proper byte prefix of it, normalised to sum to 1. A control reported to hurt BPB.

    `prefix_table` (V, K) int64 lists each token's prefix tokens, padded with −1 (see
    `trainers.prefix.prefix_table`).
    """
    import torch.nn.functional as F

    logp = F.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    pref = prefix_table.to(targets.device)[targets]  # (B, T, K)
    valid = pref >= 0
    pref_nll = -logp.gather(-1, pref.clamp(min=0)) * valid
    k = valid.sum(-1)
    loss = (nll + prefix_weight * pref_nll.sum(-1)) / (1 + prefix_weight * k)
    return _mean(loss, mask, denominator)


def tfree_bce(logits, targets, mask, codes: torch.Tensor, denominator=None, **_):
    """T-FREE's multi-label loss: BCE of the (B, T, n_hash) head logits against the target token's
    multi-hot pattern, summed over the head (the pattern's negative log-likelihood in nats), mean over
    real targets.

    `codes` (V, K) int64 lists each token's active positions, padded with -1 (`models.tfree`).
    """
    import torch
    import torch.nn.functional as F

    n_hash = logits.shape[-1]
    pos = codes.to(targets.device)[targets]  # (B, T, K)
    # pads write into an extra column that is then dropped, so they never clear a real 1
    pos = torch.where(pos >= 0, pos, n_hash)
    y = torch.zeros(*targets.shape, n_hash + 1, device=logits.device).scatter_(-1, pos, 1.0)[..., :n_hash]
    bce = F.binary_cross_entropy_with_logits(logits.float(), y, reduction="none").sum(-1)
    return _mean(bce, mask, denominator)


@dataclasses.dataclass(frozen=True)
class Loss:
    """A loss and what it needs beyond logits, targets and mask: the registry entry `_train` reads."""

    fn: Callable[..., torch.Tensor]
    columns: tuple[str, ...] = ()  # the data's per-token columns (fed aligned with the targets)
    options: tuple[str, ...] = ()  # TrainConfig fields passed as keyword arguments
    nats: bool = False  # the `entropy` column must hold nats (a floor the CE is fitted down to)
    token_bytes: bool = False  # the tokenizer's token bytes (prefix_smooth's prefix table)
    hashed_head: bool = False  # trains the model's hashed head logits (T-FREE), not vocabulary logits
    # what `fn`'s sum is divided by, of one micro-batch (mask, columns, options): the loop sums it
    # over the step's micro-batches and ranks and passes the total as `fn`'s `denominator`
    normaliser: Callable[..., torch.Tensor] = real_tokens


LOSSES: dict[str, Loss] = {
    "ce": Loss(ce),
    "weighted_ce": Loss(
        weighted_ce, columns=("weight",), options=("normalize",), normaliser=weight_normaliser
    ),
    "rescaled": Loss(rescaled, columns=("entropy",), nats=True),
    "hard_negative": Loss(hard_negative, options=("margin",)),
    "prefix_smooth": Loss(prefix_smooth, options=("prefix_weight",), token_bytes=True),
    "tfree_bce": Loss(tfree_bce, hashed_head=True),
}


def compute_loss(name: str, logits, targets, mask, **kw) -> torch.Tensor:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
    return LOSSES[name].fn(logits, targets, mask, **kw)
