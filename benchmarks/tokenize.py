"""tokenize+pack+write vs the bare `Tokenizer.encode_batch(_fast)` on the same text and cores; peak RSS against
input size; bytes per real token on disk.

Each stage run is a fresh process (it reports its own time and peak RSS); bare encode_batch chunks run
in this process between the stage runs (bare, stage, bare, ...), and each stage run is compared with
the mean rate of the bare chunks on either side of it, so that drifting load from other processes on
a shared machine falls on both alike.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import bench_tokenizer, c4_texts, row, timed, write_jsonl_gz

N_CTX = 512
# Copies of the 2.2 MB C4 sample: the main run is >= 40 MB (the floor), the small one 1/4 of it.
COPIES = {False: 20, True: 1}

_STAGE = """
import json, resource, sys, time
from entroweight.pipelines import run_stage
from entroweight.pipelines.tokenize import TokenizeStage
corpus, tok, out, n_ctx, pack = sys.argv[1:]
start = time.perf_counter()
run_stage(TokenizeStage([corpus], tok, n_ctx=int(n_ctx), pack=pack == "1"), out, progress=False)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


# the plan of duplicate ids alone (what a tokenize run does first when it has shards to make), on this
# process's engine (the local one: ids spilled per partition, a partition grouped at a time)
_PLAN = """
import json, resource, sys, time
from entroweight.pipelines.stage import shuffle_here
from entroweight.pipelines.tokenize import TokenizeStage
corpus, tok, n_ctx = sys.argv[1:]
stage = TokenizeStage([corpus], tok, n_ctx=int(n_ctx))
inputs = stage.plan_inputs()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
start = time.perf_counter()
found = stage.whole_plan(inputs, list(dict.fromkeys(i.uri for i in inputs)), shuffle_here)
seconds = time.perf_counter() - start
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": seconds, "rss_mb": rss, "base_mb": base, "later": sum(map(len, found.values()))}))
"""


def _plan(corpus: Path, tok: Path) -> dict:
    """{"seconds", "rss_mb", "base_mb", "later"} of a fresh process planning `corpus`'s duplicate ids."""
    res = subprocess.run(
        [sys.executable, "-c", _PLAN, str(corpus), str(tok), str(N_CTX)], capture_output=True, text=True
    )
    if res.returncode:
        raise RuntimeError(f"the plan of duplicate ids failed on {corpus}:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _stage(corpus: Path, tok: Path, out: Path, pack: bool = False) -> dict:
    """{"seconds", "rss_mb"} of a fresh process tokenizing `corpus` (seconds exclude interpreter start)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-c", _STAGE, str(corpus), str(tok), str(out), str(N_CTX), "1" if pack else "0"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"tokenize stage failed on {corpus}:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> list[dict]:
    from entroweight.transforms.inspect import summarize
    from entroweight.transforms.tokenizer import load_tokenizer

    texts = c4_texts()
    copies = COPIES[quick]
    tok_dir = bench_tokenizer(8000, quick)
    tokenizer = load_tokenizer(tok_dir).tokenizer
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        d = Path(tmp)
        large, small = d / "large.jsonl.gz", d / "small.jsonl.gz"
        mb_large = write_jsonl_gz(large, texts, copies) / 1e6
        small_texts = texts if copies >= 4 else texts[: len(texts) * copies // 4]  # 1/4 of the large input
        mb_small = write_jsonl_gz(small, small_texts, max(1, copies // 4)) / 1e6
        bare_texts = texts if not quick else texts[:500]  # per bare chunk: one copy of the sample, or half
        bare_mb = sum(len(t.encode()) for t in bare_texts) / 1e6

        def bare(encode) -> float:
            """MB/s of `encode` over one chunk of the same text, batches of 1,024 docs: encode_batch_fast
            (without offsets: what the stage calls, and the stricter limit) or encode_batch (with offsets:
            the issue's reference, and what datatrove's tokenizer step calls)."""
            seconds = timed(
                lambda: [
                    encode(bare_texts[i : i + 1024], add_special_tokens=False)
                    for i in range(0, len(bare_texts), 1024)
                ]
            )
            return bare_mb / seconds

        fast, with_offsets = tokenizer.encode_batch_fast, tokenizer.encode_batch
        # bare, stage, bare, stage, ...: each stage run against the bare chunks either side of it
        b, b_off = [bare(fast)], [bare(with_offsets)]
        main = _stage(large, tok_dir, d / "out")
        plan = _plan(large, tok_dir)
        b.append(bare(fast))
        b_off.append(bare(with_offsets))
        packed = _stage(small, tok_dir, d / "packed", pack=True)
        b.append(bare(fast))
        small_run = _stage(small, tok_dir, d / "small")
        b.append(bare(fast))
        info = summarize(d / "out")
        main_docs = info["docs_in"]

    setup = (
        f"8k BPE, n_ctx {N_CTX}, from .json.gz; bare = Tokenizer.encode_batch_fast in memory, same cores, "
        "run just before and after"
    )
    return [
        row(
            "tokenize",
            "MB/s (left-pad, from .json.gz)",
            mb_large / main["seconds"],
            (b[0] + b[1]) / 2,
            ">= 0.95",
            f"{mb_large:.1f} MB of C4 text in one run; {setup}"
            + ("; quick: too small to mean much (the first batch's read is not overlapped)" if quick else ""),
        ),
        row(
            "tokenize",
            "MB/s (left-pad) vs encode_batch",
            mb_large / main["seconds"],
            (b_off[0] + b_off[1]) / 2,
            ">= 0.95",
            "the same run against Tokenizer.encode_batch (offsets computed): the issue's bare rate",
        ),
        row(
            "tokenize",
            "MB/s (packed, from .json.gz)",
            mb_small / packed["seconds"],
            (b[1] + b[2]) / 2,
            ">= 0.95",
            f"{mb_small:.1f} MB",
        ),
        row(
            "tokenize",
            "MB/s (left-pad, 1/4 of the input)",
            mb_small / small_run["seconds"],
            (b[2] + b[3]) / 2,
            ">= 0.95",
            f"{mb_small:.1f} MB",
        ),
        row(
            "tokenize",
            "peak RSS MB (4x input vs 1x)",
            main["rss_mb"],
            small_run["rss_mb"],
            "ratio ~1.0",
            f"fresh process each: {mb_large:.1f} MB vs {mb_small:.1f} MB of text",
        ),
        row(
            "tokenize",
            "duplicate-id plan s vs the run's s",
            plan["seconds"],
            main["seconds"],
            "<= 0.25",
            f"{main_docs:,} docs ({copies} copies of the sample: {plan['later']:,} later copies found), in the "
            f"run's time; peak RSS {plan['rss_mb']:.0f} MB, {plan['rss_mb'] - plan['base_mb']:.0f} MB over "
            "the process before it (one partition's ids at a time)",
        ),
        row(
            "tokenize", "disk B/real token (ids, left-pad)", info["disk_bytes_per_real_token"], None, "<= 1.7"
        ),
    ]
