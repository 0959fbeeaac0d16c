"""occlusion: how much each prediction of an entropy estimator depends on the encoder's embedding.

Two forward passes per row, no gradients (the write-up's `Attr(x) = m(O(x, θd), O(x_o, θd))`):
the decoder with the encoder's embedding (`x = O(x, θe) ⊕ W_wte x`) and with a baseline in its place.
Baselines (`baseline`):

- `empty` (default): the embedding the encoder gives an empty row (all pads), entering where the real
  one does (same position, attention unchanged). Only the information in the embedding differs, so
  an encoder that tells the decoder nothing about the row (a constant embedding) scores exactly 0 in
  every injection × decoder pairing;
- `remove`: the write-up's literal occlusion, `x_o = 0 ⊕ W_wte x`, for a llama decoder with token
  injection also masked from attention (`EntropyEstimator.decode(ids, None)`). That changes the
  sequence's structure (the memory position disappears), and the decoder reacts to the removal
  itself: on the default workflow's estimator, one whose embedding carries no information scores
  about as high as the real one. A zero embedding kept in place is no better (docs/scoring.md): with
  token injection the decoder's RMSNorm scales any nonzero memory position to full size but leaves
  a zero one inert, so a constant embedding still scores high against zero.

Outputs compared are the decoder's **logits**, as in the write-up ("we actually use the logit
activations rather than the embeddings"). Metrics:

- `l1`: Σ_v |logit_v − logit_o,v| per position, then min-max normalised per row over real positions;
- `cosine`: 1 − cos(logits, logits_o) in [0, 2], not normalised.

Both are computed from the hidden states without forming the (B, T, V) logits: the head W is linear
with no bias, so the logit difference is W·(h − h_o) (one head matmul, in chunks), and cosines only
need the D×D Gram matrix WᵀW. Output t is about token t + 1: values are shifted right by one. The
first real token's value comes from the pad before it (our estimators are trained on left-padded
rows); a row with no padding gets the mean of its other values (scorers/base.py).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from .base import ScorerError, fill_first_token
from .estimator_common import CheckpointScorer, hidden_outputs, minmax_rows, read_slots
from .forward import CHUNK_BYTES, autocast, to_device
from .packing import Memo

METRICS = ("l1", "cosine")
BASELINES = ("empty", "remove")
UNITS = {"l1": "l1_minmax", "cosine": "cosine_distance"}  # [0, 1] per row; [0, 2] unnormalised
L1_CHUNK_BYTES = 4 << 20  # on a CPU: logit differences per chunk, counted as fp32 (131 rows at 8k)


class OcclusionScorer(CheckpointScorer):
    name = "occlusion"
    kinds = ("estimator",)

    class Options(CheckpointScorer.Options):
        metric: Literal[METRICS] = Field("l1", description="l1 (min-max per row) or cosine (1 − cos).")
        baseline: Literal[BASELINES] = Field(
            "empty", description="empty (an all-pad row's embedding in its place) or remove (the write-up's)."
        )

    def __init__(self, checkpoint: str | None = None, metric: str = "l1", baseline: str = "empty", **kw: Any):
        super().__init__(checkpoint=checkpoint, **kw)
        if metric not in METRICS:
            raise ScorerError(f"--metric must be one of {', '.join(METRICS)}, not {metric!r}")
        if baseline not in BASELINES:
            raise ScorerError(f"--baseline must be one of {', '.join(BASELINES)}, not {baseline!r}")
        self.metric, self.baseline = metric, baseline

    def config(self) -> dict[str, Any]:
        return {**super().config(), "metric": self.metric, "baseline": self.baseline}

    @classmethod
    def unit_of(cls, options: dict[str, Any]) -> str | None:
        return UNITS.get(options.get("metric", "l1"))

    @property
    def unit(self) -> str:
        return self.unit_of({"metric": self.metric})

    def score_batch(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
        ids, added = self.to_model_width(input_ids, n_pad)
        width = self.packed_width(n_pad, input_ids.shape[1])
        memo = self.memo if self.pack else None
        raw = occlusion_values(
            self._model, ids, self.pad_id, self.metric, self.dtype, self.baseline, width, memo,
            lengths=input_ids.shape[1] - n_pad,
        )  # fmt: skip
        raw = raw[:, added:]
        fill_first_token(raw, n_pad, n_pad > 0)
        # pads: Scorer.score zeroes them after every batch
        return minmax_rows(raw, n_pad) if self.metric == "l1" else raw


def occlusion_values(
    model,
    ids: torch.Tensor,
    pad_id: int,
    metric: str = "l1",
    dtype: str = "fp32",
    baseline: str = "empty",
    width: int | None = None,
    memo: Memo | None = None,
    lengths: np.ndarray | None = None,
) -> np.ndarray:
    """(B, T) ids -> (B, T) raw float32 occlusion values, already shifted (value t about token t; value 0
    is 0): the unnormalised L1 distance or 1 − cos between the logits with the embedding and with the
    baseline (`empty`: the embedding of a row of `pad_id`; `remove`: none, see the module doc).
    Values are computed for the last `width` columns only (the rest: 0), the columns before them being
    `pad_id`. With `memo`, what does not depend on the row is computed once (scorers/packing.py): the
    encoder and the baseline's decoder read the pad columns from a prefix; the decoder with the row's
    own embedding reads its pads whole (their states depend on that embedding). With `lengths` (each
    row's real tokens, on the host), values are computed for those tokens alone (the rest: 0): the
    head and the metric never run over a pad's prediction."""
    if metric not in METRICS:  # before the forward passes, not after
        raise ScorerError(f"metric must be one of {', '.join(METRICS)}, not {metric!r}")
    if baseline not in BASELINES:
        raise ScorerError(f"baseline must be one of {', '.join(BASELINES)}, not {baseline!r}")
    device = ids.device.type
    B, T = ids.shape
    W = min(width or T, T)
    with torch.inference_mode(), autocast(device, dtype), hidden_outputs(model) as head:
        if memo is None:
            e = model.encode(ids)
            empty = torch.full_like(ids[:1], pad_id)
            base = model.encode(empty) if baseline == "empty" else None
            h_o = model.decode(ids, None if base is None else base.expand(B, -1), last=W)[:, :-1]
        else:
            pre = memo.get(("encoder", pad_id), lambda: model.encoder_prefix(pad_id))
            e = model.encode(ids[:, T - W :], prefix=pre)
            base = memo.get(("empty", pad_id), lambda: model.encode(torch.full_like(ids[:1], pad_id)))
            base = base if baseline == "empty" else None
            dec = memo.get(("decoder", pad_id, baseline), lambda: model.decoder_prefix(pad_id, base))
            emb = None if base is None else base.expand(B, -1)
            h_o = model.decode(ids[:, T - W :], emb, prefix=dec)[:, :-1]
        h = model.decode(ids, e, last=W)[:, :-1]  # the pads before the window: keys alone
    D = h.shape[-1]
    read = None
    with torch.inference_mode():
        h, h_o = h.reshape(-1, D), h_o.reshape(-1, D)
        if lengths is not None:  # the slots whose value is about a real token (each row's last ones)
            read = to_device(read_slots(np.asarray(lengths), W - 1), h.device)
            h, h_o = h.index_select(0, read), h_o.index_select(0, read)
        if metric == "l1":
            # the head in the compute dtype (its weights are stored in it), the norm summed in fp32
            Wt = head.weight
            diff = (h.float() - h_o.float()).to(Wt.dtype)
            # on a CPU cache-sized chunks, on an accelerator chunked_ce's (65 rows a matmul there left
            # the H100 launch-bound)
            budget = L1_CHUNK_BYTES if diff.device.type == "cpu" else CHUNK_BYTES
            rows = max(1, budget // (4 * Wt.shape[0]))
            vals = torch.cat([l1_rows(diff[s : s + rows] @ Wt.T) for s in range(0, len(diff), rows)])
        else:  # cosine
            Wf = head.weight.float()
            G = Wf.T @ Wf  # logits·logits' = h Wᵀ W h'
            a, b = h.float(), h_o.float()
            aG = a @ G
            ab, aa, bb = (aG * b).sum(-1), (aG * a).sum(-1), ((b @ G) * b).sum(-1)
            cos = ab / (aa.clamp_min(1e-30) * bb.clamp_min(1e-30)).sqrt()
            vals = (1.0 - cos).clamp(0.0, 2.0)
        if read is not None:
            vals = torch.zeros(B * (W - 1), dtype=vals.dtype, device=vals.device).index_copy_(0, read, vals)
    out = np.zeros((B, T), dtype=np.float32)
    out[:, T - W + 1 :] = vals.reshape(B, W - 1).cpu().numpy()
    if base is not None:
        # A row whose embedding is the baseline's tells the decoder nothing: its value is 0 by
        # definition. The two decoders' paths differ (the baseline reads its pads from a prefix), and
        # per-row min-max would blow their last-bit differences up to [0, 1].
        out[(e == base).all(dim=-1).cpu().numpy()] = 0.0
    return out


def l1_rows(x: torch.Tensor) -> torch.Tensor:
    """Σ_v |x_v| of each row, summed in fp32 whatever x's dtype; x, a temporary, may be overwritten.
    On a CPU |x| in place (in x's dtype: exact; 0.9x the time of a new |x|) and then the fp32 sum:
    `vector_norm(..., dtype=float32)` first casts the whole chunk to fp32 there, 1.3-1.5x the time
    (8k logits, 4 MiB chunks, bf16 and fp32); elsewhere that one fused reduction, with no |x|
    temporary."""
    if x.device.type == "cpu":
        return x.abs_().sum(-1, dtype=torch.float32)
    return torch.linalg.vector_norm(x, ord=1, dim=-1, dtype=torch.float32)
