"""hf: sources (issue 16): the dataset's revision is resolved once at planning and recorded, its parquet
files are sharded by row group, each worker opens only its row groups, and a run that finds another
upstream revision on the same --out is refused unless pinned with --revision.

Offline: `sources.hub_files`, the one function that talks to the hub, is replaced by one returning
parquet files (several row groups each, from the bundled C4 sample) on the loopback S3 server."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from entroweight import storage
from entroweight.pipelines import run_stage
from entroweight.pipelines.stage import read_manifests
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.transforms import sources
from entroweight.transforms.sources import DocumentReader, plan_inputs
from entroweight.workflows.cli.main import main

SHA_A, SHA_B = "a" * 40, "b" * 40


@pytest.fixture
def fake_hub(s3_bucket, c4_path, monkeypatch):
    """Two revisions of a dataset on S3: 100 C4 documents in two parquet files of row groups of 20."""
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(100)]
    files = {}
    for sha in (SHA_A, SHA_B):
        files[sha] = []
        for i, part in enumerate((rows[:60], rows[60:])):
            url = f"{s3_bucket}/hub@{sha}/sample/train-{i}.parquet"
            with storage.AtomicFile(url) as f:
                pq.write_table(pa.Table.from_pylist(part), f, row_group_size=20)
            files[sha].append(url)
    state = {"main": SHA_A, "calls": []}

    def hub_files(hub, revision=None):
        state["calls"].append((hub, revision))
        sha = revision or state["main"]
        return sha, files[sha]

    monkeypatch.setattr(sources, "hub_files", hub_files)
    state["rows"] = rows
    return state


def test_row_group_shards_read_only_their_row_groups(fake_hub, monkeypatch):
    shards = plan_inputs(["hf:HuggingFaceFW/fineweb:sample-10BT"])
    assert [(s.start, s.stop) for s in shards] == [(0, 20), (20, 40), (40, 60), (0, 20), (20, 40)]
    assert all(f"hub@{SHA_A}" in s.uri and s.fmt == "parquet" for s in shards)
    assert len(fake_hub["calls"]) == 1  # the revision is resolved once

    read = []
    original = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile, "read_row_group", lambda self, i, **kw: read.append(i) or original(self, i, **kw)
    )
    texts = [t for b in DocumentReader(shards[1]) for t in b.column("text").to_pylist()]
    assert read == [1] and texts == [r["text"] for r in fake_hub["rows"][20:40]]

    coarse = plan_inputs(["hf:HuggingFaceFW/fineweb:sample-10BT"], shard_docs=40)  # whole row groups
    assert [(s.start, s.stop) for s in coarse] == [(0, 40), (40, 60), (0, 40)]


def test_the_revision_is_recorded_and_a_new_upstream_revision_is_refused(fake_hub, tmp_path, tokenizer_dir):
    out = tmp_path / "tok"
    spec = "hf:HuggingFaceFW/fineweb:sample-10BT"
    stage = TokenizeStage([spec], str(tokenizer_dir), n_ctx=64, overflow="truncate")
    summary = run_stage(stage, out, progress=False)
    assert summary.docs_in == 100 and summary.shards_run == 5
    assert stage.config()["hub_revisions"] == {spec: SHA_A}
    assert all(f"@{SHA_A}/" in m.inputs[0].uri for m in read_manifests(out))

    fake_hub["main"] = SHA_B  # upstream moved on
    args = [
        "tokenize",
        spec,
        "--tokenizer",
        str(tokenizer_dir),
        "--n-ctx",
        "64",
        "--overflow",
        "truncate",
        "--out",
        str(out),
    ]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, res.output
    assert SHA_A in res.output and SHA_B in res.output and "Traceback" not in res.output
    pinned = CliRunner().invoke(main, [*args, "--revision", SHA_A])
    assert pinned.exit_code == 0 and "nothing to do" in pinned.output
