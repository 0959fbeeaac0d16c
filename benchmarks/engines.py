"""The tokenize stage on Beam and Ray beside the local engine, on the same input and cores.

Throughput excludes start-up: it is the input's bytes over the processing window, from the first
shard's start to the last manifest's write (both read from the manifests on disk: mtime, and the
`seconds` each shard took). What lies outside the window (start Ray or Beam and its workers, load
the tokenizer, collect results, shut down) is reported as start-up/teardown in its own rows.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from .common import bench_tokenizer, c4_texts, row, write_jsonl_gz

N_CTX = 512
SHARD_DOCS = 250  # 4 shards per copy of the 1,000-doc C4 sample: enough to keep 2 workers busy
# (label, engine, options): the distributed ones with one worker per core of this machine
ENGINES = [
    ("beam in_memory", "beam", {}),
    ("beam multi_processing x2", "beam", {"workers": 2}),
    ("ray actors x2", "ray", {"workers": 2}),
]


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
    texts = c4_texts()
    # full: 2 copies of the 2.2 MB sample in 8 shards; quick: half a copy in 2 shards, beam in_memory only
    # (Ray's and Beam multi_processing's start-up alone take 10-30 s on a loaded 2-core box)
    texts = texts * 2 if not quick else texts[: len(texts) // 2]
    tok = bench_tokenizer(8000, quick)
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        d = Path(tmp)
        corpus = d / "corpus.jsonl.gz"
        mb = write_jsonl_gz(corpus, texts) / 1e6
        # local first and last: each engine is compared with the mean of the two local runs around it all
        local = [_timed_run(corpus, tok, d / "out", "local", {})]
        runs = {}
        for label, engine, options in ENGINES:
            if not quick or label == "beam in_memory":
                runs[label] = _timed_run(corpus, tok, d / "out", engine, options)
        local.append(_timed_run(corpus, tok, d / "out", "local", {}))
    local_mbs = sum(mb / window for _, window in local) / len(local)
    n_shards = -(-len(texts) // SHARD_DOCS)
    note = (
        f"{mb:.1f} MB of C4 text, {n_shards} shards, 8k BPE, n_ctx {N_CTX}; local runs before and after "
        f"the others: {', '.join(f'{mb / w:.2f}' for _, w in local)} MB/s"
    )
    rows = [row("engines", "local MB/s", local_mbs, None, None, note)]
    for label, (wall, window) in runs.items():
        note = f"wall {wall:.1f} s; bare = the local engine's MB/s (mean of its two runs)"
        rows.append(row("engines", f"{label} MB/s excl. start-up", mb / window, local_mbs, ">= 0.75", note))
        rows.append(
            row("engines", f"{label} start-up+teardown s", wall - window, None, None, "outside the window")
        )
    return rows
