"""Peak memory of the score stage as a shard's rows grow 1× → 8×: the stage streams a shard in
segments (pipelines/score.py), so the peak stays flat instead of growing with the shard.

Each size runs in its own process (peak RSS is a process's high-water mark): a tokenized shard of
N rows, our tiny llama through `causal_loss`, segments of SEGMENT_ROWS rows so that every size
spans several of them. Reported: peak RSS in MB per size, and the 8× peak over the 1× peak.

The children run with MALLOC_ARENA_MAX=2: glibc otherwise gives each short-lived thread (the
prefetcher of each segment, the writer) an arena of its own and keeps what they freed, which adds
~10 % of RSS over 16 segments that no data of the stage holds (measured: 1.12× with the default
arenas, 1.035× with one; Arrow's pool peaks at 1.4 MB vs 3.9 MB). What this measures is what the
stage holds; a deployment sets the same variable for the same reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import REPO, bench_tokenizer, c4_texts, row

N_CTX = 128
SEGMENT_ROWS = 256

_CHILD = r"""
import json, resource, sys
import entroweight.pipelines.score as score
from entroweight.pipelines import run_stage
data, ckpt, out, segment = sys.argv[1:5]
score.SEGMENT_TOKENS = int(segment) * int(sys.argv[5])
stage = score.ScoreStage(data, "causal_loss", {"checkpoint": ckpt, "dtype": "fp32"})
run_stage(stage, out, progress=False)
print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _tokenized(root: Path, rows: int, tok: Path) -> Path:
    from entroweight.pipelines import run_stage
    from entroweight.pipelines.tokenize import TokenizeStage

    from .common import write_jsonl_gz

    texts = c4_texts()
    src = root / f"src-{rows}.jsonl.gz"
    write_jsonl_gz(src, [texts[i % len(texts)] + f" {i}" for i in range(rows)])
    out = root / f"tok-{rows}"
    run_stage(TokenizeStage([str(src)], str(tok), n_ctx=N_CTX, overflow="truncate"), out, progress=False)
    return out


def _checkpoint(root: Path, data: Path) -> Path:
    from entroweight.models.checkpoint import save_checkpoint
    from entroweight.models.llama import Llama
    from entroweight.schemas.datadir import DataDir

    meta = DataDir(data).parts[0]
    from entroweight.schemas import read_file_metadata

    m = read_file_metadata(meta.location)
    model = Llama(
        Llama.Config(vocab_size=m["vocab_size"], n_ctx=N_CTX, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    )
    return save_checkpoint(
        model.eval(),
        "llama",
        root / "llama",
        tokenizer_sha256=m["tokenizer_sha256"],
        n_ctx=N_CTX,
        pad_id=m["pad_id"],
    )


def run(quick: bool = False) -> list[dict]:
    base = 512 if quick else 2048
    tok = bench_tokenizer(quick=quick)
    peaks = {}
    with tempfile.TemporaryDirectory(prefix="bench-score-mem-") as d:
        root = Path(d)
        ckpt = None
        for k in (1, 2, 4, 8):
            data = _tokenized(root, base * k, tok)
            ckpt = ckpt or _checkpoint(root, data)
            proc = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    _CHILD,
                    str(data),
                    str(ckpt),
                    str(root / f"out-{k}"),
                    str(SEGMENT_ROWS),
                    str(N_CTX),
                ],
                capture_output=True,
                text=True,
                cwd=REPO,
                check=True,
                env={**os.environ, "MALLOC_ARENA_MAX": "2"},
            )
            peaks[k] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_mb"]
    rows = [
        row(
            "score (memory)",
            f"peak RSS MB, shard of {base * k} rows ({k}×)",
            peaks[k],
            note=f"segments of {SEGMENT_ROWS} rows",
        )
        for k in peaks
    ]
    rows.append(
        row(
            "score (memory)",
            "peak RSS 8× / 1× shard",
            peaks[8] / peaks[1],
            target="<= 1.1",
            note="flat: streamed segments",
        )
    )
    return rows
