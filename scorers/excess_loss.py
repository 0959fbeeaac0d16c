"""excess_loss (Rho-1, beyond the write-up): per-token loss of a model minus that of a reference.

    excess_i = CE_model(t_i | t_<i) − CE_reference(t_i | t_<i)

Rho-1 scores with the model being trained and a reference trained on clean, target-like data:
tokens with a high excess are learnable and not yet learnt. Rho-1's selection keeps the top k% of
tokens by excess (it kept ~60-70%): `--weighting topk --keep 0.6 --quantiles-from SCORED` gives
weight 1 to the tokens above the dataset's 40th percentile and 0 to the rest; train with
`--loss weighted_ce --normalize weight` (the mean CE over the selected tokens: Rho-1's loss).

The model side is a `causal_loss` scorer (our checkpoint or an HF model) that reads the data's ids.
The reference either reads the same ids (a `causal_loss` scorer; refused before any work when its
tokenizer differs), or, with `cross_tokenizer=True`, is any HF model on its own tokenizer (e.g.
SmolLM2-135M for an 8k model) through the exact byte-level transfer: a `cross_tokenizer` scorer with
the `sum` aggregate, which conserves the reference's nats, so the difference is nats against nats.
Values are differences of nats (unit `nats_difference`): not an entropy estimate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from .base import Batching, Scored, Scorer, ScorerError
from .causal_loss import CausalLossScorer, HFModel, causal_kind_problem
from .cross_tokenizer import CrossTokenizerScorer


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
    unit = "nats_difference"
    kind_problem = staticmethod(causal_kind_problem)  # its model side is a causal_loss scorer

    class Options(CausalLossScorer.Options):
        reference: str = Field(
            description="The reference model: our checkpoint, or an HF id/directory/.gguf."
        )
        cross_tokenizer: bool = Field(
            False, description="The reference reads another tokenizer: byte-level transfer, sum."
        )
        context: int | None = Field(
            None, ge=2, description="cross_tokenizer reference: model tokens per window."
        )
        stride: int | None = Field(
            None, ge=1, description="cross_tokenizer reference: new tokens per window."
        )

    def __init__(
        self,
        checkpoint: str | None = None,
        model: str | None = None,
        reference: str | None = None,
        dtype: str | None = None,
        batch_size: int = 16,
        device: str = "cpu",
        cross_tokenizer: bool = False,
        context: int | None = None,
        stride: int | None = None,
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
        self.cross_tokenizer = bool(cross_tokenizer)
        if self.cross_tokenizer:
            if is_our_checkpoint(str(reference)):
                raise ScorerError(
                    "excess_loss --cross-tokenizer reads the reference on its own tokenizer: give an HF "
                    "model (id, directory or .gguf), not one of our checkpoints"
                )
            window = {k: v for k, v in (("context", context), ("stride", stride)) if v is not None}
            self.reference = CrossTokenizerScorer(model=str(reference), aggregate="sum", **kw, **window)
            self.needs_data_tokenizer = True  # the reference reads the data's text
            self.reads_documents = True  # ... a split document as one text, as cross_tokenizer alone does
            return
        if context is not None or stride is not None:
            raise ScorerError("--context / --stride are options of the cross-tokenizer reference only")
        self.reference = _side(str(reference), **kw)
        if isinstance(self.reference.source, HFModel):
            self.reference.source.other_tokenizer = "pass --cross-tokenizer to read it on its own tokenizer"
        a, b = self.model.source.tokenizer_sha256, self.reference.source.tokenizer_sha256
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

    def max_row_tokens(self) -> int | None:
        widths = [v for v in (self.model.max_row_tokens(), self.reference.max_row_tokens()) if v]
        return min(widths) if widths else None

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), **{k: v for k, v in self.reference.metadata().items() if k != "unit"}}

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

    def score(
        self,
        input_ids: np.ndarray,
        n_pad: np.ndarray,
        batching: Batching = Batching(),
        continues: np.ndarray | None = None,
    ) -> Scored:
        # each side buckets and pads its own way (HF: cut to the batch; ours: full rows); progress
        # is counted once, on the reference's side
        quiet = Batching(batching.batch_size, batching.batch_tokens)
        self.model.pack = self.reference.pack = self.pack  # both sides laid out as asked
        model = self.model.score(input_ids, n_pad, quiet)
        reference = self.reference.score(input_ids, n_pad, batching, continues=continues)
        values = model.values - reference.values
        if reference.excluded is not None:
            values[reference.excluded] = 0.0
        return Scored(
            values,
            reference.excluded,
            model.computed + reference.computed,
            model.real + reference.real,
            reference.stats,
        )
