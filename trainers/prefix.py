"""The byte-prefix table prefix-smooth CE needs, from each token's bytes (`token_bytes`)."""

from __future__ import annotations

import torch

from entroweight.schemas.tokenizer import token_bytes

__all__ = ["prefix_table", "token_bytes"]


def prefix_table(tok_bytes: list[bytes]) -> torch.Tensor:
    """(V, K) int64: row v lists the tokens whose bytes are a proper, non-empty prefix of v's; −1 pads.

    Sparse in spirit (K is the longest prefix chain, a dozen or so), built once per tokenizer.
    """
    by_bytes = {b: i for i, b in enumerate(tok_bytes) if b}
    rows = []
    for b in tok_bytes:
        rows.append([by_bytes[b[:k]] for k in range(1, len(b)) if b[:k] in by_bytes])
    width = max((len(r) for r in rows), default=0) or 1
    table = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            table[i, : len(r)] = torch.tensor(r)
    return table
