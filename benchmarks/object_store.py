"""The stages on object storage beside local disk, and planning over 10,000 shards on an object store.

A real S3-protocol server on loopback (moto's standalone server, tests/s3server.py): the figures are
what the storage layer costs (uploads held back and completed, listings, parallel manifest reads),
not the network of a cloud region. tokenize and score read their input from the bucket and write
their output to it; the bare limit is the same run on local disk, run in alternating order.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .common import REPO, alternate, bench_tokenizer, c4_texts, median, row, write_jsonl_gz

N_CTX = 512
# Shards of 1,000 documents (production runs use ~20,000): a shard pays a few requests of fixed cost
# (its parquet, its manifest, a HEAD), which a shard of 250 C4 documents (0.1 s of work) cannot hide.
SHARD_DOCS = 1000
COPIES = {False: 4, True: 1}
PLAN_SHARDS = {False: 10_000, True: 1_000}


def _server():
    sys.path.insert(0, str(REPO / "tests"))
    from s3server import new_bucket, s3_server

    return s3_server, new_bucket


def _tiny_model(out: Path, tokenizer_json: Path, vocab: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=N_CTX,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    shutil.copy(tokenizer_json, out / "tokenizer.json")
    return out


def _fresh(location: str) -> None:
    from entroweight import storage

    storage.remove_tree(location)


class _PlanOnly:
    """A stage whose planning is all there is: `n` inputs whose shards are all done."""

    def __new__(cls, n: int):
        from entroweight.pipelines.stage import Stage
        from entroweight.schemas.manifest import ShardInput

        class PlanOnly(Stage):
            name = "plan-bench"

            def config(self):
                return {"n": n}

            def plan_inputs(self):
                return [
                    ShardInput(uri=f"s3://src/doc-{i:06d}.jsonl", fmt="jsonl", size=1000) for i in range(n)
                ]

            def input_paths(self):
                return []

            def process(self, task):
                raise AssertionError("every shard is done: planning only")

        return PlanOnly()


def populate_done(out: str, n: int) -> object:
    """Write, in parallel, what `n` finished shards of `_PlanOnly(n)` leave on the store: the stage
    record, the shard registry, and per shard a small parquet object and its manifest."""
    import fsspec

    from entroweight import __version__
    from entroweight.schemas import ShardManifest, StageRecord

    stage = _PlanOnly(n)
    inputs = stage.plan_inputs()
    root = out.removeprefix("s3://")
    record = StageRecord(
        stage=stage.name, config=stage.config(), config_hash=stage.config_hash, code_version=__version__
    )
    blobs = {
        f"{root}/.stage.json": record.model_dump_json().encode(),
        f"{root}/.shards.json": json.dumps(
            {inp.key: f"part-{i:05d}" for i, inp in enumerate(inputs)}
        ).encode(),
    }
    body = b"PAR1" + b"\0" * 60
    for i, inp in enumerate(inputs):
        shard = f"part-{i:05d}"
        m = ShardManifest(
            shard=shard,
            stage=stage.name,
            inputs=[inp],
            output=f"{shard}.parquet",
            output_sha256="0" * 64,
            output_bytes=len(body),
            rows_out=250,
            docs_in=250,
            docs_out=250,
            config_hash=stage.config_hash,
            code_version=__version__,
        )
        blobs[f"{root}/{shard}.parquet"] = body
        blobs[f"{root}/.{shard}.manifest.json"] = m.model_dump_json().encode()
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    items = list(blobs.items())
    for a in range(0, len(items), 2000):
        fs.pipe(dict(items[a : a + 2000]))
    return stage


def run(quick: bool = False) -> list[dict]:
    import fsspec

    from entroweight.pipelines import run_stage
    from entroweight.pipelines.score import ScoreStage
    from entroweight.pipelines.stage import plan_run
    from entroweight.pipelines.tokenize import TokenizeStage

    s3_server, new_bucket = _server()
    rows = []
    with s3_server(), tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        d = Path(tmp)
        bucket = new_bucket()
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        corpus = d / "c4.jsonl.gz"
        mb = write_jsonl_gz(corpus, c4_texts(), COPIES[quick]) / 1e6
        tok = bench_tokenizer(8000, quick)
        fs.put(str(corpus), f"{bucket}/raw/c4.jsonl.gz")
        fs.put(str(tok / "tokenizer.json"), f"{bucket}/tok/tokenizer.json")

        def tokenize(src, tokenizer, out):
            _fresh(out)
            stage = TokenizeStage([src], tokenizer, n_ctx=N_CTX, shard_docs=SHARD_DOCS)
            run_stage(stage, out, progress=False)

        runs = alternate(
            {
                "local": lambda: tokenize(str(corpus), str(tok), str(d / "tok")),
                "s3": lambda: tokenize(
                    f"{bucket}/raw/c4.jsonl.gz", f"{bucket}/tok/tokenizer.json", f"{bucket}/tok512"
                ),
            },
            rounds=2,
        )
        local_s, s3_s = median(runs["local"]), median(runs["s3"])
        rows.append(
            row(
                "object store",
                "tokenize MB/s on S3 (in and out)",
                mb / s3_s,
                mb / local_s,
                ">= 0.9",
                f"{mb:.1f} MB of C4 in shards of {SHARD_DOCS} docs, loopback S3 (moto) vs local disk, median of 2 alternating runs",
            )
        )

        model = _tiny_model(d / "model", tok / "tokenizer.json", 8000 + 3)
        opts = {"model": str(model), "dtype": "fp32", "batch_size": 16}

        real = {}

        def score(data, out):
            _fresh(out)
            real["tokens"] = run_stage(
                ScoreStage(data, "causal_loss", opts), out, progress=False
            ).n_real_tokens

        runs = alternate(
            {
                "local": lambda: score(str(d / "tok"), str(d / "scored")),
                "s3": lambda: score(f"{bucket}/tok512", f"{bucket}/scored"),
            },
            rounds=2,
        )
        rows.append(
            row(
                "object store",
                "score tokens/s on S3 (in and out)",
                real["tokens"] / median(runs["s3"]),
                real["tokens"] / median(runs["local"]),
                ">= 0.9",
                "causal_loss, a 2-layer d64 HF Llama, same tokenized shards read from S3 vs local disk",
            )
        )

        n = PLAN_SHARDS[quick]
        out = f"{bucket}/plan"
        start = time.perf_counter()
        stage = populate_done(out, n)
        fill = time.perf_counter() - start
        times = []
        for _ in range(2):
            start = time.perf_counter()
            plan = plan_run(stage, out)
            times.append(time.perf_counter() - start)
            assert len(plan.done) == n and not plan.todo
        rows.append(
            row(
                "object store",
                f"plan {n:,} done shards on S3 (s)",
                median(times),
                None,
                "<= 60",
                f"one listing + parallel manifest reads; writing them took {fill:.0f} s",
            )
        )
    return rows
