"""decomposition: exact conditional entropy of each token from one model, by the pad shift.

The write-up's single-model form (left padding, a model that saw pads in training):

    H(t_N | t_<N) = L(O(t_0:N-1), t_1:N) − L(O(t_-1:N-2), t_0:N-1)

L sums the per-token CE (nats) over a window's real targets under the model's full forward (for an
estimator, with the embedding of that window: the encoder reads each window anew, and the
fixed-size embedding's bits cancel in the difference). The first window ends at token N; the second
is the first shifted right by one pad (it ends at N − 1). So the value of token i is the loss-sum of
the window ending at i minus that of the window ending at i − 1, with windows of the model's n_ctx,
left-padded with the checkpoint's pad id. With data no wider than n_ctx, the shifted window of token
i *is* the window of token i − 1, so one forward per real token covers the row (identical windows run
once); wider data slides both windows (the shifted window keeps n_ctx − 1 tokens). The first real
token's value is its loss given pads only. Costs one model forward per token (×n_ctx of causal_loss).
"""

from __future__ import annotations

import numpy as np
import torch.nn as nn

from .estimator_common import CheckpointScorer, window_loss_sums, windows


class DecompositionScorer(CheckpointScorer):
    name = "decomposition"

    def score_batch(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
        return window_differences(
            self._model,
            self._model,
            input_ids,
            n_pad,
            self.n_ctx,
            self.n_ctx,
            self.pad_id,
            self.device,
            self.dtype,
        )


def window_differences(
    long: nn.Module,
    short: nn.Module,
    input_ids: np.ndarray,
    n_pad: np.ndarray,
    n_long: int,
    n_short: int,
    pad_id: int,
    device: str = "cpu",
    dtype: str = "fp32",
) -> np.ndarray:
    """(B, T) left-padded ids -> (B, T) float32: value i = L_long(window of the last n_long tokens ending
    at i, width n_long) − L_short(window of the last n_long − 1 tokens ending at i − 1, width n_short).
    All windows of the batch run together (sub-batched by memory); pads 0."""
    B, T = input_ids.shape
    rows, ends, where = [], [], []
    for r in range(B):
        tokens = np.asarray(input_ids[r, n_pad[r] :], dtype=np.int64)
        for j in range(len(tokens)):
            rows.append(tokens)
            ends.append(j)
            where.append((r, int(n_pad[r]) + j))
    out = np.zeros((B, T), dtype=np.float32)
    if not rows:
        return out
    w_long, c_long = windows(rows, ends, n_long, n_long, pad_id)
    w_short, c_short = windows(rows, [j - 1 for j in ends], n_long - 1, n_short, pad_id)
    if short is long and n_short == n_long:
        # one model: run the union of windows once (the shifted window of i is usually the window of i − 1)
        sums = window_loss_sums(
            long, np.concatenate([w_long, w_short]), np.concatenate([c_long, c_short]), device, dtype
        )
        diff = sums[: len(rows)] - sums[len(rows) :]
    else:
        diff = window_loss_sums(long, w_long, c_long, device, dtype) - window_loss_sums(
            short, w_short, c_short, device, dtype
        )
    r_idx, c_idx = np.array(where).T
    out[r_idx, c_idx] = diff
    return out


__all__ = ["DecompositionScorer", "window_differences"]
