"""Trainer throughput: weighted_ce vs ce through the same loop, the loop vs a bare torch step, and the
data loader alone vs the training step (the loader must not be the bottleneck). On CUDA also the
reference model (d512×16, n_ctx 1024) in bf16: tokens/s and MFU.

Rounds interleave the variants and keep each one's best, so load from other processes on a shared
machine hurts all variants alike.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from .common import C4, bench_tokenizer, c4_texts, row, timed, write_jsonl_gz

N_CTX = 128
MODEL = {"d_model": 128, "n_layers": 4, "n_heads": 4, "d_ff": 384}
REFERENCE = {"d_model": 512, "n_layers": 16, "n_heads": 4, "d_ff": 2048, "n_ctx": 1024}


def _data(work: Path, n_docs: int | None) -> tuple[Path, Path]:
    """The shared 1k BPE, the C4 sample (its first n_docs) tokenized (n_ctx 128), plus random float16
    weights."""
    from entroweight.pipelines import run_stage
    from entroweight.pipelines.tokenize import TokenizeStage

    tok = bench_tokenizer(1024, bool(n_docs))
    source = C4
    if n_docs:
        source = work / "c4.jsonl.gz"
        write_jsonl_gz(source, c4_texts()[:n_docs])
    run_stage(
        TokenizeStage([str(source)], str(tok), n_ctx=N_CTX, shard_docs=250), work / "tokens", progress=False
    )
    weighted = work / "weighted"
    weighted.mkdir()
    rng = np.random.default_rng(0)
    for f in sorted((work / "tokens").glob("*.parquet")):
        t = pq.read_table(f)
        ids = pc.list_flatten(t.column("input_ids")).to_numpy().reshape(t.num_rows, -1)
        w = rng.random(ids.shape).astype(np.float16) * (ids != 0)
        t = t.append_column("weight", pa.array(list(w), pa.list_(pa.float16())))
        pq.write_table(t.replace_schema_metadata(pq.read_schema(f).metadata), weighted / f.name)
    return tok, weighted


def _train_tps(data: Path, out: Path, loss: str, steps: int, batch: int, model=MODEL, device="cpu") -> float:
    """Steady-state tokens/s of the real training loop: median over its metrics rows after the first."""
    from entroweight.trainers import TrainConfig, train

    shutil.rmtree(out, ignore_errors=True)
    log_every = max(1, steps // 4)
    train(
        TrainConfig(
            data=str(data),
            out=str(out),
            model_config=model,
            loss=loss,
            steps=steps,
            batch_size=batch,
            lr=1e-3,
            log_every=log_every,
            device=device,
            quiet=True,
        )
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # positions per second, pads included, as the bare step counts them (the metrics' tokens_per_s
    # counts real tokens): between consecutive log rows
    rates = [
        (b["tokens"] - a["tokens"]) / (b["elapsed_s"] - a["elapsed_s"]) for a, b in itertools.pairwise(rows)
    ]
    return float(np.median(rates or [rows[-1]["tokens"] / rows[-1]["elapsed_s"]]))


def _bare_step_times(data: Path, vocab: int, steps: int, batch: int) -> list[float]:
    """The same model's forward + the loop's CE + backward + clip + AdamW step, on one batch of the same
    data held in memory: what the loop adds (loader, schedule, logging) is all that is missing."""
    from entroweight.data import WeightedTokens
    from entroweight.models.llama import Llama
    from entroweight.trainers.losses import compute_loss

    torch.manual_seed(0)
    model = Llama(Llama.Config(vocab_size=vocab, n_ctx=N_CTX, **MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = next(iter(WeightedTokens(data, batch_size=batch, epochs=1, columns=())))
    x, mask = b["input_ids"], b["mask"][:, 1:]

    def step():
        compute_loss("ce", model(x)[:, :-1], x[:, 1:], mask).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return [timed(step) for _ in range(steps)]


def _loader_tps(data: Path, batches: int, batch: int) -> float:
    from entroweight.data import WeightedTokens

    t = time.perf_counter()  # parquet reads and the shuffle included: two epochs at least
    it = iter(WeightedTokens(data, batch_size=batch, epochs=None, columns=("weight",), shuffle_buffer=256))
    for _ in range(batches):
        next(it)
    return batches * batch * N_CTX / (time.perf_counter() - t)


def _gpu_rows(data: Path, work: Path, quick: bool) -> list[dict]:
    """The reference model in bf16 on CUDA: tokens/s and MFU (6·N·tokens/s over the bf16 peak)."""
    from entroweight.models.llama import Llama

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak = next((v for k, v in {"H100": 989e12, "H200": 989e12, "A100": 312e12}.items() if k in name), None)
    model = Llama(Llama.Config(vocab_size=8000, **REFERENCE)).to(dev)
    n_params = sum(p.numel() for p in model.parameters()) - model.embed_tokens.weight.numel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch, steps = 16, 5 if quick else 20
    x = torch.randint(1, 8000, (batch, REFERENCE["n_ctx"]), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 8000).float(), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    tps = steps * x.numel() / (time.perf_counter() - t)
    flops = 6 * n_params * tps + 12 * REFERENCE["n_layers"] * REFERENCE["d_model"] * REFERENCE["n_ctx"] * tps
    mfu = flops / peak if peak else float("nan")
    return [
        row(
            "trainer (GPU)",
            f"reference d512×16 bf16 tokens/s on {name}",
            tps,
            note="bare torch step, batch 16×1024",
        ),
        row(
            "trainer (GPU)",
            "reference MFU (bf16 dense peak)",
            mfu,
            note=f"peak {peak / 1e12 if peak else '?'} TFLOP/s",
        ),
    ]


def _interleaved_tps(data: Path, steps: int, batch: int) -> dict[str, float]:
    """ce and weighted_ce training steps alternated one by one in one process (same model init, same
    data stream; the weighted one also reads the weight column): median tokens/s of each. Alternating
    per step cancels the drift of other load far better than back-to-back runs."""
    from entroweight.data import WeightedTokens
    from entroweight.models.llama import Llama
    from entroweight.trainers.losses import compute_loss

    runs = {}
    for loss, cols in (("ce", ()), ("weighted_ce", ("weight",))):
        torch.manual_seed(0)
        model = Llama(Llama.Config(vocab_size=1024, n_ctx=N_CTX, **MODEL))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs[loss] = (model, opt, iter(WeightedTokens(data, batch_size=batch, epochs=None, columns=cols)), [])

    def step(loss):
        model, opt, it, times = runs[loss]
        t = time.perf_counter()
        b = next(it)
        ids = b["input_ids"]
        extra = {"weight": b["weight"][:, 1:]} if loss == "weighted_ce" else {}
        out = compute_loss(loss, model(ids)[:, :-1], ids[:, 1:], b["mask"][:, 1:], **extra)
        out.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)

    for i in range(steps + 2):
        for loss in ("ce", "weighted_ce") if i % 2 == 0 else ("weighted_ce", "ce"):
            step(loss)
    return {loss: batch * N_CTX / float(np.median(r[3][2:])) for loss, r in runs.items()}


def run(quick: bool = False) -> list[dict]:
    steps, batch = (8, 8) if quick else (40, 16)
    work = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    # One intra-op thread on CPU: on a shared 2-core box two OpenMP threads spin-wait on each other and
    # a tiny model runs ~10× slower and far noisier; ratios are what this benchmark reports.
    threads = torch.get_num_threads()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    try:
        tok, data = _data(work, 250 if quick else None)
        tps = _interleaved_tps(data, steps, batch)
        # the real loop between two bare blocks: compared with their combined rate
        bare = _bare_step_times(data, 1024, steps // 4, batch)
        loop = _train_tps(data, work / "ck", "ce", steps, batch)
        bare += _bare_step_times(data, 1024, steps // 4, batch)
        bare_tps = batch * N_CTX / float(np.median(bare))
        loader = _loader_tps(data, max(4 * steps, 1000 // batch), batch)
        setup = f"llama d{MODEL['d_model']}×{MODEL['n_layers']}, batch {batch}×{N_CTX}, {torch.get_num_threads()} thread"
        rows = [
            row(
                "trainer",
                "weighted_ce step tokens/s (vs ce)",
                tps["weighted_ce"],
                tps["ce"],
                ">= 0.97",
                f"{setup}; steps alternated, median of {steps}, loader included",
            ),
            row(
                "trainer",
                "train() loop tokens/s (vs bare torch step)",
                loop,
                bare_tps,
                None,
                f"ce through the real loop (loader, schedule, logging; steady state of {steps} steps) vs the "
                f"same step on one in-memory batch, {steps // 4} steps before and after it (median step)",
            ),
            row(
                "trainer",
                "train step tokens/s (vs data loader alone)",
                tps["weighted_ce"],
                loader,
                "<= 0.1",
                "the loader must not be the bottleneck: it runs ≥ 10× faster than the step",
            ),
        ]
        if torch.cuda.is_available():
            rows += _gpu_rows(data, work, quick)
        return rows
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    import sys

    for r in run(quick="--quick" in sys.argv):
        print(r)
