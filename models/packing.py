"""Layouts for scoring: where the tokens of one forward sit, so that no pad is computed twice.

A forward computes an (N, S) grid of slots. Scoring lays rows of different lengths into it two ways,
each exact (the values equal those of one row per forward, its padding included):

- **packed** (models whose positions restart at each row's first token: HF models, our `mask_pads`
  llama): several rows share one sequence, each attending to itself only (block-diagonal causal
  attention) with its positions restarting at 0. `segments` (N, S) names each slot's row (-1: fill);
  `positions` (N, S) its RoPE position.
- **prefix** (the write-up's models, which attend to the left padding they were trained on): rows cut
  to their last S columns, which start at position `offset` for every row, and read the keys of the
  pad columns before them from a `prefix` computed once per model (`pad_prefix`): in a causal model
  the states of a run of pads depend on nothing but the pads, so they are the same in every row.

Attention runs through SDPA with a boolean mask, or FlexAttention's block mask on CUDA (`BlockMask`),
which skips the blocks a document mask leaves out; on a CPU SDPA's kernel costs the same with a mask
as causal when the sequence is as wide as a row (docs/scoring.md, "Packing").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class Layout:
    """How the (N, S) slots of a forward attend and where they sit.

    positions: (N, S) RoPE position of each slot; None: `offset`, offset + 1, ... for every row.
    mask: None (causal), a bool tensor broadcastable to (N, 1, S, prefix + S) (True: attend), a
      FlexAttention BlockMask, or `Runs` (rows packed in sequences, one causal SDPA each).
    prefix: per layer, what the layer reads of the `offset` shared positions before column 0 (a
      model's `pad_prefix(...)` cut by `Layout.cut`); None: nothing before column 0.
    """

    positions: torch.Tensor | None = None
    offset: int = 0
    mask: Any = None
    prefix: list | None = None


def block_causal(segments: torch.Tensor) -> torch.Tensor:
    """(N, S) segment ids -> (N, 1, S, S) bool: a slot sees the slots of its own segment up to itself.
    A fill slot (-1) sees itself only (never a NaN row in the softmax)."""
    S = segments.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    return (same & causal)[:, None]


@dataclass(frozen=True)
class Runs:
    """Block-diagonal causal attention given by its runs, for a CPU: each (sequence, first slot, end)
    a row of a packed sequence, which attends causally within itself; fill (outside every run) reads
    as 0. `attend` runs one causal SDPA per run: the rows' triangles alone, where SDPA under a bool
    mask computes every score of the sequence's square (on a CPU, 8 sequences of 512 holding 19
    rows: 8.4 ms against 14.4 ms a layer, and 11.8 ms for plain causal attention)."""

    runs: tuple[tuple[int, int, int], ...]


def flex_block_causal(segments: torch.Tensor):
    """The same as `block_causal`, as a FlexAttention BlockMask (blocks outside every segment skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, k):
        return (segments[b, q] == segments[b, k]) & (k <= q)

    N, S = segments.shape
    return create_block_mask(mask_mod, N, None, S, S, device=segments.device)


def prefix_causal(width: int, offset: int, device) -> torch.Tensor | None:
    """(width, offset + width) bool: every slot sees the whole shared prefix, then causally; None when
    there is no prefix (plain causal attention: SDPA's fused kernel)."""
    if offset == 0:
        return None
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(width, offset, dtype=torch.bool, device=device), causal], dim=1)


def check_last(last: int | None, width: int) -> None:
    """A forward's `last` (the states of its last columns alone) names 1..width columns."""
    if last is not None and not 1 <= last <= width:
        raise ValueError(f"last={last}: a forward of {width} columns has 1 to {width} last columns")


def last_queries(mask, n: int, keys: int, device) -> torch.Tensor | None:
    """`mask` (see `Layout.mask`; a bool tensor or None) for the last `n` query slots alone over
    `keys` keys: causal (None) becomes the bottom-right causal mask those queries need."""
    if mask is None:
        return prefix_causal(n, keys - n, device)
    return mask[..., -n:, :]


def flex_available(device: torch.device | str) -> bool:
    """FlexAttention where it compiles to a fused kernel (CUDA); elsewhere SDPA with a bool mask."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


_compiled_flex = None


def attend(q, k, v, mask, dropout_p: float = 0.0):
    """Attention of q (B, h, S, d) over k, v (B, h, K, d) under `mask` (see `Layout.mask`)."""
    if isinstance(mask, Runs):
        out = torch.zeros_like(q)
        for n, a, b in mask.runs:
            out[n, :, a:b] = F.scaled_dot_product_attention(
                q[n, :, a:b], k[n, :, a:b], v[n, :, a:b], is_causal=True, dropout_p=dropout_p
            )
        return out
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout_p
        )
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cuda":  # eager flex materialises every score: compile it once per process
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        return _compiled_flex(q, k, v, block_mask=mask)
    return flex_attention(q, k, v, block_mask=mask)


def rope_at(cos: torch.Tensor, sin: torch.Tensor, layout: Layout | None, width: int):
    """The RoPE tables (.., S, head_dim) for the slots of `layout` (None: positions 0..width-1)."""
    if layout is None:
        return cos[:width], sin[:width]
    if layout.positions is None:
        return cos[layout.offset : layout.offset + width], sin[layout.offset : layout.offset + width]
    return cos[layout.positions][:, None], sin[layout.positions][:, None]


def cut_prefix(prefix: list, n: int) -> list:
    """A model's `prefix_of(...)` cut to its first `n` positions (every entry is cut along dim 2)."""
    return [tuple(t[:, :, :n] for t in entry) for entry in prefix]


def after_prefix(prefix: list, offset: int, width: int, device) -> Layout:
    """Rows of `width` columns at positions offset..offset+width-1, each reading the first `offset`
    positions of `prefix` before its own (the pad prefix of a model that attends to its padding)."""
    cut = cut_prefix(prefix, offset) if offset else None
    return Layout(offset=offset, mask=prefix_causal(width, offset, device), prefix=cut)
