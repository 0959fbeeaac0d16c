"""causal_loss: per-token cross-entropy (nats) of a causal LM that reads the data's own ids.

The model is one of our checkpoints (`checkpoint=DIR`) or any HF `AutoModelForCausalLM` (`model=ID_OR_DIR`,
or a .gguf file). Value i = CE of token i given the tokens before it (see scorers/base.py). What
differs between the two lives in one `ModelSource` each (OurCheckpoint, HFModel).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field, model_validator

from entroweight.models import is_causal
from entroweight.models.checkpoint import a_model_of
from entroweight.models.packing import after_prefix, flex_available
from entroweight.transforms.tokenizer import load_tokenizer

from . import hf
from .base import HFModelOptions, Later, Scored, Scorer, ScorerError, fill_first_token
from .estimator_common import (
    check_tokenizer,
    checkpoint_config,
    checkpoint_info,
    checkpoint_vocab,
    load_model,
    model_n_ctx,
)
from .forward import (
    HostCopy,
    autocast,
    check_dtype,
    chunked_ce,
    hf_packed_losses,
    hf_token_losses,
    next_token_ce,
    resolve_dtype,
    to_compute_dtype,
    to_device,
    with_start_token,
)
from .packing import Memo, pack_rows, pad_prefix, shared_pad

ONE_MODEL = "give exactly one of --model (HF id, directory or .gguf) or --checkpoint (ours)"


def causal_kind_problem(kind: str) -> str | None:
    """Why a checkpoint of `kind` cannot give a per-token loss given the tokens before each token:
    its CE at t would read the tokens after t (an embedding of the whole row). None for llama, mixer."""
    if is_causal(kind):
        return None
    return (
        f"{a_model_of(kind)}, whose value at a token depends on the tokens after it (its embedding saw "
        "the whole row): a per-token loss given the tokens before each token needs a causal model (llama "
        "or mixer); an estimator is read by occlusion, grad_input, decomposition or two_model"
    )


class ModelSource(ABC):
    """Where causal_loss's model comes from, one of our checkpoints or an HF model: everything that
    differs between the two, each answered in one place. The driver side is cheap (no model load);
    `load` runs on the worker."""

    revision: str | None = None  # the hub commit a hub model is pinned to
    start: int | None = None  # the token a text is read after (known once loaded)
    tokenizer_sha256: str | None = None  # the tokenizer the model was trained on, when it records one
    cut_padding = True  # the model takes an attention mask: left padding may be cut
    mask_pads = False  # our checkpoint masks the left padding: one pad is kept, to predict the first token
    prefix_rows = False  # our checkpoint attends to its padding: read from a prefix computed once

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """What identifies the model in the stage config (beside the scorer's name and dtype)."""

    @abstractmethod
    def vocab_size(self) -> int | None:
        """How many ids the model reads, found without loading it; None when it cannot tell."""

    @abstractmethod
    def check_data_tokenizer(self, sha256: str, data_tokenizer=None) -> None:
        """Raise ScorerError when the data's ids are not what the model reads."""

    def max_row_tokens(self) -> int | None:
        """The widest row the model reads, found without loading it; None when it cannot tell."""
        return None

    @abstractmethod
    def load(self, device: str, dtype: str, options: dict[str, Any]) -> torch.nn.Module:
        """The model on `device` in the compute dtype (and what is known only once it is loaded)."""

    @abstractmethod
    def token_losses(self, model, ids: np.ndarray, n_pad: np.ndarray, device: str, dtype: str, pack: bool):
        """(B, T) left-padded ids -> (a HostCopy of what the forwards give, a function of its arrays to
        the (B, T) CE of each token with pads 0, the positions the forwards computed). Nothing here
        waits for the device. `pack`: lay the rows out without computing pads where the model allows
        (scorers/packing.py)."""

    def packs_rows(self, model) -> bool:
        """Whether `token_losses` packs several rows into one sequence (known once loaded)."""
        return False

    def attention_skips_fill(self, model, device: str) -> bool:
        """Whether its attention over packed rows skips what lies outside each row (`Scorer`'s)."""
        return False

    @abstractmethod
    def has_context(self, n_pad: np.ndarray) -> np.ndarray:
        """Per row: whether its first real token was predicted from something."""

    def metadata(self) -> dict[str, Any]:
        """What the file metadata records of the model beyond config() (after load)."""
        return {}


class OurCheckpoint(ModelSource):
    """One of our checkpoints (`checkpoint=DIR`), through the checkpoint scorers' helpers. It reads no
    start token: it was trained on left-padded rows, so the padding is its context (all of it, or with
    models.llama's `mask_pads` the last pad alone)."""

    def __init__(self, checkpoint: str):
        self.checkpoint = checkpoint
        self.info = checkpoint_info(checkpoint)
        if problem := causal_kind_problem(self.info.get("kind")):
            raise ScorerError(f"{checkpoint} holds {problem}")
        self.tokenizer_sha256 = self.info.get("tokenizer_sha256")

    def config(self) -> dict[str, Any]:
        return checkpoint_config(self.checkpoint, self.info)

    def vocab_size(self) -> int | None:
        return checkpoint_vocab(self.info)

    def max_row_tokens(self) -> int | None:
        try:  # its positions: the model refuses a wider row
            return model_n_ctx(self.info)
        except (KeyError, TypeError, ValueError):  # a config that records none: the model will say
            return None

    def check_data_tokenizer(self, sha256: str, data_tokenizer=None) -> None:
        check_tokenizer(self.info, self.checkpoint, sha256)

    def load(self, device: str, dtype: str, options: dict[str, Any]) -> torch.nn.Module:
        model = load_model(self.checkpoint, device, options.get("allow_pickle", False))
        to_compute_dtype(model, dtype)
        # our models see the left padding they were trained on, unless trained to mask it
        self.mask_pads = bool(getattr(getattr(model, "config", None), "mask_pads", False))
        # a model that attends to its pads reads them from a prefix computed once (llama, mixer), its
        # rows cut to the batch's widest (scorers/packing.py says why they are not packed)
        self.prefix_rows = not self.mask_pads and hasattr(model, "prefix_of")
        self.prefixes = Memo()
        self.cut_padding = self.mask_pads
        return model

    def token_losses(self, model, ids: np.ndarray, n_pad: np.ndarray, device: str, dtype: str, pack: bool):
        B, T = ids.shape
        W = min(int((T - n_pad).max(initial=0)) + 1, T)  # the last pad before a row predicts its first token
        with torch.inference_mode(), autocast(device, dtype):
            if pack and self.mask_pads:
                return self._packed(model, ids, n_pad, device)
            pad = shared_pad(ids, T - W) if pack and self.prefix_rows else None
            if pad is not None:
                layout = (
                    None if pad < 0 else after_prefix(pad_prefix(model, pad, self.prefixes), T - W, W, device)
                )
                out = torch.zeros((B, T), dtype=torch.float32, device=device)
                x = to_device(np.ascontiguousarray(ids[:, T - W :]), device)
                h = model.forward_hidden(model.embed(x), layout=layout)
                out[:, T - W :] = self._window_ce(model, h, x, T - n_pad)
                return HostCopy(out), _first, B * W
            out = self._rows(model, to_device(ids, device), to_device(T - n_pad, device))
            return HostCopy(out), _first, B * T

    def packs_rows(self, model) -> bool:
        return self.mask_pads

    def attention_skips_fill(self, model, device: str) -> bool:
        return flex_available(device)  # the mask `Packed.layout` builds

    @staticmethod
    def _window_ce(model, h: torch.Tensor, x: torch.Tensor, lengths: np.ndarray) -> torch.Tensor:
        """(B, W) CE of each real token of left-padded rows (`lengths` real tokens each) from the hidden
        states `h` (the pad just before the first real token predicts it), pads 0."""
        W = x.shape[1]
        seg = np.where(np.arange(W)[None, :] >= (W - lengths - 1)[:, None], 0, -1)
        return next_token_ce(h, x, seg, model.lm_head)

    def _packed(self, model, ids: np.ndarray, n_pad: np.ndarray, device: str):
        """The rows' real tokens packed, several rows a sequence, positions restarting per row (a
        `mask_pads` model); no pad is computed but each row's last, which predicts its first token
        alone (at position 0, seeing itself)."""
        B, T = ids.shape
        rows = [ids[r, n_pad[r] :] for r in range(B)]
        lengths = [len(r) for r in rows]
        packed = pack_rows(rows, T)  # as wide as the data's rows, as the planner grouped them
        padded = np.flatnonzero((n_pad > 0) & (n_pad < T))
        x = to_device(packed.ids, device)
        h = model.forward_hidden(model.embed(x), layout=packed.layout(device))
        ce = next_token_ce(h, x, packed.segments, model.lm_head)
        ce_first = torch.zeros(0, device=ce.device)
        if len(padded):  # each row's last pad predicts its first token from itself alone
            pads, at = np.unique(ids[padded, n_pad[padded] - 1], return_inverse=True)
            table = torch.stack([self._alone(model, int(p), device) for p in pads])
            first = to_device(ids[padded, n_pad[padded]], device)
            ce_first = -table[to_device(at.reshape(-1), device), first]

        def place(arrays):  # the rows placed on the host side (no per-row device indexing)
            values, first = arrays
            full = np.zeros((B, T), dtype=np.float32)
            for r, v in enumerate(packed.rows(values, lengths)):
                full[r, n_pad[r] :] = v
            full[padded, n_pad[padded]] = first
            return full

        return HostCopy(ce, ce_first), place, packed.ids.size + len(padded)

    def _alone(self, model, pad: int, device: str) -> torch.Tensor:
        """(V,) fp32 log-probabilities a `mask_pads` model gives after the pad `pad` alone: a pad
        sees only itself at position 0, so this is every row's prediction of its first token,
        computed once per pad id (it was one forward of each row's last pad a batch)."""

        def build():
            h = model.forward_hidden(model.embed(to_device(np.array([[pad]]), device)))[0, 0]
            return torch.log_softmax(model.lm_head(h).float(), -1)

        return self.prefixes.get(("alone", pad), build)

    def _rows(self, model, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One row per batch row, padding included (the reference): full logits, sub-batched so that
        fp32 logits stay within a few chunks."""
        B, T = ids.shape
        out = torch.zeros((B, T), dtype=torch.float32, device=ids.device)
        col = torch.arange(T, device=ids.device)[None, :]
        # h[t] predicts ids[t+1]; the pad just before the first real token predicts it
        pred = col[:, :-1] >= (T - lengths - 1)[:, None]
        step = max(1, 8192 // T)
        real = col >= (T - lengths)[:, None]  # read by a model that masks pads
        for s in range(0, B, step):
            mask = {"attention_mask": real[s : s + step]} if self.mask_pads else {}
            logits = model(ids[s : s + step], **mask)[:, :-1]
            ce = chunked_ce(logits.reshape(-1, logits.shape[-1]), ids[s : s + step, 1:].reshape(-1))
            # pads zeroed by `where`, not selected by a boolean mask: no host sync per sub-batch
            out[s : s + step, 1:] = torch.where(pred[s : s + step], ce.view(-1, T - 1), 0.0)
        return out

    def has_context(self, n_pad: np.ndarray) -> np.ndarray:
        return n_pad > 0


class HFModel(ModelSource):
    """Any HF `AutoModelForCausalLM` (`model=ID_OR_DIR`, or a .gguf file); it reads a start token."""

    def __init__(self, model: str):
        # no I/O here: the driver reads what it needs on first use (config, vocabulary, tokenizer);
        # a GGUF file is dequantized by `resolved`, only where the model loads
        self.model = model
        self.start_info: hf.StartToken | None = None
        # what a refusal of another tokenizer advises (excess_loss's reference: its --cross-tokenizer)
        self.other_tokenizer = "use --scorer cross_tokenizer"

    @cached_property
    def gguf(self) -> Path | None:
        return hf.gguf_file(self.model)

    @cached_property
    def resolved(self) -> Path | str:
        """A local HF directory (a GGUF converted: on the worker, in load()), or the hub id."""
        return hf.resolve_model(self.model)

    @cached_property
    def is_hub(self) -> bool:
        return self.gguf is None and isinstance(self.resolved, str)

    @cached_property
    def revision(self) -> str | None:
        # a hub model is pinned to the commit it had when the run was planned (workers load that one)
        return hf.hub_revision(self.model) if self.is_hub else None

    @cached_property
    def sha256(self) -> str | None:
        """The weights' identity, hashed once (config() is asked for it several times a shard)."""
        if self.gguf is not None:  # the conversion is keyed by the file's sha256: the same identity
            return hf.gguf_sha256(self.gguf)
        return hf.model_sha256(self.resolved)

    def config(self) -> dict[str, Any]:
        return {
            "model": self.model if self.is_hub else Path(self.model).name,
            "model_sha256": self.sha256,
            **({"model_revision": self.revision} if self.is_hub else {}),
        }

    def vocab_size(self) -> int | None:
        if self.gguf is not None:
            return hf.gguf_vocab_size(self.gguf)
        if not isinstance(self.resolved, Path):
            return None  # a hub id: its config is not read before the model loads
        cfg = json.loads((self.resolved / "config.json").read_text())
        size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        return int(size) if size else None

    def check_data_tokenizer(self, sha256: str, data_tokenizer=None) -> None:
        model_tok = self.tokenizer()
        if model_tok.sha256 == sha256:
            return
        if data_tokenizer is None:
            raise ScorerError(
                f"the data's tokenizer ({sha256[:12]}…) is not the file of {self.model}; pass --tokenizer "
                f"with the data's tokenizer so the vocabularies can be compared, or {self.other_tokenizer}"
            )
        if not same_vocabulary(data_tokenizer, model_tok):
            raise ScorerError(
                f"the data's tokenizer ({data_tokenizer.path}) and {self.model}'s differ: ids mean "
                f"different text; {self.other_tokenizer}"
            )

    def load(self, device: str, dtype: str, options: dict[str, Any]) -> torch.nn.Module:
        model = hf.load_causal_lm(
            self.resolved, device, dtype=dtype, revision=self.revision, **hf.load_options(options)
        )
        self.start_info = hf.start_token(self.resolved, self.tokenizer())
        self.start = self.start_info.id
        return model

    def tokenizer(self):
        """The model's tokenizer, at the pinned revision (a GGUF's from its metadata: no conversion)."""
        if self.gguf is not None and "resolved" not in self.__dict__:
            return load_tokenizer(hf.gguf_tokenizer(self.gguf))
        return hf.model_tokenizer(self.resolved, self.revision)

    def token_losses(self, model, ids: np.ndarray, n_pad: np.ndarray, device: str, dtype: str, pack: bool):
        B, T = ids.shape
        if not (pack and hf.packs(model)):
            t = to_device(ids, device)
            x, mask = with_start_token(t, to_device(T - n_pad, device), self.start)
            return HostCopy(hf_token_losses(model, x, mask, dtype)[:, x.shape[1] - T :]), _first, x.numel()
        # each row from its start token, several rows per sequence (positions restart per row)
        start = [] if self.start is None else [self.start]
        rows = [np.concatenate([start, ids[r, n_pad[r] :]]).astype(np.int64) for r in range(B)]
        lengths = [len(r) for r in rows]
        packed = pack_rows(rows, T + len(start))  # the planner's sequence width, and the start token

        def place(arrays):
            out = np.zeros((B, T), dtype=np.float32)
            for r, v in enumerate(packed.rows(arrays[0], lengths)):
                out[r, n_pad[r] :] = v[len(start) :]
            return out

        return HostCopy(hf_packed_losses(model, packed, device, dtype)), place, packed.ids.size

    def packs_rows(self, model) -> bool:
        return hf.packs(model)

    def attention_skips_fill(self, model, device: str) -> bool:
        return hf.attention_skips_fill(model)

    def has_context(self, n_pad: np.ndarray) -> np.ndarray:
        return np.full(len(n_pad), self.start is not None)

    def metadata(self) -> dict[str, Any]:
        return {"start_token": self.start_info.as_dict()} if self.start_info else {}


class CausalLossScorer(Scorer):
    name = "causal_loss"
    kind_problem = staticmethod(causal_kind_problem)

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
        self.source = OurCheckpoint(checkpoint) if checkpoint is not None else HFModel(model)
        # what was asked ('auto' included) is the config; the worker resolves it in setup()
        self.dtype_option = check_dtype(dtype)
        self.dtype = None
        self._model = None

    @property
    def revision(self) -> str | None:
        return self.source.revision

    @property
    def cut_padding(self) -> bool:
        return self.source.cut_padding

    @property
    def _start(self) -> int | None:  # the start token id, named as on cross_tokenizer
        return self.source.start

    # -- driver side (cheap)
    def config(self) -> dict[str, Any]:
        return {"scorer": self.name, **self.source.config(), "dtype": self.dtype_option}

    def vocab_size(self) -> int | None:
        return self.source.vocab_size()

    def max_row_tokens(self) -> int | None:
        return self.source.max_row_tokens()

    def check_data_tokenizer(self, sha256: str, data_tokenizer=None) -> None:
        self.source.check_data_tokenizer(sha256, data_tokenizer)

    # -- worker side
    def setup(self, data_tokenizer=None) -> None:
        if self._model is not None:
            return
        self.dtype = resolve_dtype(self.dtype_option, self.device)  # here, where the model runs
        self._model = self.source.load(self.device, self.dtype, self.options)

    def batch_width(self, longest: int, T: int) -> int:
        if self.source.mask_pads or (self.source.prefix_rows and self.pack):
            # one pad kept: it predicts the first real token (from nothing, or from the pads before it)
            return min(longest + 1, T)
        return super().batch_width(longest, T)

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), **self.source.metadata()}

    def batch_columns(self, width: int, T: int) -> int:
        # rows read after a shared pad prefix keep their width: it says where the prefix ends
        return T if self.source.prefix_rows and self.pack else super().batch_columns(width, T)

    def packs_rows(self) -> bool:
        return self.pack and self.source.packs_rows(self._model)

    def attention_skips_fill(self) -> bool:
        return self.source.attention_skips_fill(self._model, self.device)

    def score_batch(self, input_ids: np.ndarray, n_pad: np.ndarray) -> Scored:
        ids = input_ids.astype(np.int64)
        copy, to_values, computed = self.source.token_losses(
            self._model, ids, n_pad, self.device, self.dtype, self.pack
        )

        def finish() -> Scored:  # after the next batch is queued (base.Later)
            values = to_values(copy.arrays())
            fill_first_token(values, n_pad, self.source.has_context(n_pad))
            return Scored(values, computed=computed)

        return Later(finish)


def _first(arrays: list[np.ndarray]) -> np.ndarray:
    """The values of a source that computed them as one (B, T) tensor."""
    return arrays[0]


def same_vocabulary(a, b) -> bool:
    """Every id of `a` stands for the same bytes in `b` (specials aside): its ids can be fed to b's model."""
    if a.vocab_size > b.vocab_size:
        return False
    tb = b.token_bytes
    return all(x == tb[i] for i, x in enumerate(a.token_bytes) if x)
