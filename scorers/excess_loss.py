"""excess_loss (Rho-1, beyond the write-up): per-token loss of a model minus that of a reference.

    excess_i = CE_model(t_i | t_<i) − CE_reference(t_i | t_<i)

Rho-1 scores with the model being trained and a reference trained on clean, target-like data:
tokens with a high excess are learnable and not yet learnt. Weigh with `--invert` (w = e) to keep
them; keeping only the top k% (Rho-1 kept ~60-70%) is quantile weighting with a clip, e.g. top 60%:
`--weighting quantile --quantiles-from RUN --invert --clip 0.39 0.41` (the 40th percentile and up
weigh ~1, the rest ~0; a wider clip softens the edge).

Each side is a `causal_loss` scorer (our checkpoint or an HF model), so the conventions are its own;
the two must read the same ids (the data's tokenizer): refused otherwise, before any work.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from .base import Scorer, ScorerError
from .causal_loss import CausalLossScorer


def is_our_checkpoint(spec: str) -> bool:
    """Our checkpoints' config.json carries `kind` and `weights_sha256`; HF directories' do not."""
    cfg = Path(spec) / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return "kind" in data and "weights_sha256" in data


def _side(spec: str, **kw: Any) -> CausalLossScorer:
    key = "checkpoint" if is_our_checkpoint(spec) else "model"
    return CausalLossScorer(**{key: spec}, **kw)


class ExcessLossScorer(Scorer):
    name = "excess_loss"

    class Options(CausalLossScorer.Options):
        reference: str = Field(
            description="The reference model: our checkpoint, or an HF id/directory/.gguf."
        )

    def __init__(
        self,
        checkpoint: str | None = None,
        model: str | None = None,
        reference: str | None = None,
        dtype: str | None = None,
        batch_size: int = 16,
        device: str = "cpu",
        **options: Any,
    ):
        super().__init__(batch_size=batch_size, device=device, **options)
        if reference is None:
            raise ScorerError(
                "excess_loss needs --reference (our checkpoint directory, or an HF id, directory or .gguf)"
            )
        kw = {"dtype": dtype, "batch_size": batch_size, "device": device}
        kw |= {k: v for k, v in options.items() if k in ("allow_pickle", "trust_remote_code")}
        # CausalLossScorer refuses anything but exactly one of model / checkpoint
        self.model = CausalLossScorer(model=model, checkpoint=checkpoint, **kw)
        self.reference = _side(str(reference), **kw)
        a = (self.model._ckpt_config or {}).get("tokenizer_sha256")
        b = (self.reference._ckpt_config or {}).get("tokenizer_sha256")
        if a and b and a != b:
            raise ScorerError(
                f"the model ({a[:12]}…) and the reference ({b[:12]}…) were trained on different tokenizers: "
                "excess loss compares losses of the same tokens; use a reference of the same tokenizer"
            )

    def config(self) -> dict[str, Any]:
        return {
            **self.model.config(),
            "scorer": self.name,
            "reference": {k: v for k, v in self.reference.config().items() if k != "scorer"},
        }

    def vocab_size(self) -> int | None:
        sizes = [v for v in (self.model.vocab_size(), self.reference.vocab_size()) if v]
        return min(sizes) if sizes else None

    def check_data_tokenizer(self, sha256: str, data_tokenizer=None) -> None:
        for side, what in ((self.model, "model"), (self.reference, "reference")):
            try:
                side.check_data_tokenizer(sha256, data_tokenizer)
            except ScorerError as e:
                raise ScorerError(
                    f"excess_loss {what}: {e} (model and reference must read the data's ids)"
                ) from e

    def setup(self, data_tokenizer=None) -> None:
        self.model.setup(data_tokenizer)
        self.reference.setup(data_tokenizer)

    def score(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
        # each side buckets and pads its own way (HF: cut to the batch; ours: full rows)
        return self.model.score(input_ids, n_pad) - self.reference.score(input_ids, n_pad)
