"""What the scorers that read our own checkpoints share: loading, tokenizer check, model width, windows.

Our models read no attention mask: they were trained on full left-padded rows of n_ctx tokens and
see the pads. So these scorers never cut padding (`cut_padding = False`) and give the model rows of
exactly the width it was trained on (left-padded further with the checkpoint's pad id when the data
is narrower; refused when it is wider, except by the window scorers, which slide).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from pydantic import Field

from entroweight.models.checkpoint import a_model_of
from entroweight.models.packing import after_prefix

from .base import ModelOptions, Scorer, ScorerError
from .forward import autocast, check_dtype, chunked_ce, resolve_dtype, to_compute_dtype, to_device
from .packing import Memo, pad_prefix

# fp32 logits per forward sub-batch (rows × width × vocabulary × 4 bytes)
LOGIT_BYTES = 256 << 20


def checkpoint_info(checkpoint: str) -> dict:
    from entroweight.models.checkpoint import read_checkpoint_config

    return read_checkpoint_config(checkpoint)


def checkpoint_config(checkpoint: str, ckpt_config: dict) -> dict[str, Any]:
    """What identifies one of our checkpoints in a stage config (beside the scorer's name and dtype)."""
    return {"checkpoint": Path(checkpoint).name, "checkpoint_sha256": ckpt_config.get("weights_sha256")}


def check_tokenizer(ckpt_config: dict, checkpoint: str, sha256: str) -> None:
    want = ckpt_config.get("tokenizer_sha256")
    if want and want != sha256:
        raise ScorerError(
            f"the checkpoint {checkpoint} was trained on tokenizer {want[:12]}…, the data is tokenized "
            f"with {sha256[:12]}…: retokenize the data with the checkpoint's tokenizer"
        )


def checkpoint_vocab(ckpt_config: dict) -> int | None:
    """The embedding rows of one of our checkpoints (its model config; the data's as recorded otherwise)."""
    size = (ckpt_config.get("model") or {}).get("vocab_size") or ckpt_config.get("vocab_size")
    return int(size) if size else None


def model_n_ctx(ckpt_config: dict) -> int:
    return int(ckpt_config.get("n_ctx") or ckpt_config["model"]["n_ctx"])


def model_pad_id(ckpt_config: dict, checkpoint: str) -> int:
    pad = ckpt_config.get("pad_id")
    if pad is None:
        raise ScorerError(
            f"the checkpoint {checkpoint} records no pad_id (config.json): these scorers pad windows the "
            "way the model was trained; retrain with `entroweight train` on left-padded data, or add "
            '"pad_id" to its config.json'
        )
    return int(pad)


class CheckpointScorer(Scorer):
    """A scorer over one of our checkpoints (`checkpoint=DIR`); `kinds` limits the model kinds it takes."""

    kinds: tuple[str, ...] | None = None
    cut_padding = False  # the models attend to the left padding they were trained on
    _heavy = (*Scorer._heavy, "_memo")

    class Options(ModelOptions):
        checkpoint: str = Field(description="One of our checkpoints (a workflow's checkpoint_from).")

    def __init__(
        self,
        checkpoint: str | None = None,
        dtype: str | None = None,
        batch_size: int = 16,
        device: str = "cpu",
        **options: Any,
    ):
        super().__init__(batch_size=batch_size, device=device, **options)
        if checkpoint is None:
            raise ScorerError(f"the {self.name} scorer needs --checkpoint (one of our trained models)")
        self.checkpoint = str(checkpoint)
        # what was asked ('auto' included) is the config; the worker resolves it in setup()
        self.dtype_option, self.dtype = check_dtype(dtype), None
        self._ckpt_config = checkpoint_info(self.checkpoint)
        if problem := self.kind_problem(self._ckpt_config.get("kind")):
            raise ScorerError(f"{checkpoint} holds {problem}")
        self.n_ctx = model_n_ctx(self._ckpt_config)
        self.pad_id = model_pad_id(self._ckpt_config, self.checkpoint)
        self._model = None

    @classmethod
    def kind_problem(cls, kind: str) -> str | None:
        if cls.kinds is None or kind in cls.kinds:
            return None
        return (
            f"{a_model_of(kind)}; the {cls.name} scorer reads an embedding-augmented model "
            f"({' or '.join(cls.kinds)}): train one with `entroweight train DATA --model estimator`"
        )

    def config(self) -> dict[str, Any]:
        return {
            "scorer": self.name,
            **checkpoint_config(self.checkpoint, self._ckpt_config),
            "dtype": self.dtype_option,
        }

    def check_data_tokenizer(self, sha256: str, data_tokenizer=None) -> None:
        check_tokenizer(self._ckpt_config, self.checkpoint, sha256)

    def vocab_size(self) -> int | None:
        return checkpoint_vocab(self._ckpt_config)

    def max_row_tokens(self) -> int | None:
        return self.n_ctx  # every row is run at the model's width (to_model_width)

    def batch_width(self, longest: int, T: int) -> int:
        # every row is run at the model's width, however short (to_model_width)
        return max(self.n_ctx, T)

    def setup(self, data_tokenizer=None) -> None:
        if self._model is None:
            self.dtype = resolve_dtype(self.dtype_option, self.device)  # here, where the model runs
            self._model = load_model(self.checkpoint, self.device, self.options.get("allow_pickle", False))
            to_compute_dtype(self._model, self.dtype)

    @property
    def memo(self) -> Memo:
        """What the model computes once for every batch (pad prefixes; not pickled: rebuilt on a worker)."""
        if getattr(self, "_memo", None) is None:
            self._memo = Memo()
        return self._memo

    def packed_width(self, n_pad: np.ndarray, T: int) -> int:
        """Columns of each model-width row a packed forward computes: its real tokens and the pad just
        before them (that pad's output predicts the first real token); the model's width unpacked."""
        if not self.pack:
            return self.n_ctx
        return min(self.n_ctx, int((T - n_pad).max(initial=0)) + 1)

    def to_model_width(self, input_ids: np.ndarray, n_pad: np.ndarray) -> tuple[torch.Tensor, int]:
        """(B, T) left-padded ids -> (B, n_ctx) on the device, the checkpoint's pad id on the left; and
        the number of columns added (T > n_ctx is refused: the encoder must read the whole row)."""
        B, T = input_ids.shape
        if T > self.n_ctx:
            raise ScorerError(
                f"rows of {T} tokens are longer than the checkpoint's n_ctx {self.n_ctx}: tokenize with "
                f"--n-ctx {self.n_ctx} or train an estimator of a longer context"
            )
        ids = np.full((B, self.n_ctx), self.pad_id, dtype=np.int64)
        real = np.arange(T)[None, :] >= n_pad[:, None]
        ids[:, self.n_ctx - T :] = np.where(real, input_ids, self.pad_id)
        return to_device(ids, self.device), self.n_ctx - T


def load_model(checkpoint: str, device: str, allow_pickle: bool = False) -> nn.Module:
    from entroweight.models.checkpoint import load_checkpoint

    model, _ = load_checkpoint(checkpoint, map_location=device, allow_pickle=allow_pickle)
    return model.eval()


@contextlib.contextmanager
def hidden_outputs(model: nn.Module):
    """Inside, `model.decode` returns the decoder's final hidden states instead of logits (the head is
    swapped for the identity), so the vocabulary-wide logits are formed later, in chunks."""
    dec = model.decoder
    head = dec.lm_head
    if not isinstance(head, nn.Linear):
        raise ScorerError(f"the decoder's head is a {type(head).__name__}, not a linear layer")
    dec.lm_head = nn.Identity()
    try:
        yield head
    finally:
        dec.lm_head = head


def minmax_rows(values: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
    """Per-row min-max over real positions (the write-up's N_minmax); constant rows give 0; pads 0."""
    from entroweight.transforms.weigh import WeighConfig, normalize

    return normalize(values, n_pad, WeighConfig())


# -- windows (decomposition, two_model)


def windows(rows: list[np.ndarray], ends: list[int], keep: int, width: int, pad_id: int) -> np.ndarray:
    """For row r and end j: the last `keep` real tokens of rows[r][: j + 1], left-padded to `width`.
    Returns (N, width) int64 windows."""
    out = np.full((len(ends), width), pad_id, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    i = 0
    while i < len(ends):  # one strided view per run of windows over the same row
        row, n = rows[i], 1
        while i + n < len(ends) and rows[i + n] is row:
            n += 1
        # a window ending at j is padded[j + 1 : j + 1 + keep], `keep` pads before the row
        padded = np.concatenate([np.full(keep, pad_id, dtype=np.int64), np.asarray(row, dtype=np.int64)])
        view = np.lib.stride_tricks.sliding_window_view(padded, keep)
        out[i : i + n, width - keep :] = view[ends[i : i + n] + 1]
        i += n
    return out


def window_loss_sums(
    model: nn.Module,
    wins: np.ndarray,
    n_targets: np.ndarray,
    device: str,
    dtype: str,
    batch_tokens: int | None = None,
    pad_id: int | None = None,
    memo: Memo | None = None,
) -> np.ndarray:
    """Σ per-token CE (nats) over the last `n_targets[i]` tokens of window i, each predicted by the
    position before it under the window's full forward. (N,) float64. Identical windows run once, in
    sub-batches of at most `batch_tokens` positions; the vocabulary-wide logits are formed from the
    hidden states in chunks (`chunked_ce`), so a sub-batch is as wide as the budget allows, not as a
    few chunks of logits allow (on an accelerator 8 windows a forward left it launch-bound). With `memo`
    and a model that reads a pad prefix (llama, mixer: not an estimator, whose pads depend on the
    window's embedding), a window's leading `pad_id` columns are read from a prefix computed once, and
    each sub-batch computes the columns of its widest window's other tokens (and the pad before them)."""
    if len(wins) == 0:
        return np.zeros(0)
    uniq, inverse = np.unique(wins, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    N, W = uniq.shape
    prefixed = memo is not None and pad_id is not None and hasattr(model, "prefix_of")
    widths = np.full(N, W, dtype=np.int64)
    if prefixed:  # leading pads are the shared prefix; keep the one before the first other token
        lead = np.argmax(uniq != pad_id, axis=1)
        lead[(uniq == pad_id).all(axis=1)] = W
        widths = np.minimum(W - lead + 1, W)
        by_width = np.argsort(-widths, kind="stable")  # widest first: each sub-batch as wide as its first
        uniq, widths = uniq[by_width], widths[by_width]
        inverse = np.argsort(by_width)[inverse]
    need = np.zeros(N, dtype=np.int64)  # targets any request reads from each unique window
    np.maximum.at(need, inverse, n_targets)
    split = _has_hidden(model)  # hidden states, then the head in chunks
    per_logits = max(1, LOGIT_BYTES // (4 * model_vocab(model)))
    # positions per sub-batch: the budget (without one, as many as one chunk of logits has rows);
    # a model whose logits come whole is held to the logits' bytes too
    tokens = (batch_tokens or per_logits) if split else min(per_logits, batch_tokens or per_logits)
    bounds, s = [0], 0
    while s < N:
        w = int(widths[s])
        s += max(1, tokens // w)
        bounds.append(min(s, N))
    order = np.argsort(inverse, kind="stable")  # requests grouped by the sub-batch of their window
    first = np.searchsorted(inverse[order], bounds)
    x_all = to_device(uniq, device)
    found, reqs = [], []
    with torch.inference_mode(), autocast(device, dtype):
        for c, (s, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            w = int(widths[s])
            x = x_all[s:end, W - w :]
            layout = (
                after_prefix(pad_prefix(model, pad_id, memo), W - w, w, device)
                if prefixed and w < W
                else None
            )
            h, head = _hidden(model, x, layout)
            # the head and CE only where a target is read: window u's last need[u] predictions (in a
            # window with padding, its pad columns predict pads no request reads: about half the
            # columns of decomposition's windows); the slots picked on the host, so no host sync
            read = to_device(read_slots(need[s:end], w - 1), device)
            h = h[:, :-1].reshape(-1, h.shape[-1]).index_select(0, read)
            targets = x[:, 1:].reshape(-1).index_select(0, read)
            # ce[u, p]: CE of column p + 1 where it is read, else 0; an extra zero column, so that
            # "the last 0 targets" sum to 0
            ce = torch.zeros(len(x), w, dtype=torch.float64, device=device)
            ce[:, :-1] = (
                ce.new_zeros(len(x) * (w - 1))
                .index_copy_(0, read, chunked_ce(h, targets, head).double())
                .view(len(x), w - 1)
            )
            suffix = ce.flip(1).cumsum(1).flip(1)  # suffix[u, p] = Σ_{q ≥ p} ce[u, q]
            req = order[first[c] : first[c + 1]]
            at = to_device(np.stack([inverse[req] - s, w - 1 - n_targets[req]]), device)
            found.append(suffix[at[0], at[1]])
            reqs.append(req)
    sums = np.zeros(len(wins))
    sums[np.concatenate(reqs)] = torch.cat(found).cpu().numpy()  # the batch's one host sync
    return sums


def read_slots(need: np.ndarray, width: int) -> np.ndarray:
    """Flat indices into (len(need), width) of each row u's last min(need[u], width) slots, in order."""
    n = np.minimum(need, width)
    starts = np.arange(len(n)) * width + width - n
    ends = np.cumsum(n)
    return np.arange(int(ends[-1]) if len(n) else 0) + np.repeat(starts - (ends - n), n)


def _has_hidden(model: nn.Module) -> bool:
    """Whether `_hidden` gives the model's hidden states (a llama, mixer or estimator), not its logits."""
    return hasattr(model, "forward_hidden") or hasattr(model, "decoder")


def _hidden(model: nn.Module, x: torch.Tensor, layout) -> tuple[torch.Tensor, nn.Module | None]:
    """(states, head) of the windows `x`: a llama's or mixer's final hidden states (read after the
    shared prefix of `layout`) and its output head; an estimator's decoder states (each window with
    its own embedding) and the decoder's head; any other model's logits and no head."""
    if not _has_hidden(model):
        return model(x), None
    if hasattr(model, "forward_hidden"):
        return model.forward_hidden(model.embed(x), layout=layout), model.lm_head
    with hidden_outputs(model) as head:
        return model(x), head


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
    batch_tokens: int | None = None,
    memo: Memo | None = None,
) -> np.ndarray:
    """(B, T) left-padded ids -> (B, T) float32, by the chain rule H(t_i | c) = H(c, t_i) − H(c) with
    c = the n_long − 1 tokens before i: value i = L_long(window of the last n_long tokens ending at i,
    width n_long) − L_short(the same window without t_i, width n_short), each L summing CE over the
    same targets but t_i: every token of the window that has a position before it in the long window
    (in a full window the first token has none: it is context in both, never a target). All windows
    of the batch run together (sub-batched by `batch_tokens` and memory; with `memo`, the windows'
    leading pads read from a prefix where the model allows, see `window_loss_sums`); pads 0."""
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
    w_long = windows(rows, ends, n_long, n_long, pad_id)
    w_short = windows(rows, [j - 1 for j in ends], n_long - 1, n_short, pad_id)
    t_long = np.minimum(np.array(ends) + 1, n_long - 1)  # a full window's first token is not a target
    t_short = t_long - 1  # the same targets but t_i
    if short is long and n_short == n_long:
        # one model: run the union of windows once (the shifted window of i is usually the window of i − 1)
        both = np.concatenate([w_long, w_short]), np.concatenate([t_long, t_short])
        sums = window_loss_sums(long, *both, device, dtype, batch_tokens, pad_id, memo)
        diff = sums[: len(rows)] - sums[len(rows) :]
    else:
        diff = window_loss_sums(
            long, w_long, t_long, device, dtype, batch_tokens, pad_id, memo
        ) - window_loss_sums(short, w_short, t_short, device, dtype, batch_tokens, pad_id, memo)
    r_idx, c_idx = np.array(where).T
    out[r_idx, c_idx] = diff
    return out


def model_vocab(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "vocab_size", 0) or 8192)
