"""causal_loss: per-token cross-entropy (nats) of a causal LM that reads the data's own ids.

The model is one of our checkpoints (`checkpoint=DIR`) or any HF `AutoModelForCausalLM` (`model=ID_OR_DIR`,
or a .gguf file). Value i = CE of token i given the tokens before it (see scorers/base.py).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field, model_validator

from . import hf
from .base import HFModelOptions, Scorer, ScorerError, fill_first_token
from .estimator_common import checkpoint_vocab
from .forward import (
    autocast,
    check_dtype,
    chunked_ce,
    hf_token_losses,
    resolve_dtype,
    to_compute_dtype,
    to_device,
    with_start_token,
)

ONE_MODEL = "give exactly one of --model (HF id, directory or .gguf) or --checkpoint (ours)"


class CausalLossScorer(Scorer):
    name = "causal_loss"

    class Options(HFModelOptions):
        model: str | None = Field(None, description="HF causal LM: hub id, directory or .gguf file.")
        checkpoint: str | None = Field(None, description="One of our checkpoints (instead of model).")

        @model_validator(mode="after")
        def _one_model(self):
            if (self.model is None) == (self.checkpoint is None):
                raise ValueError(ONE_MODEL)
            return self

    def __init__(
        self,
        model: str | None = None,
        checkpoint: str | None = None,
        dtype: str | None = None,
        batch_size: int = 16,
        device: str = "cpu",
        **options: Any,
    ):
        super().__init__(batch_size=batch_size, device=device, **options)
        if (model is None) == (checkpoint is None):
            raise ScorerError(ONE_MODEL)
        self.model_spec, self.checkpoint = model, checkpoint
        # what was asked ('auto' included) is the config; the worker resolves it in setup()
        self.dtype_option = check_dtype(dtype)
        self.dtype = None
        self._model = None
        if checkpoint is not None:
            from entroweight.models.checkpoint import read_checkpoint_config

            self._ckpt_config = read_checkpoint_config(checkpoint)
            self._resolved = None
        else:
            self._resolved = hf.resolve_model(model)
            self._ckpt_config = None
        # a hub model is pinned to the commit it had when the run was planned (workers load that one)
        self.revision = hf.hub_revision(model) if isinstance(self._resolved, str) else None

    # -- driver side (cheap)
    def config(self) -> dict[str, Any]:
        if self.checkpoint is not None:
            return {
                "scorer": self.name,
                "checkpoint": Path(self.checkpoint).name,
                "checkpoint_sha256": self._ckpt_config.get("weights_sha256"),
                "dtype": self.dtype_option,
            }
        return {
            "scorer": self.name,
            "model": self.model_spec if isinstance(self._resolved, str) else Path(self.model_spec).name,
            "model_sha256": hf.model_sha256(self._resolved),
            **({"model_revision": self.revision} if isinstance(self._resolved, str) else {}),
            "dtype": self.dtype_option,
        }

    def vocab_size(self) -> int | None:
        if self.checkpoint is not None:
            return checkpoint_vocab(self._ckpt_config)
        if not isinstance(self._resolved, Path):
            return None  # a hub id: its config is not read before the model loads
        cfg = json.loads((self._resolved / "config.json").read_text())
        size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        return int(size) if size else None

    def check_data_tokenizer(self, sha256: str, data_tokenizer=None) -> None:
        if self.checkpoint is not None:
            want = self._ckpt_config.get("tokenizer_sha256")
            if want and want != sha256:
                raise ScorerError(
                    f"the checkpoint {self.checkpoint} was trained on tokenizer {want[:12]}…, the data is "
                    f"tokenized with {sha256[:12]}…: retokenize the data with the checkpoint's tokenizer"
                )
            return
        model_tok, _ = hf.load_model_tokenizer(self._resolved)
        if model_tok.sha256 == sha256:
            return
        if data_tokenizer is None:
            raise ScorerError(
                f"the data's tokenizer ({sha256[:12]}…) is not the file of {self.model_spec}; pass --tokenizer "
                "with the data's tokenizer so the vocabularies can be compared, or use --scorer cross_tokenizer"
            )
        if not same_vocabulary(data_tokenizer, model_tok):
            raise ScorerError(
                f"the data's tokenizer ({data_tokenizer.path}) and {self.model_spec}'s differ: ids mean "
                "different text; use --scorer cross_tokenizer"
            )

    # -- worker side
    def setup(self, data_tokenizer=None) -> None:
        if self._model is not None:
            return
        self.dtype = resolve_dtype(self.dtype_option, self.device)  # here, where the model runs
        if self.checkpoint is not None:
            from entroweight.models.checkpoint import load_checkpoint

            self._model, _ = load_checkpoint(
                self.checkpoint,
                map_location=self.device,
                allow_pickle=self.options.get("allow_pickle", False),
            )
            to_compute_dtype(self._model, self.dtype)
            # our models read no attention mask: they see the left padding they were trained on
            self.cut_padding = "attention_mask" in inspect.signature(self._model.forward).parameters
            self._start = None
        else:
            self._model = hf.load_causal_lm(
                self._resolved,
                self.device,
                dtype=self.dtype,
                revision=self.revision,
                **hf.load_options(self.options),
            )
            self._start_info = hf.start_token(self._resolved, hf.model_tokenizer(self._resolved))
            self._start = self._start_info.id

    def metadata(self) -> dict[str, Any]:
        extra = {"start_token": self._start_info.as_dict()} if getattr(self, "_start_info", None) else {}
        return {**super().metadata(), **extra}

    def score_batch(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
        ids = to_device(input_ids.astype(np.int64), self.device)
        lengths = to_device(ids.shape[1] - n_pad, self.device)
        if self.checkpoint is not None:
            values = self._checkpoint_losses(ids, lengths)
        else:
            x, mask = with_start_token(ids, lengths, self._start)
            values = hf_token_losses(self._model, x, mask, self.dtype)[:, x.shape[1] - ids.shape[1] :]
        values = values.cpu().numpy()
        has_context = (
            (n_pad > 0) if self.checkpoint is not None else np.full(len(n_pad), self._start is not None)
        )
        fill_first_token(values, n_pad, has_context)
        return values

    def _checkpoint_losses(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Our models return full logits: sub-batch so that fp32 logits stay within a few chunks."""
        B, T = ids.shape
        out = torch.zeros((B, T), dtype=torch.float32, device=ids.device)
        col = torch.arange(T, device=ids.device)[None, :]
        # h[t] predicts ids[t+1]; the pad just before the first real token predicts it
        pred = col[:, :-1] >= (T - lengths - 1)[:, None]
        step = max(1, 8192 // T)
        with torch.inference_mode(), autocast(self.device, self.dtype):
            for s in range(0, B, step):
                logits = self._model(ids[s : s + step])[:, :-1]
                ce = chunked_ce(logits.reshape(-1, logits.shape[-1]), ids[s : s + step, 1:].reshape(-1))
                # pads zeroed by `where`, not selected by a boolean mask: no host sync per sub-batch
                out[s : s + step, 1:] = torch.where(pred[s : s + step], ce.view(-1, T - 1), 0.0)
        return out


def same_vocabulary(a, b) -> bool:
    """Every id of `a` stands for the same bytes in `b` (specials aside): its ids can be fed to b's model."""
    if a.vocab_size > b.vocab_size:
        return False
    tb = b.token_bytes
    return all(x == tb[i] for i, x in enumerate(a.token_bytes) if x)
