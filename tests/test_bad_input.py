"""Bad input, one test per case of issue 10: each ends in a clear error or a counted reject, and
nothing is lost (documents in = written + rejected, read from the manifests; `verify_dir` passes, or
names exactly the shard that failed).

Already covered elsewhere (not repeated): the reject reasons together in one file and bad hub ids
(test_tokenize), a truncated .gz on every engine (test_engines), the trainer reader's NaN / >1 /
short weight refusals (test_reader), a wrong-tokenizer trainer run (test_trainer).
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from click.testing import CliRunner
from model_free import IdMod

from entroweight.pipelines import StageFailed, run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.stage import read_manifests
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.pipelines.verify import verify_dir
from entroweight.scorers import register
from entroweight.transforms.tokenizer import load_tokenizer
from entroweight.workflows.cli.main import main

N_CTX = 64
GOOD = "A good document about the weather in the hills."


def jsonl(path, rows, raw_tail: bytes = b""):
    path.write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode() + raw_tail)
    return path


def tokenize(tmp_path, sources, tokenizer_dir, name="out", **kw):
    """Run the tokenize stage, check the accounting through the manifests, and verify the directory."""
    out = tmp_path / name
    stage = TokenizeStage([str(s) for s in sources], str(tokenizer_dir), **{"n_ctx": N_CTX, **kw})
    summary = run_stage(stage, out, progress=False)
    ms = read_manifests(out)
    assert sum(m.docs_in for m in ms) == sum(m.docs_out + m.n_rejected for m in ms) == summary.docs_in
    assert verify_dir(out) == []
    return summary, out


def rows_of(out):
    return pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))]).to_pylist()


def rejected(out) -> dict[str, int]:
    total: dict[str, int] = {}
    for m in read_manifests(out):
        for k, v in m.rejected.items():
            total[k] = total.get(k, 0) + v
    return total


def real_bytes(tok, row) -> bytes:
    return tok.decode_bytes(row["input_ids"][row["n_pad"] :])


# ---------------------------------------------------------------- text content


def test_empty_documents(tmp_path, tokenizer_dir):
    src = jsonl(tmp_path / "in.jsonl", [{"text": ""}, {"text": GOOD}, {"text": "", "id": "e2"}])
    s, out = tokenize(tmp_path, [src], tokenizer_dir)
    assert (s.docs_in, s.rows_out, rejected(out)) == (3, 1, {"empty": 2})
    assert {r["id"] for r in pq.read_table(out / ".rejects/part-00000.parquet").to_pylist()} >= {"e2"}


def test_whitespace_only_documents(tmp_path, tokenizer_dir):
    # whitespace, and invisible format characters (zero-width space, BOM, ZWJ, a bidi mark): no text
    blank = [" \n\t ", "\u00a0\u2003\u3000", "\u200b\u200b", "\ufeff", " \u200d\u200e\n"]
    # ... combining marks and variation selectors with no base, control characters, Hangul fillers,
    # the Braille blank
    blank += ["\u0301\u0308", "\ufe0f\u034f", "\x00\x01", "\u3164\uffa0", "\u2800\u2800"]
    # a visible character among them keeps the document (an emoji sequence joined by ZWJ is text;
    # so is a letter with its combining mark, and a Braille letter)
    kept = [GOOD, "\u200bword", "\U0001f469\u200d\U0001f4bb", "e\u0301", "\u2801"]
    src = jsonl(tmp_path / "in.jsonl", [{"text": t} for t in blank + kept])
    s, out = tokenize(tmp_path, [src], tokenizer_dir)
    assert (s.rows_out, rejected(out)) == (len(kept), {"empty": len(blank)})


def test_invalid_utf8_bytes_jsonl_and_parquet(tmp_path, tokenizer_dir):
    src = jsonl(tmp_path / "in.jsonl", [{"text": GOOD}], raw_tail=b'{"text": "caf\xe9 latin-1"}\n')
    # a parquet with a binary text column: valid UTF-8 decodes and is kept, the rest is rejected
    table = pa.table({"id": ["b1", "b2"], "text": pa.array([GOOD.encode(), b"\xff\xfe bad"], pa.binary())})
    pq.write_table(table, tmp_path / "bin.parquet")
    s, out = tokenize(tmp_path, [src, tmp_path / "bin.parquet"], tokenizer_dir)
    assert (s.docs_in, s.rows_out, rejected(out)) == (4, 2, {"invalid_utf8": 2})


def test_lone_surrogates(tmp_path, tokenizer_dir):
    lines = (
        '{"text": "lone \\ud800 high"}\n{"text": "lone \\udfff low"}\n' + json.dumps({"text": GOOD}) + "\n"
    )
    (tmp_path / "in.jsonl").write_text(lines)
    # a valid pair of escapes is one emoji, not a reject
    (tmp_path / "pair.jsonl").write_text('{"text": "pair \\ud83c\\udf89 ok"}\n')
    s, out = tokenize(tmp_path, [tmp_path / "in.jsonl", tmp_path / "pair.jsonl"], tokenizer_dir)
    assert (s.rows_out, rejected(out)) == (2, {"invalid_utf8": 2})
    tok = load_tokenizer(tokenizer_dir)
    assert real_bytes(tok, rows_of(out)[-1]) == "pair 🎉 ok".encode()


def test_nul_bytes_are_text_and_round_trip(tmp_path, tokenizer_dir):
    """NUL is valid UTF-8: kept in text, and its bytes come back exactly. A document of control
    characters alone shows nothing: rejected as empty (sources.is_blank)."""
    texts = ["before\x00after", "tab\tnul\x00bell\x07"]
    src = jsonl(tmp_path / "in.jsonl", [{"text": t} for t in [*texts, "\x00\x00\x00"]])
    s, out = tokenize(tmp_path, [src], tokenizer_dir)
    tok = load_tokenizer(tokenizer_dir)
    assert s.rows_out == 2 and rejected(out) == {"empty": 1}
    assert [real_bytes(tok, r) for r in rows_of(out)] == [t.encode() for t in texts]


def test_50mb_document_is_cut_before_encoding(tmp_path, tokenizer_dir, monkeypatch):
    """Left padding keeps n_ctx tokens: the text is cut to a character budget before the tokenizer
    sees it, so 50 MB never becomes a list of millions of ids."""
    from entroweight.transforms import tokenize as tk

    cuts = []
    real_cut = tk._cut
    monkeypatch.setattr(
        tk, "_cut", lambda text, budget: cuts.append((len(text), budget)) or real_cut(text, budget)
    )
    big = "the quick brown fox jumps over the lazy dog " * (50_000_000 // 44 + 1)
    src = jsonl(tmp_path / "in.jsonl", [{"text": big}, {"text": GOOD}])
    s, out = tokenize(tmp_path, [src], tokenizer_dir, overflow="truncate")
    assert cuts and cuts[0][0] >= 50_000_000 and cuts[0][1] < 100_000
    rows = rows_of(out)
    tok = load_tokenizer(tokenizer_dir)
    assert rows[0]["n_pad"] == 0 and len(rows[0]["input_ids"]) == N_CTX
    assert big.encode().startswith(real_bytes(tok, rows[0]))
    assert rows[0]["input_ids"] == tok.tokenizer.encode(big[:5000], add_special_tokens=False).ids[:N_CTX]
    assert read_manifests(out)[0].extra["n_truncated"] == 1


@pytest.mark.parametrize("char", ["a", " ", "é", "🎉"])
def test_one_repeated_character(tmp_path, tokenizer_dir, char):
    tok = load_tokenizer(tokenizer_dir)
    long, short = char * 200_000, char * 100
    src = jsonl(tmp_path / "in.jsonl", [{"text": long}, {"text": short}])
    if char == " ":  # whitespace only: a counted reject, not a row of nothing
        s, out = tokenize(tmp_path, [src], tokenizer_dir)
        assert rejected(out) == {"empty": 2}
        return
    s, out = tokenize(tmp_path, [src], tokenizer_dir, n_ctx=1024, overflow="truncate")
    first, second = rows_of(out)
    assert first["n_pad"] == 0 and long.encode().startswith(real_bytes(tok, first))
    assert real_bytes(tok, second) == short.encode() and second["n_bytes"] == len(short.encode())


def test_mixed_scripts_and_emoji_round_trip(tmp_path, tokenizer_dir):
    texts = [
        "English, Русский, Ελληνικά, العربية, עברית, हिन्दी, தமிழ், ไทย, 한국어, 日本語, 中文.",
        "Emoji: 👩‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 👍🏽 ✋🏿 1️⃣ — combining: e\u0301 a\u0308 n\u0303",
        "RTL mark \u200f mixed \u202eoverride\u202c zero-width\u200bspace, BOM \ufeff, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈",
    ]
    src = jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    s, out = tokenize(tmp_path, [src], tokenizer_dir, n_ctx=1024)
    tok = load_tokenizer(tokenizer_dir)
    rows = rows_of(out)
    assert [real_bytes(tok, r) for r in rows] == [t.encode() for t in texts]
    assert [r["n_bytes"] for r in rows] == [len(t.encode()) for t in texts]


# ---------------------------------------------------------------- columns and ids


def test_missing_text_column(tmp_path, tokenizer_dir):
    # jsonl rows without text (or a null one): counted rejects
    src = jsonl(tmp_path / "in.jsonl", [{"url": "u"}, {"text": None}, {"content": GOOD}, {"text": GOOD}])
    s, out = tokenize(tmp_path, [src], tokenizer_dir)
    assert rejected(out) == {"missing_text": 3} and s.rows_out == 1
    # a parquet file without the column: its shard fails, naming the file and the option to pass
    pq.write_table(pa.table({"content": [GOOD]}), tmp_path / "nocol.parquet")
    stage = TokenizeStage([str(src), str(tmp_path / "nocol.parquet")], str(tokenizer_dir), n_ctx=N_CTX)
    with pytest.raises(StageFailed, match="nocol.parquet has no 'text' column.*--text-column") as err:
        run_stage(stage, tmp_path / "out2", progress=False)
    assert [f.shard for f in err.value.failures] == ["part-00001"]
    # nothing silently missing: verify names the shard that did not complete
    problems = verify_dir(tmp_path / "out2")
    assert len(problems) == 1 and "part-00001" in problems[0] and "no manifest" in problems[0]
    # ...and --text-column reads it
    s, _ = tokenize(tmp_path, [tmp_path / "nocol.parquet"], tokenizer_dir, name="out3", text_column="content")
    assert s.rows_out == 1


def test_wrong_column_types(tmp_path, tokenizer_dir):
    rows = [
        {"text": 42},
        {"text": ["a", "list"]},
        {"text": {"a": 1}},
        {"text": True},
        {"text": GOOD, "id": 7},
    ]
    src = jsonl(tmp_path / "in.jsonl", rows)
    pq.write_table(pa.table({"text": pa.array([1, 2, 3], pa.int64())}), tmp_path / "ints.parquet")
    s, out = tokenize(tmp_path, [src, tmp_path / "ints.parquet"], tokenizer_dir)
    assert rejected(out) == {"not_string": 7} and s.rows_out == 1
    assert rows_of(out)[0]["doc_id"] == "7"  # an integer id becomes its string


def test_duplicate_ids_kept_or_rejected_and_counted(tmp_path, tokenizer_dir):
    rows = [{"id": "a", "text": GOOD}, {"id": "b", "text": "Other."}, {"id": "a", "text": "Same id again."}]
    rows += [{"text": GOOD}]  # no id: the text hash, which equals... nothing above (those have ids)
    rows += [{"text": GOOD}]  # the same text twice without ids: the same hash, a duplicate
    src = jsonl(tmp_path / "in.jsonl", rows)
    kept, out = tokenize(tmp_path, [src], tokenizer_dir, name="kept")
    assert kept.rows_out == 5 and read_manifests(out)[0].extra["duplicate_ids_kept"] == 2
    dropped, out = tokenize(tmp_path, [src], tokenizer_dir, name="dropped", reject_duplicates=True)
    assert dropped.rows_out == 3 and rejected(out) == {"duplicate_id": 2}
    assert read_manifests(out)[0].extra["duplicate_ids_kept"] == 0


# ---------------------------------------------------------------- files


@pytest.fixture
def c4_lines(c4_path):
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        return [next(f) for _ in range(60)]


@pytest.mark.parametrize("fmt", ["json.gz", "jsonl.zst", "parquet"])
def test_truncated_file_fails_its_shard_by_name(tmp_path, tokenizer_dir, c4_lines, fmt):
    blob = "".join(c4_lines).encode()
    (tmp_path / "good.jsonl").write_bytes(blob[: len(blob) // 3])
    path = tmp_path / f"cut.{fmt}"
    if fmt == "json.gz":
        data = gzip.compress(blob)
    elif fmt == "jsonl.zst":
        data = zstandard.ZstdCompressor().compress(blob)
    else:
        pq.write_table(pa.Table.from_pylist([json.loads(x) for x in c4_lines]), path)
        data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    stage = TokenizeStage([str(tmp_path / "good.jsonl"), str(path)], str(tokenizer_dir), n_ctx=N_CTX)
    with pytest.raises(StageFailed, match=f"cannot read .*cut.{fmt}") as err:
        run_stage(stage, tmp_path / "out", progress=False)
    (failed,) = err.value.failures
    assert failed.shard == "part-00001"
    problems = verify_dir(tmp_path / "out")
    assert len(problems) == 1 and "part-00001" in problems[0] and f"cut.{fmt}" in problems[0]


@pytest.mark.parametrize("name", ["z.jsonl", "z.json.gz", "z.jsonl.zst", "z.parquet"])
def test_zero_byte_file_fails_its_shard(tmp_path, tokenizer_dir, name):
    jsonl(tmp_path / "good.jsonl", [{"text": GOOD}])
    (tmp_path / name).write_bytes(b"")
    stage = TokenizeStage(
        [str(tmp_path / "good.jsonl"), str(tmp_path / name)], str(tokenizer_dir), n_ctx=N_CTX
    )
    with pytest.raises(StageFailed, match=f"{name}.*(is empty|0 bytes)") as e:
        run_stage(stage, tmp_path / "out", progress=False)
    assert "1 shard(s) failed; the others are done and kept" in str(e.value)
    assert [m.shard for m in read_manifests(tmp_path / "out")] == ["part-00000"]
    # alone, the failure is said as such: no "others" kept (there were none)
    alone = TokenizeStage([str(tmp_path / name)], str(tokenizer_dir), n_ctx=N_CTX)
    with pytest.raises(StageFailed, match="1 shard\\(s\\) failed; there were no others"):
        run_stage(alone, tmp_path / "alone", progress=False)


DOCS = [{"id": f"d{i}", "text": f"{GOOD} Number {i}."} for i in range(5)]
NOT_JSON_LINES = {  # name -> (the file's text, what the refusal says)
    "array, indented": (json.dumps(DOCS, indent=2), "is a JSON array, not JSON lines"),
    "array, one line": (json.dumps(DOCS), "is a JSON array, not JSON lines"),
    "array after a BOM and blank lines": ("\ufeff\n  \n" + json.dumps(DOCS, indent=1), "is a JSON array"),
    "one object, indented": (json.dumps(DOCS[0], indent=2), "is not JSON lines"),
    "lines of no object": ('hello\n42\n"text"\n', "is not JSON lines"),
}
COMPRESS = {"json": lambda b: b, "json.gz": gzip.compress, "jsonl.zst": zstandard.ZstdCompressor().compress}


@pytest.mark.parametrize("shard_docs", [None, 2])
@pytest.mark.parametrize("suffix", sorted(COMPRESS))
@pytest.mark.parametrize("shape", sorted(NOT_JSON_LINES))
def test_a_file_that_is_not_json_lines_fails_its_shard_by_name(
    tmp_path, tokenizer_dir, shape, suffix, shard_docs
):
    """Before: each line of a JSON array (or of a pretty-printed object) was a document rejected as
    `invalid_json`, and the run exited 0 ("202 docs in, 0 out"). Now the file's shard fails, naming it
    and what it is, while the others complete. With --shard-docs, shards of a short file's rejects may
    commit before its end is judged; a rerun, which resumes after them, judges the file from its first
    line again and fails it again: never exit 0, never a document of it written."""
    text, said = NOT_JSON_LINES[shape]
    good = jsonl(tmp_path / "good.jsonl", DOCS)
    bad = tmp_path / f"bad.{suffix}"
    bad.write_bytes(COMPRESS[suffix](text.encode()))
    stage = TokenizeStage([str(good), str(bad)], str(tokenizer_dir), n_ctx=N_CTX, shard_docs=shard_docs)
    for _ in range(2):  # the run, and its rerun
        with pytest.raises(StageFailed, match=f"bad.{suffix} {said}") as err:
            run_stage(stage, tmp_path / "out", progress=False)
        (failed,) = err.value.failures
        assert failed.shard.startswith("part-00001")
        ms = read_manifests(tmp_path / "out")
        assert sum(m.docs_out for m in ms if m.inputs[0].uri == str(bad)) == 0
        assert sum(m.docs_out for m in ms if m.inputs[0].uri == str(good)) == len(DOCS)


def test_json_lines_with_bad_lines_still_count_them_as_rejects(tmp_path, tokenizer_dir):
    """The check is of the file, not of a line: an object among the first 100 lines makes it JSON
    lines, its bad lines counted rejects, also when they fill whole shards; so does a first shard of
    bad lines only, and a first line that is not an object."""
    src = tmp_path / "mixed.jsonl"
    src.write_text("not json\n" * 3 + json.dumps(DOCS[0]) + "\n" + "[1, 2]\nnot json\n" * 3)
    s, out = tokenize(tmp_path, [src], tokenizer_dir, shard_docs=2)
    assert (s.docs_in, s.rows_out, rejected(out)) == (10, 1, {"invalid_json": 9})


def test_a_long_file_of_no_object_fails_at_its_100th_line(tmp_path, tokenizer_dir):
    src = tmp_path / "long.jsonl"
    src.write_text("not json\n" * 10_000)
    stage = TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX, shard_docs=1000)
    with pytest.raises(StageFailed, match="none of its first 100 non-blank line"):
        run_stage(stage, tmp_path / "out", progress=False)
    assert read_manifests(tmp_path / "out") == []  # judged before its first shard of 1000 committed


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_directory_with_no_matching_files(tmp_path, tokenizer_dir):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text(GOOD)
    (tmp_path / "src" / "data.csv").write_text("text\nhello\n")
    res = cli("tokenize", tmp_path / "src", "--tokenizer", tokenizer_dir, "--out", tmp_path / "out")
    assert res.exit_code == 2 and "holds no" in res.output and ".parquet" in res.output
    assert not (tmp_path / "out").exists()


def test_a_revision_with_no_hub_source_is_refused(tmp_path, tokenizer_dir, c4_path):
    """--revision pins hf: sources; given with local files alone it pinned nothing and was dropped."""
    out = tmp_path / "out"
    res = cli("tokenize", c4_path, "--tokenizer", tokenizer_dir, "--revision", "v1", "--out", out)
    assert res.exit_code == 2 and "--revision v1 applies to hf: sources only" in res.output, res.output
    assert not out.exists()


def test_glob_that_matches_nothing(tmp_path, tokenizer_dir):
    res = cli(
        "tokenize", str(tmp_path / "*.jsonl.zst"), "--tokenizer", tokenizer_dir, "--out", tmp_path / "o"
    )
    assert res.exit_code == 2 and "matches no file" in res.output


def test_tokenizer_file_that_does_not_parse(tmp_path, tokenizer_dir, c4_path):
    real = (tokenizer_dir / "tokenizer.json").read_text()
    for i, text in enumerate(["{not json", "{}", real[: len(real) // 2], ""]):
        d = tmp_path / f"tok{i}"
        d.mkdir()
        (d / "tokenizer.json").write_text(text)
        res = cli("tokenize", c4_path, "--tokenizer", d, "--out", tmp_path / f"out{i}")
        assert res.exit_code == 2, (text[:20], res.output)
        assert "tokenizer" in res.output and "Traceback" not in res.output
    res = cli("tokenize", c4_path, "--tokenizer", tmp_path / "missing", "--out", tmp_path / "o")
    assert res.exit_code == 2


# ---------------------------------------------------------------- weighted data


class Constant(IdMod):
    """A model-free scorer: entropy = id mod 5 (cheap, deterministic)."""

    name = "test_mod5"
    modulus = 5


register(Constant)


@pytest.fixture(scope="module")
def weighted(tmp_path_factory, c4_path, tokenizer_dir):
    src = tmp_path_factory.mktemp("wsrc") / "c4.jsonl"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        src.write_text("".join(next(f) for _ in range(24)) + json.dumps({"text": GOOD}) + "\n")
    tokens = tmp_path_factory.mktemp("wtokens")
    run_stage(TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX), tokens, progress=False)
    scored = tmp_path_factory.mktemp("wscored")
    run_stage(ScoreStage(tokens, "test_mod5"), scored, progress=False)
    assert verify_dir(tokens) == [] and verify_dir(scored) == []
    return tokens, scored


def corrupt_weights(scored, dst, fn):
    """A copy of `scored` whose weights went through fn(list of arrays) (manifest sha updated)."""
    import shutil

    from entroweight.transforms.writer import sha256_file

    shutil.copytree(scored, dst)
    f = dst / "part-00000.parquet"
    t = pq.read_table(f)
    w = fn([np.array(x, np.float16) for x in t["weight"].to_pylist()])
    t = t.set_column(t.schema.get_field_index("weight"), "weight", pa.array(w, pa.list_(pa.float16())))
    pq.write_table(t.replace_schema_metadata(pq.read_schema(f).metadata), f)
    m = json.loads((dst / ".part-00000.manifest.json").read_text())
    m["output_sha256"], m["output_bytes"] = sha256_file(f), f.stat().st_size  # still committed
    (dst / ".part-00000.manifest.json").write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize(
    "case, reader_match, verify_match",
    [
        ("short", "differ in length", "weight lists not of length"),
        ("nan", "found NaN", "NaN or infinite"),
        ("above", r"\[0, 1\]", "outside [0, 1]"),
        ("negative", r"\[0, 1\]", "outside [0, 1]"),
    ],
)
def test_bad_weighted_parquet_is_refused_by_reader_and_verify(
    weighted, tmp_path, case, reader_match, verify_match
):
    from entroweight.trainers.data import DataError, WeightedTokens

    def fn(rows):
        r = rows[-1]  # the short document: it has pads
        if case == "short":
            rows[-1] = r[:-1]
        else:
            r[-1] = {"nan": np.nan, "above": 1.5, "negative": -0.5}[case]
        return rows

    d = corrupt_weights(weighted[1], tmp_path / case, fn)
    with pytest.raises(DataError, match=reader_match):
        list(WeightedTokens(d, shuffle=False))
    problems = verify_dir(d)
    assert len(problems) == 1 and verify_match in problems[0] and "part-00000" in problems[0]


def test_weighted_data_of_another_tokenizer_fed_to_the_trainer(weighted, tmp_path, c4_path, llama3_tokenizer):
    from entroweight.transforms.train_tokenizer import corpus_texts, save_tokenizer, train_bpe

    other = tmp_path / "other_tok"
    save_tokenizer(train_bpe(corpus_texts([str(c4_path)], max_docs=100), 300, llama3_tokenizer), other)
    # the run's tokenizer is not the data's: refused before training, exit 2
    res = cli("train", weighted[1], "--tokenizer", other, "--out", tmp_path / "ckpt", "--steps", 1)
    assert res.exit_code == 2 and "re-tokenize" in res.output
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()
    # two datasets of different tokenizers in one run: refused
    src = jsonl(tmp_path / "in.jsonl", [{"text": GOOD}] * 3)
    run_stage(TokenizeStage([str(src)], str(other), n_ctx=N_CTX), tmp_path / "other_tokens", progress=False)
    res = cli("train", weighted[0], tmp_path / "other_tokens", "--out", tmp_path / "ckpt2", "--steps", 1)
    assert res.exit_code == 2 and "tokenizer (sha256) differs" in res.output  # the field, both values
    assert "other_tokens" in res.output and "wtokens" in res.output


def test_workflow_yaml_with_unknown_keys(tmp_path):
    from entroweight.workflows.spec import SpecError, load_workflow

    text = (
        "run_dir: runs/x\nsources: [a.jsonl]\ntokenizer: {train: {vocab_size: 300}}\n"
        "tokenize: {n_ctx: 64, shard_dox: 40}\nscorres: []\n"
    )
    (tmp_path / "wf.yaml").write_text(text)
    with pytest.raises(SpecError) as err:
        load_workflow(tmp_path / "wf.yaml")
    msg = str(err.value)
    assert "tokenize.shard_dox" in msg and "scorres" in msg and "unknown key" in msg
    res = cli("run", tmp_path / "wf.yaml")
    assert res.exit_code == 2 and "shard_dox" in res.output


@pytest.mark.parametrize(
    "command", sorted(n for n, c in main.commands.items() if any(p.name == "wait" for p in c.params))
)
def test_a_negative_wait_is_refused_by_every_command_that_waits(tmp_path, command):
    """`--wait` is seconds to wait for another run's lock: a negative one is a usage error (exit 2)
    before any output, for every command that has it."""
    out = tmp_path / "out"
    takes_out = any(p.name == "out" for p in main.commands[command].params)
    res = CliRunner().invoke(
        main, [command, "--wait", "-1", str(tmp_path / "x"), *(["--out", str(out)] if takes_out else [])]
    )
    assert res.exit_code == 2, res.output
    assert "--wait" in res.output and "Traceback" not in res.output
    assert not out.exists()
