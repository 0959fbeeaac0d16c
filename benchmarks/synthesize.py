"""The synthesize stage's sampling (scorers/teacher.py `draw`: a KV cache, the teacher's full
distribution at every token, its entropy and an inverse-CDF draw) against the teacher's bare forward
over the same tokens (one causal forward of the finished rows, no sampling): the ratio is what
drawing one token at a time costs over reading the rows once.

A random llama teacher in a 4k vocabulary; the two alternate round by round (load from other
processes falls on both alike); each figure is the fastest round.
"""

from __future__ import annotations

import numpy as np
import torch

from .common import alternate, bench_threads, fastest, row

VOCAB = 4096


def run(quick: bool = False) -> list[dict]:
    from entroweight.models import build_model
    from entroweight.scorers.teacher import LlamaIncremental, draw, uniforms

    threads = torch.get_num_threads()
    torch.set_num_threads(bench_threads())
    try:
        d, layers, n_ctx, batch, rounds = (128, 2, 64, 32, 3) if quick else (256, 4, 128, 64, 3)
        torch.manual_seed(0)
        fields = {"vocab_size": VOCAB, "n_ctx": n_ctx, "d_model": d, "n_layers": layers, "n_heads": 4}
        model = build_model("llama", {**fields, "d_ff": 4 * d}).eval()
        L = n_ctx - 1
        context, real = np.zeros((batch, 1), np.int64), np.zeros((batch, 1), bool)
        u = uniforms(list(range(batch)), 0, L)
        ids = torch.randint(0, VOCAB, (batch, n_ctx))

        def sample():
            draw(LlamaIncremental(model), context, real, u, 1.0)

        def forward():
            with torch.inference_mode():
                model(ids)

        sample(), forward()  # warm-up
        times = alternate({"sample": sample, "forward": forward}, rounds)
        tokens = batch * L
        setup = f"d{d}×{layers}, {L} tokens a row, batch {batch}, {torch.get_num_threads()} thread(s), fastest of {rounds}"
        return [
            row(
                "synthesize",
                "sampled tokens/s (vs the teacher's bare forward), cpu",
                tokens / fastest(times["sample"]),
                tokens / fastest(times["forward"]),
                None,
                f"ancestral sampling with a KV cache, entropy and surprisal of every token vs one causal forward of the same rows; {setup}",
            )
        ]
    finally:
        torch.set_num_threads(threads)
