"""Laying rows out for a forward without computing pads (the attention is models/packing.py's).

- `pack_rows`: several rows in one sequence of `width` slots, positions restarting per row: for
  models whose positions restart at each row's first token (HF, our `mask_pads` llama). Rows are
  grouped by `base.pack_groups`, as the planner (`base.plan_batches`) grouped them, so a batch
  computes the slots its budget counted.
- `Memo`, `pad_prefix`, `shared_pad`: for models that attend to their left padding (the write-up's),
  the states of a run of pads, computed once per pad id and read by every row cut to the batch's
  widest row. (Packing those rows after the shared prefix, each reading its own pads through a block
  mask, was measured and removed: 0.75 against 0.84 of the packed limit on a CPU, 0.26 against 0.52
  on an H100 in bf16; docs/scoring.md, "Packing".)

Values equal those of one row per forward (tests/test_packing.py, every scorer of the registry).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from entroweight.models.packing import Layout, Runs, block_causal, flex_available, flex_block_causal

from .base import pack_groups
from .forward import to_device


@dataclass
class Packed:
    """Rows packed into (N, S) slots: `ids`, `positions` (within the row), `segments` (the row's index
    in the list packed; -1 on fill), `starts` (per row: its sequence and first slot)."""

    ids: np.ndarray
    positions: np.ndarray
    segments: np.ndarray
    starts: list[tuple[int, int]]

    @property
    def one_row_each(self) -> bool:
        """Whether each sequence holds one row, from its first slot (fill after it): plain causal
        attention at positions 0, 1, ... gives those rows' values. A shard's longest rows are packed
        first (`pack_groups`), so its full rows make batches of their own: on long-document data most
        of the tokens."""
        return bool(np.all((self.segments == self.segments[:, :1]) | (self.segments < 0)))

    def layout(self, device: str) -> Layout | None:
        """The layout a model reads these slots with: block-diagonal causal attention (FlexAttention's
        block mask on CUDA; on a CPU one causal SDPA per row, `Runs`; SDPA with a bool mask
        elsewhere), positions restarting per row; None (plain causal attention: SDPA's fused causal
        kernel, no mask built) when each sequence is one row."""
        if self.one_row_each:
            return None
        if torch.device(device).type == "cpu":
            mask = block_runs(self.segments)
        else:
            seg = to_device(self.segments, device)
            mask = flex_block_causal(seg) if flex_available(device) else block_causal(seg)
        return Layout(positions=to_device(self.positions, device), mask=mask)

    def rows(self, values: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
        """Per row, the values of its slots ((N, S) -> one array per row)."""
        return [values[n, s : s + m] for (n, s), m in zip(self.starts, lengths, strict=True)]


def block_runs(segments: np.ndarray) -> Runs:
    """(N, S) segment ids on the host (-1: fill) -> the `Runs` of `block_causal`'s attention (models/packing.py)."""
    runs = []
    for n, row in enumerate(np.asarray(segments)):
        edges = np.flatnonzero(np.diff(row)) + 1
        for a, b in zip(np.r_[0, edges], np.r_[edges, len(row)], strict=True):
            if row[a] >= 0:
                runs.append((n, int(a), int(b)))
    return Runs(tuple(runs))


def pack_rows(rows: list[np.ndarray], width: int) -> Packed:
    """`rows` (1-D id arrays, none wider than `width`) into sequences of `width` slots, grouped by
    `pack_groups`. Fill slots hold id 0 and positions counting from 0 (a segment of their own: an HF
    model that infers segments from `position_ids` sees them as one)."""
    starts: list[tuple[int, int]] = [(0, 0)] * len(rows)
    used: list[int] = []
    for n, group in enumerate(pack_groups([len(r) for r in rows], width)):
        used.append(0)
        for r in group:
            starts[r] = (n, used[n])
            used[n] += len(rows[r])
    N = max(len(used), 1)
    ids = np.zeros((N, width), dtype=np.int64)
    positions = np.tile(np.arange(width, dtype=np.int64), (N, 1))
    segments = np.full((N, width), -1, dtype=np.int64)
    for r, (n, s) in enumerate(starts):
        m = len(rows[r])
        ids[n, s : s + m] = rows[r]
        positions[n, s : s + m] = np.arange(m)
        segments[n, s : s + m] = r
    for n, u in enumerate(used):  # fill restarts at 0: its own segment by position too
        positions[n, u:] = np.arange(width - u)
    return Packed(ids, positions, segments, starts)


class Memo:
    """What a model computes once and every batch reads (a pad prefix, the empty row's embedding), by
    key, built on first use where the model runs: under the caller's autocast, so it has the dtype
    the rows are computed in."""

    def __init__(self):
        self.cache: dict = {}

    def get(self, key, build: Callable[[], object]):
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]


def shared_pad(ids: np.ndarray, columns: int) -> int | None:
    """The one id that fills the first `columns` columns of every row (the rows' shared pad run), or
    None when they hold anything else (such rows are scored whole). With no columns: -1."""
    if columns == 0:
        return -1
    head = ids[:, :columns]
    pad = int(head.flat[0])
    return pad if bool((head == pad).all()) else None


def pad_prefix(model, pad_id: int, memo: Memo) -> list:
    """A causal model's prefix (`prefix_of`) over a row of `pad_id` as wide as it reads, once."""

    def build():
        pads = torch.full((1, model.config.n_ctx), pad_id, device=model.embed_tokens.weight.device)
        return model.prefix_of(model.embed(pads))

    return memo.get(("pad_prefix", id(model), pad_id), build)
