"""grad_input: gradient × input of each output's L1 norm w.r.t. the encoder's embedding (the write-up).

    Attr(x_i) = Σ_k e_k · ∂/∂e_k Σ_v |O(e ⊕ x_{:i-1}, θd)_{v, i}|,   e = O(x, θe)

the first-order estimate of how much the L1 norm of the logits at position i changes when the
embedding is removed (occlusion's small-change counterpart). Each position needs its own backward
pass (outputs cannot be reduced before backpropagating); rows of a batch are separable, so one
backward per position serves the whole batch. Slow (a few hundred times occlusion at n_ctx 1024):
for research comparisons. Values are shifted right by one (value i is about token i), min-max
normalised per row over real positions; the first real token of an unpadded row gets the mean of
the row (scorers/base.py).
"""

from __future__ import annotations

import numpy as np
import torch

from .base import fill_first_token
from .estimator_common import CheckpointScorer, minmax_rows
from .forward import autocast


class GradInputScorer(CheckpointScorer):
    name = "grad_input"
    kinds = ("estimator",)
    unit = "grad_input_minmax"  # [0, 1] per row

    def score_batch(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
        ids, added = self.to_model_width(input_ids, n_pad)
        first = int(n_pad.min()) + added  # no output before the pad just before the first real token
        W = self.packed_width(n_pad, input_ids.shape[1])  # the encoder reads its pad columns once
        model, pad = self._model, self.pad_id
        prefix = self.memo.get(("encoder", pad), lambda: model.encoder_prefix(pad)) if self.pack else None
        raw = grad_input_values(model, ids, self.dtype, max(first - 1, 0), prefix, W)[:, added:]
        fill_first_token(raw, n_pad, n_pad > 0)
        return minmax_rows(raw, n_pad)


def grad_input_values(
    model, ids: torch.Tensor, dtype: str = "fp32", first: int = 0, prefix=None, width: int | None = None
) -> np.ndarray:
    """(B, T) ids -> (B, T) raw float32 attributions, shifted (value t + 1 from output t; value 0 is 0).
    Outputs before `first` are skipped (they predict pads). With the encoder's pad `prefix`
    (models/estimator.py `encoder_prefix`), the encoder computes the last `width` columns only."""
    B, T = ids.shape
    out = torch.zeros((B, T), dtype=torch.float32, device=ids.device)  # on the device: one copy at the end
    with torch.enable_grad(), autocast(ids.device.type, dtype):
        with torch.no_grad():
            e = (
                model.encode(ids)
                if prefix is None
                else model.encode(ids[:, T - (width or T) :], prefix=prefix)
            )
        e = e.detach().requires_grad_(True)
        logits = model.decode(ids, e)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        norms = logits.abs().sum(-1)  # (B, T): L1 norm of each output's logits
        for t in range(first, T - 1):
            (g,) = torch.autograd.grad(norms[:, t].sum(), e, retain_graph=t < T - 2)
            out[:, t + 1] = (g * e).sum(-1).detach()
    return out.cpu().numpy()
