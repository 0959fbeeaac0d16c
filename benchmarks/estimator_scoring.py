"""Estimator scorers: occlusion vs its bare limit (two decoder forwards + the encoder), grad_input's
cost per token, decomposition's cost per token.

The bare limit is what occlusion cannot avoid: `decode(ids, encode(ids))` and `decode(ids, e_empty)`
(the default baseline: the embedding of an all-pad row, encoded per batch), batched, same dtype,
nothing else. The scorer computes its metrics from hidden states (one head matmul for l1, a D×D
Gram matrix for cosine) instead of two vocabulary-wide logit tensors, so it can beat the bound.
Model: an untrained estimator of the write-up's shape (mixer encoder, llama decoder, token
injection), scaled down for 2 CPU cores; weights do not change the speed, so ids are random over an
8k vocabulary, left-padded to random lengths.
"""

from __future__ import annotations

import tempfile

import numpy as np
import torch

from .common import alternate, fastest, row, timed

TARGET = ">= 0.9"


def _estimator(n_ctx: int, quick: bool):
    from entroweight.models.estimator import EntropyEstimator

    torch.manual_seed(0)
    d = 128 if quick else 256
    cfg = EntropyEstimator.Config(
        vocab_size=8000,
        n_ctx=n_ctx,
        injection="token",
        encoder="mixer",
        decoder="llama",
        encoder_config={"d_model": d, "n_layers": 4},
        decoder_config={"d_model": d, "n_layers": 4, "n_heads": 4},
        noise="none",
    )
    return EntropyEstimator(cfg).eval()


def _data(rows: int, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 8000, size=(rows, n_ctx), dtype=np.int64)
    n_pad = rng.integers(0, n_ctx // 2, size=rows)
    ids[np.arange(n_ctx)[None, :] < n_pad[:, None]] = 0
    return ids, n_pad


def run(quick: bool = False) -> list[dict]:
    from entroweight.models.checkpoint import save_checkpoint
    from entroweight.scorers import make_scorer
    from entroweight.scorers.forward import autocast, resolve_dtype

    n_ctx, rows, batch = (64, 16, 16) if quick else (256, 64, 16)
    repeat = 2 if quick else 3
    model = _estimator(n_ctx, quick)
    ids, n_pad = _data(rows, n_ctx)
    real = int(ids.size - n_pad.sum())
    dtype = resolve_dtype(None, "cpu")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(model, "estimator", tmp, tokenizer_sha256="0" * 64, n_ctx=n_ctx, pad_id=0)
        note = (
            f"estimator mixer→llama d{model.decoder.config.d_model}×4, {dtype}, batch {batch}, {rows}×{n_ctx}"
        )

        def bare():
            with torch.inference_mode(), autocast("cpu", dtype):
                for s in range(0, rows, batch):
                    x = torch.as_tensor(ids[s : s + batch])
                    model.decode(x, model.encode(x))
                    model.decode(x, model.encode(torch.zeros_like(x[:1])).expand(len(x), -1))

        rates = {}  # occlusion tokens/s per metric
        for metric in ("l1", "cosine"):
            scorer = make_scorer("occlusion", checkpoint=tmp, metric=metric, dtype=dtype, batch_size=batch)
            scorer.setup()
            scorer.score(ids[:batch], n_pad[:batch])  # warm-up
            times = alternate({"score": lambda s=scorer: s.score(ids, n_pad).values, "bare": bare}, repeat)
            t_score, t_bare = fastest(times["score"]), fastest(times["bare"])
            rates[metric] = real / t_score
            out.append(
                row(
                    "score",
                    f"occlusion {metric} tokens/s (vs 2 bare decoder forwards)",
                    rates[metric],
                    real / t_bare,
                    TARGET,
                    note,
                )  # fmt: skip
            )

        # grad_input: one backward per position; decomposition: one forward of a whole window per
        # token. A few rows are enough to time them.
        for name, n_rows in (("grad_input", 1 if quick else 4), ("decomposition", 1 if quick else 2)):
            scorer = make_scorer(name, checkpoint=tmp, dtype=dtype, batch_size=n_rows)
            scorer.setup()
            n_real = int(n_rows * n_ctx - n_pad[:n_rows].sum())
            per_tok = timed(lambda s=scorer, k=n_rows: s.score(ids[:k], n_pad[:k]).values) / n_real
            out.append(
                row(
                    "score",
                    f"{name} ms/token",
                    per_tok * 1e3,
                    None,
                    None,
                    f"{n_rows} rows; {per_tok * rates['cosine']:.0f}× occlusion cosine's time per token",
                )  # fmt: skip
            )
    return out
