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

from .estimator_common import CheckpointScorer, window_differences


class DecompositionScorer(CheckpointScorer):
    name = "decomposition"
    _heavy = (*CheckpointScorer._heavy, "_short")

    def setup(self, data_tokenizer=None) -> None:
        super().setup(data_tokenizer)
        # the shifted windows run on the same model (two_model sets its own short model)
        self.n_short, self._short = self.n_ctx, self._model

    def score_batch(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
        return window_differences(
            self._model,
            self._short,
            input_ids,
            n_pad,
            self.n_ctx,
            self.n_short,
            self.pad_id,
            self.device,
            self.dtype,
        )


__all__ = ["DecompositionScorer"]
