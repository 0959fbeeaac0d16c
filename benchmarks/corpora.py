"""Full-size corpora, simulated: a C4-shaped directory of `.json.gz` files and a FineWeb-shaped parquet
directory (row groups of 1,000 documents), made from the bundled C4 text with every copy distinct.

What it measures (each tokenize run a fresh process, variants in alternating order):
- tokenize MB/s with one shard per file vs 20 shards per file (each file read once either way);
- peak RSS as the shard grows 1x -> 8x (streamed: flat);
- planning seconds per 1,000 source files (empty-bodied: planning opens no body), local and on the
  loopback S3 server, with the requests per file there;
- tokenize on S3 (in and out) vs local disk with production-sized shards.

Make a corpus by hand: python -m benchmarks.corpora DIR --files 1024 --docs 356000 [--fineweb]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import REPO, alternate, bench_tokenizer, c4_texts, median, row

N_CTX = 512
# (files, documents per file): C4 `en` is 1,024 files of ~356,000 documents; this is what fits here
SIZES = {False: (4, 5000), True: (2, 400)}
PLAN_FILES = {False: (1_000, 10_000, 100_000), True: (200, 1_000)}
S3_PLAN_FILES = {False: 10_000, True: 200}
# S3 vs local: (files, documents per file), one shard per file: production's shards are ~20,000
# documents, and a shard's commit (upload, manifest, registry) is a fixed cost the encoder waits on
S3_SIZES = {False: (2, 20_000), True: (2, 400)}


def distinct_texts(n: int, seed: int) -> list[str]:
    """`n` real-looking documents: the C4 sample's, each copy's sentences rotated and a line naming
    the copy appended, so that no two are the same text (C4 ids are hashes of the text)."""
    base = c4_texts()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = base[i % len(base)]
        copy = i // len(base)
        if copy or seed:
            sentences = text.split(". ")
            k = rng.randrange(len(sentences))
            text = ". ".join(sentences[k:] + sentences[:k]) + f"\nEdition {seed}.{copy}."
        out.append(text)
    return out


def make_c4(d: Path, files: int, docs: int) -> int:
    """C4-shaped: `files` gzip JSON-lines files `{text, url, timestamp}`; returns bytes of text."""
    d.mkdir(parents=True, exist_ok=True)
    total = 0
    for f in range(files):
        texts = distinct_texts(docs, seed=f + 1)
        total += sum(len(t.encode()) for t in texts)
        with gzip.open(
            d / f"c4-train.{f:05d}-of-{files:05d}.json.gz", "wt", encoding="utf-8", compresslevel=6
        ) as out:
            for i, t in enumerate(texts):
                out.write(
                    json.dumps(
                        {"text": t, "url": f"https://c4.example/{f}/{i}", "timestamp": "2019-04-25T12:57:54Z"}
                    )
                    + "\n"
                )
    return total


def make_fineweb(d: Path, files: int, docs: int, row_group: int = 1000) -> int:
    """FineWeb-shaped: parquet files `{text, id, dump, url, ...}` in row groups of `row_group` documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir(parents=True, exist_ok=True)
    total = 0
    for f in range(files):
        texts = distinct_texts(docs, seed=10_000 + f)
        total += sum(len(t.encode()) for t in texts)
        table = pa.table(
            {
                "text": texts,
                "id": [f"<urn:uuid:{f:05d}-{i:08d}>" for i in range(docs)],
                "dump": ["CC-MAIN-2024-10"] * docs,
                "url": [f"https://fineweb.example/{f}/{i}" for i in range(docs)],
                "language": ["en"] * docs,
                "token_count": [len(t) // 4 for t in texts],
            }
        )
        pq.write_table(table, d / f"{f:03d}_00000.parquet", row_group_size=row_group, compression="snappy")
    return total


_STAGE = """
import json, resource, sys, time
from entroweight.pipelines import run_stage
from entroweight.pipelines.tokenize import TokenizeStage
corpus, tok, out, shard_docs = sys.argv[1:]
start = time.perf_counter()
s = run_stage(TokenizeStage([corpus], tok, n_ctx=512, shard_docs=int(shard_docs) or None), out, progress=False)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "shards": s.shards_run, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def tokenize(corpus: str, tok: str, out: str, shard_docs: int | None) -> dict:
    """{"seconds", "shards", "rss_mb"} of a fresh process tokenizing `corpus` into `out`."""
    from entroweight import storage

    storage.remove_tree(out)
    cmd = [sys.executable, "-c", _STAGE, corpus, tok, out, str(shard_docs or 0)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if res.returncode:
        raise RuntimeError(f"tokenize failed on {corpus}:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def plan_seconds(src: str, tok: Path, out: str) -> float:
    """Seconds to plan a tokenize run over `src` (refusal checks, expanding the sources, numbering
    every input, writing the registry): everything run_stage does before the first shard."""
    from entroweight import storage
    from entroweight.pipelines.stage import check_out_dir, plan_run
    from entroweight.pipelines.tokenize import TokenizeStage

    storage.remove_tree(out)
    stage = TokenizeStage([src], str(tok), n_ctx=N_CTX, shard_docs=20_000)
    start = time.perf_counter()
    check_out_dir(stage, out)
    plan = plan_run(stage, out)
    seconds = time.perf_counter() - start
    assert len(plan.todo) >= 1
    return seconds


def empty_files(d: Path, n: int) -> str:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (d / f"c4-train.{i:06d}.json.gz").touch()
    return str(d)


def run(quick: bool = False) -> list[dict]:
    sys.path.insert(0, str(REPO / "tests"))
    from s3server import s3_server

    files, docs = SIZES[quick]
    tok = bench_tokenizer(8000, quick)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-corpora-") as tmp:
        d = Path(tmp)
        mb = make_c4(d / "c4", files, docs) / 1e6
        shape = f"{files} C4-shaped .json.gz of {docs:,} docs ({mb:.1f} MB of text)"

        # one shard per file vs 20 per file: the same bytes decompressed once either way
        runs = {"one": [], "twenty": []}
        alternate(
            {
                "one": lambda: runs["one"].append(tokenize(str(d / "c4"), str(tok), str(d / "out1"), None)),
                "twenty": lambda: runs["twenty"].append(
                    tokenize(str(d / "c4"), str(tok), str(d / "out20"), docs // 20)
                ),
            },
            rounds=2,
        )
        one = median(r["seconds"] for r in runs["one"])
        twenty = median(r["seconds"] for r in runs["twenty"])
        rows.append(
            row(
                "corpora",
                "tokenize MB/s, 20 shards per file vs 1",
                mb / twenty,
                mb / one,
                ">= 0.95",
                f"{shape}; {runs['twenty'][0]['shards']} vs {runs['one'][0]['shards']} shards, n_ctx {N_CTX}, "
                "median of 2 alternating runs, fresh process each",
            )
        )

        # peak RSS as the shard grows 1x -> 8x: one file, FineWeb-shaped and C4-shaped
        fw_docs = docs * 2
        make_fineweb(d / "fw", 1, fw_docs)
        small = max(fw_docs // 16, 1)
        first_c4 = sorted((d / "c4").iterdir())[0]
        rss = {}
        for name, src, n in (("c4", first_c4, docs), ("fineweb", d / "fw", fw_docs)):
            base = max(n // 16, 1)
            rss[name] = [
                tokenize(str(src), str(tok), str(d / f"rss-{name}-{k}"), base * k)["rss_mb"] for k in (1, 8)
            ]
        rows.append(
            row(
                "corpora",
                "peak RSS MB, shard 8x vs 1x (C4 .json.gz)",
                rss["c4"][1],
                rss["c4"][0],
                "ratio ~1.0",
                f"one file of {docs:,} docs, shards of {docs // 16:,} vs {docs // 16 * 8:,} docs, fresh process each",
            )
        )
        rows.append(
            row(
                "corpora",
                "peak RSS MB, shard 8x vs 1x (FineWeb parquet)",
                rss["fineweb"][1],
                rss["fineweb"][0],
                "ratio ~1.0",
                f"one file of {fw_docs:,} docs in row groups of 1,000, shards of >= {small:,} vs {small * 8:,} docs",
            )
        )

        # planning vs file count, local: empty-bodied files (planning opens none)
        for n in PLAN_FILES[quick]:
            src = empty_files(d / f"plan{n}", n)
            s = plan_seconds(src, tok, str(d / f"plan-out{n}"))
            rows.append(
                row(
                    "corpora",
                    f"plan {n:,} local source files (s per 1,000)",
                    s / n * 1000,
                    None,
                    "<= 1",
                    f"{s:.2f} s in all: listing, stats, numbering, the registry; no body opened",
                )
            )
            shutil.rmtree(src)

        with s3_server():
            rows += _s3(d, tok, quick)
    return rows


def _s3(d: Path, tok: Path, quick: bool) -> list[dict]:
    import fsspec
    import s3fs

    sys.path.insert(0, str(REPO / "tests"))
    from s3server import new_bucket

    bucket = new_bucket()
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    rows = []
    n = S3_PLAN_FILES[quick]
    names = {f"{bucket}/plan/c4-train.{i:06d}.json.gz".removeprefix("s3://"): b"" for i in range(n)}
    items = list(names.items())
    for a in range(0, len(items), 2000):
        fs.pipe(dict(items[a : a + 2000]))
    calls = collections.Counter()
    original = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):
        calls[method if isinstance(method, str) else getattr(method, "__name__", str(method))] += 1
        return await original(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = counted
    try:
        s = plan_seconds(f"{bucket}/plan", tok, f"{bucket}/plan-out")
    finally:
        s3fs.S3FileSystem._call_s3 = original
    rows.append(
        row(
            "corpora",
            f"plan {n:,} S3 source files (s per 1,000)",
            s / n * 1000,
            None,
            "<= 5",
            f"{s:.1f} s in all on loopback S3 (moto); requests {dict(calls)} = "
            f"{sum(calls.values()) / n:.3f} per file",
        )
    )

    # tokenize on S3 vs local with production-sized shards (one file each)
    files, docs = S3_SIZES[quick]
    make_c4(d / "c4-s3", files, docs)
    fs.put(str(d / "c4-s3") + "/", f"{bucket}/c4/", recursive=True)
    fs.put(str(tok / "tokenizer.json"), f"{bucket}/tok/tokenizer.json")
    shard = docs
    server = _server_process()
    server_cpu = []

    def on_s3():
        before = _cpu_seconds(server)
        times["s3"].append(
            tokenize(f"{bucket}/c4", f"{bucket}/tok/tokenizer.json", f"{bucket}/tok512", shard)
        )
        server_cpu.append(_cpu_seconds(server) - before)

    mb = (
        sum(
            len(json.loads(line)["text"].encode())
            for p in sorted((d / "c4-s3").iterdir())
            for line in gzip.open(p, "rt", encoding="utf-8")
        )
        / 1e6
    )
    times = {"local": [], "s3": []}
    alternate(
        {
            "local": lambda: times["local"].append(
                tokenize(str(d / "c4-s3"), str(tok), str(d / "tok-local"), shard)
            ),
            "s3": on_s3,
        },
        rounds=2,
    )
    rows.append(
        row(
            "corpora",
            "tokenize MB/s on S3 (in and out) vs local",
            mb / median(r["seconds"] for r in times["s3"]),
            mb / median(r["seconds"] for r in times["local"]),
            ">= 0.9",
            f"{mb:.1f} MB, shards of {shard:,} docs (production: ~20,000), loopback S3 (moto), "
            "median of 2 alternating runs, fresh process each; the server itself used "
            f"{median(server_cpu):.1f} CPU-s of the same cores per run (a real store uses none of them)",
        )
    )
    return rows


def _server_process():
    """The loopback S3 server (tests/s3server.py starts it as a child of this process)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        if "moto.server" in " ".join(child.cmdline()):
            return child
    return None


def _cpu_seconds(proc) -> float:
    if proc is None:
        return float("nan")
    t = proc.cpu_times()
    return t.user + t.system


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="write a simulated C4-shaped (or FineWeb-shaped) corpus")
    p.add_argument("out", type=Path)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--docs", type=int, default=5000, help="documents per file")
    p.add_argument("--fineweb", action="store_true", help="parquet in row groups of 1,000 instead")
    args = p.parse_args(argv)
    make = make_fineweb if args.fineweb else make_c4
    mb = make(args.out, args.files, args.docs) / 1e6
    print(f"wrote {args.files} files of {args.docs:,} documents ({mb:.1f} MB of text) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
