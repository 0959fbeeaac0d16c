"""decomposition: the conditional entropy of each token from one model, by the chain rule.

The write-up's single-model form (left padding, a model that saw pads in training):

    H(t_N | t_<N) = L(O(t_0:N-1), t_1:N) − L(O(t_-1:N-2), t_0:N-1)

is the chain rule H(t_i | c) = H(c, t_i) − H(c), c the n_ctx − 1 tokens before t_i: L sums the
per-token CE (nats) of a window under the model's full forward (for an estimator, with that window's
own embedding; the fixed-size embedding's bits cancel in the difference). The first window is the
n_ctx tokens ending at t_i; the second is the same window without t_i, shifted right by one pad.
Both sums run over the same targets but t_i: every token of the first window with a position
before it. With padding that is all its tokens (the first is predicted from the pad before it), so
the shifted window of i is the window of i − 1 and a row's values sum to its total loss
(including its first token's loss given the pad before it).
In a full window (no padding: rows as wide as n_ctx, and every window of wider data, which slides)
the first token has no position before it: it is context in both windows, never a target. Scoring
it in the shifted window alone subtracts its loss given a pad from every full window (on the
default workflow the last token of a full row then averaged ≈ 0 nats against 6.3 for the others).
The first real token's value is its loss given pads only. Costs one model forward per token
(×n_ctx of causal_loss).
"""

from __future__ import annotations

import numpy as np

from .base import Batching, Scored, score_rows
from .estimator_common import CheckpointScorer, window_differences


class DecompositionScorer(CheckpointScorer):
    name = "decomposition"
    _heavy = (*CheckpointScorer._heavy, "_short")

    def max_row_tokens(self) -> int | None:
        return None  # windows of n_ctx tokens slide over a wider row

    def setup(self, data_tokenizer=None) -> None:
        super().setup(data_tokenizer)
        # the shifted windows run on the same model (two_model sets its own short model)
        self.n_short, self._short = self.n_ctx, self._model

    def score(self, input_ids: np.ndarray, n_pad: np.ndarray, batching: Batching = Batching()) -> Scored:
        """As every scorer (length-sorted batches of rows); each batch's windows run in forwards of at
        most `batching.batch_tokens` positions."""
        budget = batching.batch_tokens
        return score_rows(
            self, input_ids, n_pad, batching, lambda ids, pads: self.score_batch(ids, pads, budget)
        )

    def score_batch(
        self, input_ids: np.ndarray, n_pad: np.ndarray, batch_tokens: int | None = None
    ) -> np.ndarray:
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
            batch_tokens,
            self.memo if self.pack else None,
        )


__all__ = ["DecompositionScorer"]
