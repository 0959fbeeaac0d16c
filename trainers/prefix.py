"""Bytes of each token of a `tokenizers` JSON file, and the byte-prefix table prefix-smooth CE needs.

Trainers may not import transforms/, so the byte-level (GPT-2) character map is repeated here; it is
a fixed table of the format, not logic that could drift.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer


def _unicode_to_byte() -> dict[str, int]:
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(tokenizer_json: str | Path) -> list[bytes]:
    """The raw bytes each token id stands for; b"" for special tokens."""
    tok = Tokenizer.from_file(str(tokenizer_json))
    spec = json.loads(Path(tokenizer_json).read_text())
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
    inverse = _unicode_to_byte() if byte_level else None
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    out = [b""] * tok.get_vocab_size(with_added_tokens=True)
    for piece, idx in tok.get_vocab(with_added_tokens=True).items():
        if piece in specials:
            continue
        if inverse is not None and all(ch in inverse for ch in piece):
            out[idx] = bytes(inverse[ch] for ch in piece)
        elif piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # byte fallback
            out[idx] = bytes([int(piece[3:5], 16)])
        else:  # sentencepiece-style pieces
            out[idx] = piece.replace("\u2581", " ").encode("utf-8")
    return out


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
