"""The tokenize stage on Beam and Ray beside the local engine, on the same input and cores.

Throughput excludes start-up: it is the input's bytes over the processing window, from the first
shard's start to the last manifest's write (both read from the manifests on disk: mtime, and the
`seconds` each shard took). What lies outside the window (start Ray or Beam and its workers, load
the tokenizer, collect results, shut down) is reported as start-up/teardown in its own rows.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
import time
from pathlib import Path

from .common import LLAMA3, c4_texts, row

N_CTX = 512
SHARD_DOCS = 250  # 4 shards per copy of the C4 sample: enough to keep 2 workers busy
# (label, engine, options): the distributed ones with one worker per core of this machine
ENGINES = [
    ("beam in_memory", "beam", {}),
    ("beam multi_processing x2", "beam", {"workers": 2}),
    ("ray actors x2", "ray", {"workers": 2}),
]


def _write(path: Path, texts: list[str]) -> int:
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return sum(len(t.encode()) for t in texts)


def _timed_run(corpus: Path, tok: Path, out: Path, engine: str, options: dict) -> tuple[float, float]:
    """(wall seconds of the whole run, seconds of its processing window)."""
    from entroweight.pipelines import run_stage
    from entroweight.pipelines.stage import manifest_path, read_manifests
    from entroweight.pipelines.tokenize import TokenizeStage

    shutil.rmtree(out, ignore_errors=True)
    stage = TokenizeStage([str(corpus)], str(tok), n_ctx=N_CTX, shard_docs=SHARD_DOCS)
    start = time.perf_counter()
    run_stage(stage, out, engine=engine, progress=False, **options)
    wall = time.perf_counter() - start
    ends = {m.shard: manifest_path(out, m.shard).stat().st_mtime for m in read_manifests(out)}
    first_start = min(ends[m.shard] - m.seconds for m in read_manifests(out))
    return wall, max(ends.values()) - first_start


def run(quick: bool = False) -> list[dict]:
    from entroweight.transforms.train_tokenizer import save_tokenizer, train_bpe

    texts = c4_texts()
    repeat = 1 if quick else 3  # 2.2 MB of text per copy
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        tok = d / "tok"
        save_tokenizer(train_bpe(texts[: 200 if quick else 1000], 8000, LLAMA3), tok)
        corpus = d / "corpus.jsonl.gz"
        mb = _write(corpus, texts * repeat) / 1e6

        runs = {label: [] for label in ["local"] + [e[0] for e in ENGINES]}
        # rounds interleave the engines, so load from elsewhere hits all alike; the best round counts
        for _ in range(1 if quick else 2):
            runs["local"].append(_timed_run(corpus, tok, d / "out", "local", {}))
            for label, engine, options in ENGINES:
                if not (quick and "multi" in label):
                    runs[label].append(_timed_run(corpus, tok, d / "out", engine, options))
        wall, window = min(runs["local"], key=lambda r: r[1])
        local_mbs = mb / window
        note = f"{mb:.1f} MB of C4 text, {repeat * 4} shards, 8k BPE, n_ctx {N_CTX}; wall {wall:.1f} s"
        rows = [row("engines", "local MB/s", local_mbs, None, None, note)]
        for label, _, _ in ENGINES:
            if not runs[label]:
                continue
            wall, window = min(runs[label], key=lambda r: r[1])
            note = f"wall {wall:.1f} s; bare = local engine's MB/s"
            rows.append(
                row("engines", f"{label} MB/s excl. start-up", mb / window, local_mbs, ">= 0.75", note)
            )
            rows.append(
                row(
                    "engines", f"{label} start-up+teardown s", wall - window, None, None, "outside the window"
                )
            )
    return rows
