"""tokenize+pack+write vs the bare `Tokenizer.encode_batch` on the same text and cores; RSS; bytes/token."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import best_of, c4_texts, row

N_CTX = 512


def _train_tokenizer(out: Path, texts: list[str]) -> Path:
    from entroweight.transforms.train_tokenizer import save_tokenizer, train_bpe

    from .common import LLAMA3

    save_tokenizer(train_bpe(texts, 8000, LLAMA3), out)
    return out


def _write_corpus(path: Path, texts: list[str], repeat: int) -> int:
    """The C4 sample repeated `repeat` times as gzip jsonl (what users feed); returns text bytes."""
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as f:
        for _ in range(repeat):
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
    return repeat * sum(len(t.encode()) for t in texts)


def _run_stage(corpus: Path, tok: Path, out: Path, pack: bool = False) -> None:
    from entroweight.pipelines import run_stage
    from entroweight.pipelines.tokenize import TokenizeStage

    shutil.rmtree(out, ignore_errors=True)
    run_stage(TokenizeStage([str(corpus)], str(tok), n_ctx=N_CTX, pack=pack), out, progress=False)


def _peak_rss_mb(corpus: Path, tok: Path, out: Path) -> float:
    """Peak RSS of a fresh process tokenizing `corpus`, as the process itself reports it."""
    code = (
        "import resource; from entroweight.pipelines import run_stage; "
        "from entroweight.pipelines.tokenize import TokenizeStage; "
        f"run_stage(TokenizeStage([{str(corpus)!r}], {str(tok)!r}, n_ctx={N_CTX}), {str(out)!r}, progress=False); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    shutil.rmtree(out, ignore_errors=True)
    res = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return int(res.stdout.split()[-1]) / 1024


def run(quick: bool = False) -> list[dict]:
    from entroweight.transforms.inspect import summarize
    from entroweight.transforms.tokenizer import load_tokenizer

    texts = c4_texts()
    repeat = 2 if quick else 20  # 2.2 MB of text per copy: >= 40 MB in the full run
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        tok_dir = _train_tokenizer(d / "tok", texts)
        corpus = d / "corpus.jsonl.gz"
        mb = _write_corpus(corpus, texts, repeat) / 1e6
        tokenizer = load_tokenizer(tok_dir).tokenizer
        all_texts = texts * repeat

        def bare():
            for i in range(0, len(all_texts), 2048):
                tokenizer.encode_batch(all_texts[i : i + 2048], add_special_tokens=False)

        # interleave so that load from elsewhere hits both alike
        t_bare, t_stage, t_pack = [], [], []
        for i in range(1 if quick else 2):
            t_bare.append(best_of(bare, 1))
            t_stage.append(best_of(lambda: _run_stage(corpus, tok_dir, d / "out"), 1))
            if i == 0:
                t_pack.append(best_of(lambda: _run_stage(corpus, tok_dir, d / "packed", pack=True), 1))
        bare_mbs = mb / min(t_bare)
        rows = [
            row(
                "tokenize",
                "MB/s (left-pad, from .json.gz)",
                mb / min(t_stage),
                bare_mbs,
                ">= 0.95",
                f"{mb:.0f} MB of C4 text, 8k BPE, n_ctx {N_CTX}; bare = Tokenizer.encode_batch in memory",
            ),
            row("tokenize", "MB/s (packed, from .json.gz)", mb / min(t_pack), bare_mbs, ">= 0.95"),
        ]
        info = summarize(d / "out")
        rows.append(
            row(
                "tokenize",
                "disk B/real token (ids, left-pad)",
                info["disk_bytes_per_real_token"],
                None,
                "<= 1.7",
            )
        )
        if not quick:
            small = d / "small.jsonl.gz"
            _write_corpus(small, texts, repeat // 4)
            rss_small = _peak_rss_mb(small, tok_dir, d / "rss1")
            rss_large = _peak_rss_mb(corpus, tok_dir, d / "rss2")
            rows.append(
                row(
                    "tokenize",
                    "peak RSS MB (4x input)",
                    rss_large,
                    rss_small,
                    "ratio ~1.0",
                    f"bare = peak RSS on 1/4 of the input ({mb / 4:.0f} MB)",
                )
            )
    return rows
