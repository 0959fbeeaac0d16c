"""two_model: exact conditional entropy from two checkpoints of context N and N − 1 (the write-up).

    H(t_N | t_{N-M+1..N-1}) = Σ L(O(window of N tokens ending at t_N, θ_N))
                              − Σ L(O(window of N − 1 tokens ending at t_{N−1}, θ_{N−1}))

(chain rule: H(C | A, B) = H(A, B, C) − H(A, B); with equal embedding sizes the embeddings' bits
cancel). Both windows slide over the row; each is left-padded with the pad id to its model's own
n_ctx, and both sums run over the same targets but t_N (the first token of a full long window is
context in both), so with `checkpoint_short` = `checkpoint` this is exactly the one-model
`decomposition`.
`checkpoint` (context N) is the long model, `checkpoint_short` the one of context N − 1 (or more).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from .base import ScorerError
from .decomposition import DecompositionScorer
from .estimator_common import (
    CheckpointScorer,
    check_tokenizer,
    checkpoint_info,
    checkpoint_vocab,
    load_model,
    model_n_ctx,
    model_pad_id,
)


class TwoModelScorer(DecompositionScorer):
    """decomposition with the shifted windows on a second checkpoint (its score_batch)."""

    name = "two_model"

    class Options(DecompositionScorer.Options):
        checkpoint_short: str = Field(description="The checkpoint of context N − 1 (checkpoint: context N).")

    def __init__(self, checkpoint: str | None = None, checkpoint_short: str | None = None, **kw: Any):
        super().__init__(checkpoint=checkpoint, **kw)
        if checkpoint_short is None:
            raise ScorerError("the two_model scorer needs --checkpoint-short (the model of context N − 1)")
        self.checkpoint_short = str(checkpoint_short)
        self._short_config = checkpoint_info(self.checkpoint_short)
        self.n_short = model_n_ctx(self._short_config)
        if self.n_short < self.n_ctx - 1:
            raise ScorerError(
                f"--checkpoint-short has n_ctx {self.n_short}, but windows of {self.n_ctx - 1} tokens (the long "
                f"model's {self.n_ctx} − 1) must fit: train it with n_ctx {self.n_ctx - 1}"
            )
        if model_pad_id(self._short_config, self.checkpoint_short) != self.pad_id:
            raise ScorerError(
                "the two checkpoints were trained with different pad ids: they read different data"
            )
        if self._short_config.get("tokenizer_sha256") != self._ckpt_config.get("tokenizer_sha256"):
            raise ScorerError(
                "the two checkpoints were trained on different tokenizers: they read different ids"
            )
        self._short = None

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "checkpoint_short": Path(self.checkpoint_short).name,
            "checkpoint_short_sha256": self._short_config.get("weights_sha256"),
        }

    def vocab_size(self) -> int | None:
        sizes = [v for v in (super().vocab_size(), checkpoint_vocab(self._short_config)) if v]
        return min(sizes) if sizes else None

    def check_data_tokenizer(self, sha256: str, data_tokenizer=None) -> None:
        super().check_data_tokenizer(sha256, data_tokenizer)
        check_tokenizer(self._short_config, self.checkpoint_short, sha256)

    def setup(self, data_tokenizer=None) -> None:
        CheckpointScorer.setup(self, data_tokenizer)  # not decomposition's: the short model is its own
        if self._short is None:
            same = Path(self.checkpoint_short).resolve() == Path(self.checkpoint).resolve()
            self._short = (
                self._model
                if same
                else load_model(self.checkpoint_short, self.device, self.options.get("allow_pickle", False))
            )
