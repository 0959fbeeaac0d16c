"""Issue 15 item 11: no silent truncation. With `--overflow split` (the default) a document longer
than n_ctx continues in the next rows, so every byte of text is in the data; `--overflow truncate`
(the write-up's layout) says what it dropped in the summary, `inspect` and the workflow report.
All on real C4 documents, most of which are longer than the small n_ctx used here."""

from __future__ import annotations

import gzip
import itertools
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from model_free import IdMod

from entroweight.pipelines import run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.stage import read_manifests
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.pipelines.verify import verify_dir
from entroweight.scorers import register
from entroweight.trainers.data import WeightedTokens
from entroweight.transforms.inspect import summarize
from entroweight.transforms.tokenizer import load_tokenizer
from entroweight.workflows.spec import TokenizeSpec

N_CTX = 64
N_DOCS = 40


@pytest.fixture(scope="module")
def c4_docs(tmp_path_factory, c4_path):
    src = tmp_path_factory.mktemp("c4src") / "c4.jsonl"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = list(itertools.islice(f, N_DOCS))
    src.write_text("".join(lines))
    return src, [json.loads(line)["text"] for line in lines]


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory, c4_docs, tokenizer_dir):
    src, _ = c4_docs
    out = tmp_path_factory.mktemp("split")
    summary = run_stage(
        TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX, shard_docs=15), out, progress=False
    )
    return summary, out


def rows(out) -> list[dict]:
    return pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))]).to_pylist()


def test_split_keeps_every_byte_and_reassembles_each_document(split_dir, c4_docs, tokenizer_dir):
    summary, out = split_dir
    _, texts = c4_docs
    tok = load_tokenizer(tokenizer_dir)
    table = rows(out)
    assert summary.docs_in == N_DOCS and summary.truncated == 0 and "truncated" not in summary.line()
    assert summary.rows_out == len(table) > N_DOCS  # most C4 documents are longer than 64 tokens
    # rows of one document are consecutive and in order; only its last piece carries pads
    pieces: dict[str, list[dict]] = {}
    for row in table:
        pieces.setdefault(row["doc_id"], []).append(row)
    assert len(pieces) == N_DOCS
    by_text = {}
    for parts in pieces.values():
        assert all(p["n_pad"] == 0 for p in parts[:-1])
        assert [p["row_in_doc"] for p in parts] == list(range(len(parts)))  # each row's place in its document
        assert all(i == tok.pad_id for i in parts[-1]["input_ids"][: parts[-1]["n_pad"]])
        ids = [i for p in parts for i in p["input_ids"][p["n_pad"] :]]
        data = tok.decode_bytes(ids)
        assert sum(p["n_bytes"] for p in parts) == len(data)  # BPB counts every byte once
        by_text[data] = parts
    assert set(by_text) == {t.encode("utf-8") for t in texts}  # byte-exact round trip, nothing lost
    assert sum(r["n_bytes"] for r in table) == sum(len(t.encode()) for t in texts)
    assert verify_dir(out) == []


def test_truncate_counts_what_it_drops_everywhere(tmp_path, c4_docs, tokenizer_dir):
    src, texts = c4_docs
    out = tmp_path / "cut"
    summary = run_stage(
        TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX, overflow="truncate"), out, progress=False
    )
    table = rows(out)
    assert len(table) == N_DOCS
    kept = sum(r["n_bytes"] for r in table)
    total = sum(len(t.encode()) for t in texts)
    cut = sum(r["n_pad"] == 0 and r["n_bytes"] < len(t.encode()) for r, t in zip(table, texts, strict=True))
    assert cut > N_DOCS // 2 and summary.truncated == cut
    assert summary.bytes_dropped == total - kept > 0
    assert f"{cut} docs truncated, {total - kept} bytes of text dropped" in summary.line()
    info = summarize(out)
    assert info["truncated_docs"] == cut and info["bytes_dropped"] == total - kept
    assert verify_dir(out) == []


def test_truncate_shows_in_inspect_cli_and_split_does_not(tmp_path, split_dir, c4_docs, tokenizer_dir):
    src, _ = c4_docs
    base = [sys.executable, "-m", "entroweight.workflows.cli.main"]
    out = tmp_path / "cut"
    res = subprocess.run(
        [*base, "tokenize", str(src), "--tokenizer", str(tokenizer_dir), "--n-ctx", str(N_CTX)]
        + ["--overflow", "truncate", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "docs truncated" in res.stdout and "bytes of text dropped" in res.stdout
    shown = subprocess.run([*base, "inspect", str(out)], capture_output=True, text=True, check=True).stdout
    assert "truncated_docs" in shown and "bytes_dropped" in shown
    shown = subprocess.run([*base, "inspect", str(split_dir[1])], capture_output=True, text=True).stdout
    assert "truncated_docs" not in shown


def test_pack_with_truncate_is_refused_and_pack_is_unchanged(tmp_path, c4_docs, tokenizer_dir):
    src, texts = c4_docs
    with pytest.raises(ValueError, match="does not apply to --pack"):
        TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX, pack=True, overflow="truncate")
    stage = TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX, pack=True)
    assert "overflow" not in stage.config()  # packed data keeps its config hash
    summary = run_stage(stage, tmp_path / "packed", progress=False)
    assert summary.truncated == 0
    assert sum(r["n_bytes"] for r in rows(tmp_path / "packed")) == sum(len(t.encode()) for t in texts)


def test_workflow_spec_takes_overflow():
    assert TokenizeSpec().overflow == "split"
    assert TokenizeSpec(overflow="truncate").overflow == "truncate"
    with pytest.raises(ValueError):
        TokenizeSpec(overflow="drop")


class Mod7(IdMod):
    """A model-free scorer (entropy = id mod 7): scoring split rows needs no model to test."""

    name = "test_overflow_mod7"


register(Mod7)


def test_split_rows_score_verify_and_train(tmp_path, split_dir):
    """Split rows are ordinary rows: they score, verify, and the trainer's reader masks their pads."""
    summary, tokens = split_dir
    scored = tmp_path / "scored"
    run_stage(ScoreStage(tokens, "test_overflow_mod7"), scored, progress=False)
    assert verify_dir(scored) == []
    ds = WeightedTokens(scored, shuffle=False, require=("weight",))
    items = list(ds)
    assert len(items) == summary.rows_out
    assert sum(int(i["mask"].sum()) for i in items) == sum(m.n_real_tokens for m in read_manifests(tokens))
