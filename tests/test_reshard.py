"""A rerun with another shard size (`--shard-docs`) never leaves a document in two shards: a source
planned as row ranges (parquet) is refused, nothing touched, and re-cut with --overwrite; a streamed
one (JSON lines) keeps the shards it has and cuts new ones at the new size. Either way the output
holds every input document once."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from entroweight.pipelines import StageError, run_stage
from entroweight.pipelines.stage import preview_run, read_manifests
from entroweight.pipelines.tokenize import TokenizeStage

N_DOCS = 120


@pytest.fixture(scope="module")
def sources(tmp_path_factory, c4_path):
    with gzip.open(c4_path, "rt") as f:
        texts = [json.loads(line)["text"] for line, _ in zip(f, range(N_DOCS), strict=False)]
    d = tmp_path_factory.mktemp("src")
    pq.write_table(pa.table({"text": texts}), d / "a.parquet", row_group_size=10)
    (d / "a.json.gz").write_bytes(
        gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode())
    )
    return {"parquet": d / "a.parquet", "jsonl": d / "a.json.gz"}


def _docs_once(out) -> None:
    manifests = read_manifests(out)
    assert sum(m.docs_in for m in manifests) == N_DOCS
    ranges = sorted((i.start, i.stop) for m in manifests for i in m.inputs)
    for (_, stop), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert stop == start  # consecutive, none overlapping
    written = {p.name for p in out.glob("part-*.parquet")}
    assert written == {m.output for m in manifests}  # no shard left beside them


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_rerun_with_another_shard_size_keeps_every_document_once(tmp_path, sources, tokenizer_dir, fmt):
    out = tmp_path / "out"

    def run(shard_docs, overwrite=False):
        stage = TokenizeStage([str(sources[fmt])], str(tokenizer_dir), n_ctx=32, shard_docs=shard_docs)
        return run_stage(stage, out, progress=False, overwrite=overwrite)

    run(50)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    if fmt == "parquet":
        with pytest.raises(StageError, match=r"cut at other rows.*--shard-docs.*--overwrite"):
            run(20)
        # a dry run says the same before the run refuses
        stage = TokenizeStage([str(sources[fmt])], str(tokenizer_dir), n_ctx=32, shard_docs=20)
        with pytest.raises(StageError, match="cut at other rows") as refused:
            preview_run(stage, out)
        with pytest.raises(StageError) as run_refused:
            run(20)
        assert str(refused.value) == str(run_refused.value)  # the preview refuses in the run's words
        assert (
            "cut at other rows (--shard-docs): --overwrite re-cuts them" in preview_run(stage, out, True)[1]
        )
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing touched
        run(20, overwrite=True)
        assert {(i.stop - i.start) for m in read_manifests(out) for i in m.inputs} == {20}
    else:
        summary = run(20)
        assert summary.shards_run == 0  # the shards it has are the same documents, and it says so
        assert "kept shards of 50 rows each" in summary.line() and "applies to new shards" in summary.line()
        assert "--overwrite" not in summary.line()  # which would not re-cut them: it is not advised
    _docs_once(out)
