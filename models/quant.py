"""Quantization of the estimator's compressed embedding: noise QAT, post-training casts, amortized bits.

Only one activation matters here: the small embedding between `down` and `up` that an estimator
(or autoencoder) must store per sequence. Training adds uniform noise `U(-q, q)` to it (q = 2^-4:
half the 2^-3 step of e4m3's three mantissa bits near 1), so the decoder learns not to rely on
precision the stored embedding will not have. After training, `quantize` casts it for real and
`evaluate_quantized` reports the loss against the unquantized embedding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Q_EMBEDDING = 2**-4  # noise at the compressed embedding
Q_PRE_DOWN = 2**-2  # noise before `down`: compression shrinks it on the way to the embedding

# post-training formats of the embedding -> bits per stored value
FORMATS = {
    "float32": 32,
    "bfloat16": 16,
    "float16": 16,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
    "int8": 8,  # absmax: plus one float32 scale per sequence (counted by embedding_bits)
}


def uniform_noise(x: torch.Tensor, q: float) -> torch.Tensor:
    """x + U(-q, q), elementwise, in x's dtype."""
    return x + (torch.rand_like(x) * 2 - 1) * q


def quantize(emb: torch.Tensor, fmt: str) -> torch.Tensor:
    """`emb` (B, k) cast to `fmt` and back to its own dtype (what a decoder reading the stored value sees).

    float8 casts saturate at the format's largest finite value (a plain cast would give NaN for
    e4m3fn); int8 is absmax per sequence: scale = max|e| / 127, round(e / scale) in [-127, 127].
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown embedding format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "float32":
        return emb
    if fmt == "int8":
        scale = emb.detach().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
        return (emb / scale).round().clamp(-127, 127) * scale
    dtype = getattr(torch, fmt)
    if fmt.startswith("float8"):
        top = torch.finfo(dtype).max
        emb = emb.clamp(-top, top)
    return emb.to(dtype).to(emb.dtype)


def embedding_bits(embed_dim: int, fmt: str) -> int:
    """Bits to store one sequence's embedding in `fmt`."""
    return embed_dim * FORMATS[fmt] + (32 if fmt == "int8" else 0)


def sequence_nats(logits: torch.Tensor, input_ids: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """Σ CE (nats) per sequence (B,) of the real tokens given their left context, logits (B, T, V).

    Targets are input_ids[:, 1:] that are not `pad_id`. A real token at position 0 (a full window,
    no pad) has no prediction; it is charged log V nats, a uniform code, so every real token is paid.
    """
    B, T, V = logits.shape
    targets = input_ids[:, 1:]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), targets.reshape(-1), reduction="none")
    ce = ce.view(B, T - 1)
    if pad_id is not None:
        ce = ce * (targets != pad_id)
    first = input_ids[:, 0] != pad_id if pad_id is not None else torch.ones_like(input_ids[:, 0], dtype=bool)
    return ce.sum(1) + first * math.log(V)


@torch.no_grad()
def evaluate_quantized(model, batches, pad_id: int | None, formats=tuple(FORMATS)) -> dict:
    """Eval loss and amortized bits per byte of an estimator / autoencoder per embedding format.

    `model` has `encode(ids) -> emb (B, k)`, `decode(ids, emb) -> logits` and `embed_dim`;
    `batches` yields (input_ids (B, T), n_bytes (B,)) with n_bytes the UTF-8 bytes the real tokens
    cover. Per format: `loss` (mean CE in nats over real target tokens, as training reports),
    `delta` (loss minus the float32 embedding's), and the compression view of the write-up:
    `bpb` = (embedding bits + Σ token bits) / Σ bytes, split into `embed_bpb` and `token_bpb`.
    """
    model.eval()
    formats = list(dict.fromkeys(["float32", *formats]))
    nats = dict.fromkeys(formats, 0.0)
    tok_nats = dict.fromkeys(formats, 0.0)
    n_targets = n_bytes_total = n_seqs = 0
    for ids, n_bytes in batches:
        ids = ids.to(next(model.parameters()).device)
        emb = model.encode(ids)
        targets = ids[:, 1:]
        real = (targets != pad_id) if pad_id is not None else torch.ones_like(targets, dtype=bool)
        n_targets += int(real.sum())
        n_bytes_total += int(n_bytes.sum())
        n_seqs += ids.shape[0]
        for fmt in formats:
            logits = model.decode(ids, quantize(emb, fmt))
            seq = sequence_nats(logits, ids, pad_id)
            nats[fmt] += float(seq.sum())
            B, T, V = logits.shape
            ce = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), targets.reshape(-1), reduction="none")
            tok_nats[fmt] += float((ce.view(B, T - 1) * real).sum())
    out = {"sequences": n_seqs, "targets": n_targets, "bytes": n_bytes_total, "embed_dim": model.embed_dim}
    base = tok_nats["float32"] / max(1, n_targets)
    for fmt in formats:
        loss = tok_nats[fmt] / max(1, n_targets)
        embed_bpb = n_seqs * embedding_bits(model.embed_dim, fmt) / max(1, n_bytes_total)
        token_bpb = nats[fmt] / math.log(2) / max(1, n_bytes_total)
        out[fmt] = {
            "loss": loss,
            "delta": loss - base,
            "bits_per_value": FORMATS[fmt],
            "embed_bpb": embed_bpb,
            "token_bpb": token_bpb,
            "bpb": embed_bpb + token_bpb,
        }
    return out
