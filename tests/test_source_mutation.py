"""Sources that change between a run and its rerun (issue 26, the second table-driven test): renamed,
moved, deleted, replaced, appended to, or given ids another document has. After the rerun of
`tokenize SOURCES_DIR --out OUT`, every document of the sources is in OUT exactly once (documents
found by `row_in_doc`, their text rebuilt from the tokens and compared as a multiset with the sources'
texts), or the rerun exits 2 before writing anything, naming the source that changed. The same for
`score` when a part of its tokenized input is gone.
"""

from __future__ import annotations

import collections
import gzip
import json
import shutil

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_path_rule import snapshot

from entroweight.schemas.datadir import DataDir
from entroweight.transforms.tokenizer import load_tokenizer
from entroweight.workflows.cli.main import main


def docs(c4_path, start, n, prefix):
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [json.loads(x) for _, x in zip(range(start + n), f, strict=False)][start:]
    return [{"id": f"{prefix}{i}", "text": r["text"][:400]} for i, r in enumerate(lines)]


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def source_texts(src) -> collections.Counter:
    out = collections.Counter()
    for f in sorted(src.rglob("*.jsonl")):
        out.update(json.loads(line)["text"] for line in f.read_text().splitlines())
    return out


def output_texts(out, tok) -> collections.Counter:
    """Each document of OUT's committed parts, rebuilt from its rows (a row_in_doc 0 row and the rows
    after it that continue it)."""
    texts = collections.Counter()
    for part in DataDir(out).parts:
        t = pq.read_table(part.location)
        ids, n_pad = t.column("input_ids").to_pylist(), t.column("n_pad").to_pylist()
        current: list[int] | None = None
        for row, pad, r in zip(ids, n_pad, t.column("row_in_doc").to_pylist(), strict=True):
            if r == 0:
                if current is not None:
                    texts[tok.decode_bytes(current).decode()] += 1
                current = []
            current += row[pad:]
        if current is not None:
            texts[tok.decode_bytes(current).decode()] += 1
    return texts


def mutate_rename(src):
    (src / "a.jsonl").rename(src / "c.jsonl")
    return "a.jsonl"


def mutate_move(src):
    (src / "sub").mkdir(exist_ok=True)
    shutil.move(src / "a.jsonl", src / "sub" / "a2.jsonl")
    return "a.jsonl"


def mutate_delete(src):
    (src / "b.jsonl").unlink()
    return "b.jsonl"


def mutate_replace(src, c4_path):
    write(src / "a.jsonl", docs(c4_path, 40, 5, "r"))
    return None


def mutate_append(src, c4_path):
    with (src / "a.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in docs(c4_path, 50, 4, "x"))
    return None


def mutate_duplicate_ids(src, c4_path):
    # a new file whose documents reuse b's ids (other texts): two documents each, both kept
    write(src / "d.jsonl", [{**r, "id": f"b{i}"} for i, r in enumerate(docs(c4_path, 60, 3, "_"))])
    return None


MUTATIONS = {
    "rename": mutate_rename,
    "move": mutate_move,
    "delete": mutate_delete,
    "replace": mutate_replace,
    "append": mutate_append,
    "duplicate_ids": mutate_duplicate_ids,
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_every_document_once_or_the_change_named(mutation, tmp_path, c4_path, tokenizer_dir):
    src, out = tmp_path / "src", tmp_path / "out"
    write(src / "a.jsonl", docs(c4_path, 0, 6, "a"))
    write(src / "b.jsonl", docs(c4_path, 10, 6, "b"))
    argv = ["tokenize", str(src), "--tokenizer", str(tokenizer_dir), "--n-ctx", "32", "--out", str(out)]
    assert CliRunner().invoke(main, argv).exit_code == 0
    fn = MUTATIONS[mutation]
    named = fn(src) if fn.__code__.co_argcount == 1 else fn(src, c4_path)
    before = snapshot(out)
    r = CliRunner().invoke(main, argv)
    if r.exit_code == 2:  # refused: the change named, nothing written
        assert named is not None and named in r.output and "Traceback" not in r.output, r.output
        assert snapshot(out) == before
        # --overwrite then makes the output this run's sources, each document once
        assert CliRunner().invoke(main, [*argv, "--overwrite"]).exit_code == 0
    else:
        assert r.exit_code == 0, r.output
    assert output_texts(out, load_tokenizer(tokenizer_dir)) == source_texts(src)


def test_score_refuses_shards_of_a_part_its_input_no_longer_holds(tmp_path, c4_path, tokenizer_dir):
    """The tokenized input lost a part (re-tokenized with --overwrite after a source was deleted):
    a rerun of score names the part instead of keeping its scored shard."""
    from test_score_stage import tiny_llama_dir

    src, tokens, scored = tmp_path / "src", tmp_path / "tokens", tmp_path / "scored"
    write(src / "a.jsonl", docs(c4_path, 0, 4, "a"))
    write(src / "b.jsonl", docs(c4_path, 10, 4, "b"))
    tok = ["tokenize", str(src), "--tokenizer", str(tokenizer_dir), "--n-ctx", "32", "--out", str(tokens)]
    assert CliRunner().invoke(main, tok).exit_code == 0
    model = tiny_llama_dir(tmp_path / "m", tokenizer_dir / "tokenizer.json")
    score = ["score", str(tokens), "--scorer", "causal_loss", "--model", str(model), "--out", str(scored)]
    assert CliRunner().invoke(main, score).exit_code == 0
    gone = DataDir(tokens).parts[1].location
    (src / "b.jsonl").unlink()
    assert CliRunner().invoke(main, [*tok, "--overwrite"]).exit_code == 0
    r = CliRunner().invoke(main, score)
    assert r.exit_code == 2 and gone in r.output, r.output
    assert CliRunner().invoke(main, [*score, "--overwrite"]).exit_code == 0
    assert sum(p.manifest.docs_out for p in DataDir(scored).parts) == 4


def test_score_overwrite_drops_the_parquet_of_a_shard_its_input_no_longer_holds(
    tmp_path, c4_path, tokenizer_dir
):
    """A source split into shards (--shard-docs) loses its last documents: score --overwrite drops the
    scored shard of the part that is gone, its parquet with its manifest (score names the file after
    its input's part, part-NNNNN-KKKKK, not after its own shard)."""
    from test_score_stage import tiny_llama_dir

    src, tokens, scored = tmp_path / "src", tmp_path / "tokens", tmp_path / "scored"
    write(src / "a.jsonl", docs(c4_path, 0, 6, "a"))
    tok = ["tokenize", str(src), "--tokenizer", str(tokenizer_dir), "--n-ctx", "32", "--shard-docs", "2"]
    assert CliRunner().invoke(main, [*tok, "--out", str(tokens)]).exit_code == 0
    model = tiny_llama_dir(tmp_path / "m", tokenizer_dir / "tokenizer.json")
    score = ["score", str(tokens), "--scorer", "causal_loss", "--model", str(model), "--out", str(scored)]
    assert CliRunner().invoke(main, score).exit_code == 0
    write(src / "a.jsonl", docs(c4_path, 0, 4, "a"))
    assert CliRunner().invoke(main, [*tok, "--out", str(tokens), "--overwrite"]).exit_code == 0
    assert CliRunner().invoke(main, score).exit_code == 2
    assert CliRunner().invoke(main, [*score, "--overwrite"]).exit_code == 0
    files = sorted(f.name for f in scored.glob("part-*.parquet"))
    assert files == sorted(p.manifest.output for p in DataDir(scored).parts)
    assert sum(p.manifest.docs_out for p in DataDir(scored).parts) == 4
