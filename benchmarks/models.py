"""Model forward throughput: the masked mixer (flat and multi-headed) vs the llama decoder at equal
d_model and depth, and the entropy estimator's full forward vs its decoder alone (the encoder's cost).

Inference forwards (eval, no_grad) on random token ids; the variants alternate round by round so load
from other processes falls on each alike; each figure is the median round. On CUDA: bf16 autocast and
the write-up's sizes (d512×16, n_ctx 1024) as well.
"""

from __future__ import annotations

import contextlib

import torch

from .common import alternate, bench_threads, median, row

VOCAB = 1024


def _forward(model, ids, device):
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()

    def fn():
        with torch.no_grad(), autocast:
            model(ids)
        if device == "cuda":
            torch.cuda.synchronize()

    return fn


def _tps(models: dict, batch: int, n_ctx: int, rounds: int, device: str) -> dict[str, float]:
    ids = torch.randint(0, VOCAB, (batch, n_ctx), device=device)
    fns = {name: _forward(m.to(device).eval(), ids, device) for name, m in models.items()}
    for fn in fns.values():  # warm-up: allocator, kernels, lazy init
        fn()
    times = alternate(fns, rounds)
    return {name: batch * n_ctx / median(ts) for name, ts in times.items()}


def _models(d: int, layers: int, n_ctx: int, heads: int, enc_d: int, enc_layers: int) -> dict:
    from entroweight.models import build_model

    torch.manual_seed(0)
    base = {"vocab_size": VOCAB, "n_ctx": n_ctx, "d_model": d, "n_layers": layers}
    dec = {"d_model": d, "n_layers": layers}
    est = {"vocab_size": VOCAB, "n_ctx": n_ctx, "injection": "token", "encoder": "mixer", "decoder": "mixer"}
    est |= {"encoder_config": {"d_model": enc_d, "n_layers": enc_layers}, "decoder_config": dec}
    return {
        "llama": build_model("llama", {**base, "n_heads": heads, "d_ff": 4 * d}),
        "mixer": build_model("mixer", base),
        "mixer_heads": build_model("mixer", {**base, "n_heads": heads}),
        "estimator": build_model("estimator", est),
    }


def _rows(tps: dict, setup: str, device: str) -> list[dict]:
    return [
        row(
            "models",
            f"mixer forward tokens/s (vs llama), {device}",
            tps["mixer"],
            tps["llama"],
            None,
            f"flat masked mixer vs llama decoder at equal width/depth; {setup}",
        ),
        row(
            "models",
            f"multi-head mixer forward tokens/s (vs llama), {device}",
            tps["mixer_heads"],
            tps["llama"],
            None,
            f"4-head masked mixer (in/out projections) vs llama; {setup}",
        ),
        row(
            "models",
            f"estimator forward tokens/s (vs its decoder alone), {device}",
            tps["estimator"],
            tps["mixer"],
            ">= 0.5",
            f"encoder (half width, same depth) + token-injection mixer decoder vs the mixer alone; {setup}",
        ),
    ]


def run(quick: bool = False) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(bench_threads())
    try:
        d, layers, n_ctx, batch, rounds = (128, 4, 256, 8, 5) if quick else (256, 8, 512, 8, 5)
        setup = f"d{d}×{layers}, n_ctx {n_ctx}, batch {batch}, {torch.get_num_threads()} thread(s), median of {rounds}"
        rows = _rows(
            _tps(_models(d, layers, n_ctx, 4, d // 2, layers), batch, n_ctx, rounds, "cpu"), setup, "cpu"
        )
        if torch.cuda.is_available():  # the write-up's sizes in bf16
            d, layers, n_ctx, batch = 512, 16, 1024, 16
            ms = _models(d, layers, n_ctx, 4, 256, 16)
            tps = _tps(ms, batch, n_ctx, 5 if quick else 10, "cuda")
            rows += _rows(tps, f"d{d}×{layers}, n_ctx {n_ctx}, batch {batch}, bf16 autocast", "cuda")
        return rows
    finally:
        torch.set_num_threads(threads)
