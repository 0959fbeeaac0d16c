"""The foundation: source readers, column maps, hub ids, tokenizer training, the tokenize stage."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from entroweight.pipelines import StageError, run_stage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.schemas import METADATA_KEY, read_file_metadata
from entroweight.transforms import sources
from entroweight.transforms.sources import DocumentReader, SourceError, parse_hub_id, plan_inputs
from entroweight.transforms.tokenizer import load_tokenizer
from entroweight.transforms.train_tokenizer import corpus_texts, train_bpe

C4_DOCS = 1000


def c4_rows(c4_path, n=None):
    with gzip.open(c4_path, "rt") as f:
        rows = [json.loads(line) for line in f]
    return rows[:n] if n else rows


def read_dir(path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(path.glob("part-*.parquet"))])


def tokenize(tmp_path, inputs, tokenizer_dir, name="out", **kw):
    stage = TokenizeStage([str(i) for i in inputs], str(tokenizer_dir), **{"n_ctx": 64, **kw})
    return run_stage(stage, tmp_path / name, progress=False), tmp_path / name


# ---------------------------------------------------------------- readers and column maps


@pytest.fixture(scope="module")
def c4_formats(tmp_path_factory, c4_path):
    """The first 120 C4 documents as jsonl, json.gz, jsonl.zst and parquet."""
    rows = c4_rows(c4_path, 120)
    d = tmp_path_factory.mktemp("formats")
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (d / "a.jsonl").write_bytes(lines)
    (d / "b.json.gz").write_bytes(gzip.compress(lines))
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.Table.from_pylist(rows), d / "d.parquet", row_group_size=50)
    return d, rows


@pytest.mark.parametrize("name", ["a.jsonl", "b.json.gz", "c.jsonl.zst", "d.parquet"])
def test_every_format_reads_the_same_documents(c4_formats, name):
    d, rows = c4_formats
    docs = []
    for shard in plan_inputs([str(d / name)]):
        docs += [b for batch in DocumentReader(shard) for b in batch.to_pylist()]
    assert [x["text"] for x in docs] == [r["text"] for r in rows]
    assert [x["url"] for x in docs] == [r["url"] for r in rows]
    # C4 has no id: a stable hash of the text
    assert docs[0]["id"] == sources.text_id(rows[0]["text"]) and len({x["id"] for x in docs}) == len(rows)


@pytest.mark.parametrize("name", ["a.jsonl", "b.json.gz", "c.jsonl.zst", "d.parquet"])
def test_large_files_split_into_shards_without_gaps(c4_formats, name):
    """Parquet is planned by row groups from its footer; JSON lines, whose rows cannot be counted
    without reading them, is one input cut as it is read: the same shards either way."""
    d, rows = c4_formats
    shards = plan_inputs([str(d / name)], shard_docs=50)
    if name.endswith(".parquet"):
        assert [(s.start, s.stop) for s in shards] == [(0, 50), (50, 100), (100, 120)]
        pieces = [p for s in shards for p in DocumentReader(s).pieces()]
        end = 120
    else:
        assert [(s.start, s.stop) for s in shards] == [(0, None)]
        pieces = list(DocumentReader(shards[0]).pieces(every=50))
        end = None  # the last shard runs to the end of the file
    cuts = [(c.start, c.stop, c.docs_in, c.last) for c in pieces if isinstance(c, sources.Cut)]
    assert cuts[-1] == (100, end, 20, True)
    assert cuts[:-1] == [(0, 50, 50, name.endswith(".parquet")), (50, 100, 50, name.endswith(".parquet"))]
    texts = [t for b in pieces if isinstance(b, pa.RecordBatch) for t in b.column("text").to_pylist()]
    assert texts == [r["text"] for r in rows]


def test_directory_and_glob_sources(c4_formats):
    d, _ = c4_formats
    assert len(sources.expand_sources([str(d)])) == 4
    assert sources.expand_sources([str(d / "*.jsonl*")]) == [
        str((d / "a.jsonl").resolve()),
        str((d / "c.jsonl.zst").resolve()),
    ]
    with pytest.raises(SourceError, match="matches no file"):
        sources.expand_sources([str(d / "*.nothing")])
    with pytest.raises(SourceError, match="no such file"):
        sources.expand_sources([str(d / "missing.jsonl")])
    # a file:// URL names the local path, as it does for --tokenizer and --out
    for spec in (d, d / "*.jsonl*", d / "a.jsonl"):
        assert sources.expand_sources([f"file://{spec}"]) == sources.expand_sources([str(spec)])


def _named_like_a_glob(root, fs_open, rows) -> str:
    """`a[0:5].jsonl` holding `rows`, beside `a0.jsonl` and `a5.jsonl`, which the name read as a glob
    matches: JSON arrays, not JSON lines, so reading them fails instead of passing unnoticed."""
    for name in ("a0.jsonl", "a5.jsonl"):
        with fs_open(f"{root}/{name}") as f:
            f.write(b"[1, 2]\n")
    with fs_open(f"{root}/a[0:5].jsonl") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
    return f"{root}/a[0:5].jsonl"


@pytest.mark.parametrize("where", ["local", "memory://"])
def test_a_source_named_like_a_glob_is_read_as_itself(tmp_path, c4_path, where):
    """A path that exists as written is read as itself, whatever characters its name holds; a name
    that exists nowhere is still a glob."""
    if where == "local":
        root = str(tmp_path)
        spec = _named_like_a_glob(root, lambda p: open(p, "wb"), c4_rows(c4_path, 7))
    else:
        import fsspec

        root = f"memory://glob-names-{tmp_path.name}"
        spec = _named_like_a_glob(root, lambda p: fsspec.open(p, "wb"), c4_rows(c4_path, 7))
    (found,) = sources.expand_sources([spec])
    assert found.endswith(f"{tmp_path.name}/a[0:5].jsonl")
    docs = [d for shard in plan_inputs([spec]) for b in DocumentReader(shard) for d in b.to_pylist()]
    assert [d["text"] for d in docs] == [r["text"] for r in c4_rows(c4_path, 7)]
    assert len(sources.expand_sources([f"{root}/a[05].jsonl"])) == 2  # no such file: a glob


def test_every_command_reading_sources_reads_a_glob_named_file_as_itself(tmp_path, c4_path, tokenizer_dir):
    """The commands that take SOURCES (enumerated from the CLI) read `a[0:5].jsonl` as that file."""
    from click.testing import CliRunner

    from entroweight.workflows.cli.main import main

    spec = _named_like_a_glob(str(tmp_path), lambda p: open(p, "wb"), c4_rows(c4_path, 7))
    args = {
        "tokenize": ["--tokenizer", str(tokenizer_dir), "--n-ctx", "32", "--out", str(tmp_path / "tok")],
        "train-tokenizer": ["--vocab-size", "300", "--out", str(tmp_path / "tokenizer")],
    }
    readers = {n for n, c in main.commands.items() if any(p.name == "sources" for p in c.params)}
    assert readers == set(args)
    for name in sorted(readers):
        res = CliRunner().invoke(main, [name, spec, *args[name]])
        assert res.exit_code == 0, (name, res.output)
    manifest = json.loads(next((tmp_path / "tok").glob(".part-*.manifest.json")).read_text())
    assert manifest["docs_in"] == 7 and manifest["inputs"][0]["uri"].endswith("a[0:5].jsonl")


def test_fineweb_columns_map_onto_documents(tmp_path):
    rows = [
        {
            "id": "<urn:uuid:1>",
            "text": "Hello there.",
            "url": "http://a",
            "dump": "CC-MAIN-2024",
            "score": 3.1,
        },
        {
            "id": "<urn:uuid:2>",
            "text": "Second doc.",
            "url": "http://b",
            "dump": "CC-MAIN-2024",
            "score": 2.0,
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "fw.parquet")
    (shard,) = plan_inputs([str(tmp_path / "fw.parquet")])
    docs = [x for b in DocumentReader(shard) for x in b.to_pylist()]
    assert docs == [
        {"id": "<urn:uuid:1>", "text": "Hello there.", "source": "fw.parquet", "url": "http://a"},
        {"id": "<urn:uuid:2>", "text": "Second doc.", "source": "fw.parquet", "url": "http://b"},
    ]


@pytest.mark.parametrize(
    "spec, repo, config, split",
    [
        ("hf:HuggingFaceFW/fineweb:sample-10BT", "HuggingFaceFW/fineweb", "sample-10BT", "train"),
        ("hf:HuggingFaceFW/fineweb-edu:sample-10BT", "HuggingFaceFW/fineweb-edu", "sample-10BT", "train"),
        ("hf:allenai/c4:en", "allenai/c4", "en", "train"),
        ("hf:allenai/c4:en:validation", "allenai/c4", "en", "validation"),
        ("hf:owner/name", "owner/name", None, "train"),
    ],
)
def test_hub_ids_parse(spec, repo, config, split):
    hub = parse_hub_id(spec)
    assert (hub.repo, hub.config, hub.split) == (repo, config, split)


@pytest.mark.parametrize("bad", ["hf:", "hf:noslash", "hf:a/b:c:d:e", "hf:/x"])
def test_bad_hub_ids_are_refused(bad):
    with pytest.raises(SourceError, match="hub dataset id"):
        parse_hub_id(bad)


# ---------------------------------------------------------------- tokenizer


def test_train_tokenizer_is_deterministic_with_specials(c4_path, llama3_tokenizer):
    texts = list(corpus_texts([str(c4_path)], max_docs=200))
    a = train_bpe(texts, 600, llama3_tokenizer).to_str()
    b = train_bpe(texts, 600, llama3_tokenizer).to_str()
    assert a == b
    tok = train_bpe(texts, 600, llama3_tokenizer)
    assert tok.get_vocab_size() == 600
    assert [tok.token_to_id(s) for s in ("<|pad|>", "<|bos|>", "<|eos|>")] == [0, 1, 2]
    # Llama 3's pre-tokenizer: digits split in groups of at most three
    assert json.loads(a)["pre_tokenizer"] == json.loads(llama3_tokenizer.read_text())["pre_tokenizer"]


def test_cli_train_tokenizer(tmp_path, c4_path):
    out = tmp_path / "tok"
    cmd = [
        sys.executable,
        "-m",
        "entroweight.workflows.cli",
        "train-tokenizer",
        str(c4_path),
        "--vocab-size",
        "500",
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "500 tokens" in res.stdout
    tok = load_tokenizer(out)
    assert tok.vocab_size == 500 and (out / "tokenizer.sha256").read_text().startswith(tok.sha256)


def test_bad_tokenizer_file_is_refused(tmp_path, c4_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizers JSON"):
        TokenizeStage([str(c4_path)], str(tmp_path))


# ---------------------------------------------------------------- tokenize stage


def test_round_trip_is_byte_exact_on_c4_and_wikitext(tmp_path, tokenizer_dir, c4_path, wikitext_path):
    tok = load_tokenizer(tokenizer_dir)
    lines = [ln for ln in wikitext_path.read_text(encoding="utf-8").splitlines() if ln.strip()][:300]
    texts = [r["text"] for r in c4_rows(c4_path, 300)] + lines + ["Ünïcödé — 東京 🎉 naïve café ½"]
    assert any(not t.isascii() for t in texts)
    rows = [{"text": t} for t in texts]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, out = tokenize(tmp_path, [tmp_path / "in.jsonl"], tokenizer_dir, n_ctx=32768)
    table = read_dir(out)
    assert table.num_rows == len(texts)
    for text, ids, n_pad, n_bytes in zip(
        texts,
        table["input_ids"].to_pylist(),
        table["n_pad"].to_pylist(),
        table["n_bytes"].to_pylist(),
        strict=True,
    ):
        real = ids[n_pad:]
        assert all(i == tok.pad_id for i in ids[:n_pad])
        assert tok.decode_bytes(real) == text.encode("utf-8")
        assert n_bytes == len(text.encode("utf-8"))


@pytest.mark.parametrize("which", ["our BPE", "Llama 3"])
def test_decode_bytes_is_each_tokens_bytes_end_to_end(which, tokenizer_dir, llama3_tokenizer):
    """Whatever the length (short runs are joined, long ones gathered from one table) and whatever the
    ids (specials, which stand for no bytes, included), as a list, an array or a slice of one."""
    tok = load_tokenizer(tokenizer_dir if which == "our BPE" else llama3_tokenizer)
    tb = tok.token_bytes
    specials = [i for i in (tok.pad_id, tok.eos_id, tok.bos_id) if i is not None]
    assert specials and all(tb[i] == b"" for i in specials)
    rng = np.random.default_rng(0)
    for n in [0, 1, 2, 149, 150, 151, 700, 5000]:
        ids = rng.integers(0, tok.vocab_size, n)
        ids[rng.random(n) < 0.1] = specials[0]
        want = b"".join(tb[i] for i in ids.tolist())
        assert tok.decode_bytes(ids) == want and tok.decode_bytes(ids.tolist()) == want
        assert tok.decode_bytes(ids[::2]) == b"".join(tb[i] for i in ids[::2].tolist())
    assert tok.decode_bytes([specials[0]] * 300) == b""


def test_left_padding_and_truncation(tmp_path, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    short, long = "A short one.", "word " * 200
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": short}) + "\n" + json.dumps({"text": long}) + "\n")
    _, out = tokenize(tmp_path, [tmp_path / "in.jsonl"], tokenizer_dir, n_ctx=32)
    t = read_dir(out).to_pylist()
    full_short = tok.tokenizer.encode(short, add_special_tokens=False).ids
    assert t[0]["input_ids"] == [tok.pad_id] * (32 - len(full_short)) + full_short
    assert t[0]["n_pad"] == 32 - len(full_short)
    full_long = tok.tokenizer.encode(long, add_special_tokens=False).ids
    assert t[1]["input_ids"] == full_long[:32] and t[1]["n_pad"] == 0
    assert t[1]["n_bytes"] == len(tok.decode_bytes(full_long[:32]))
    assert pq.read_schema(out / "part-00000.parquet").field("input_ids").type == pa.list_(pa.uint16())


def test_packing_fills_windows_with_eos_between_documents(tmp_path, tokenizer_dir, c4_path):
    tok = load_tokenizer(tokenizer_dir)
    rows = c4_rows(c4_path, 30)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary, out = tokenize(tmp_path, [tmp_path / "in.jsonl"], tokenizer_dir, n_ctx=128, pack=True)
    table = read_dir(out)
    ids = np.asarray(table["input_ids"].to_pylist())
    n_pad = np.asarray(table["n_pad"].to_pylist())
    assert (n_pad[:-1] == 0).all() and 0 <= n_pad[-1] < 128  # only the last window is padded
    stream = np.concatenate([ids[:-1].reshape(-1), ids[-1, n_pad[-1] :]])
    expected = [
        i for r in rows for i in [*tok.tokenizer.encode(r["text"], add_special_tokens=False).ids, tok.eos_id]
    ]
    assert stream.tolist() == expected
    doc_ids = table["doc_ids"].to_pylist()
    assert [d for window in doc_ids for d in window][0] == sources.text_id(rows[0]["text"])
    assert {d for w in doc_ids for d in w} == {sources.text_id(r["text"]) for r in rows}
    assert summary.docs_in == 30 and summary.rows_out == len(ids)
    assert sum(table["n_bytes"].to_pylist()) == sum(len(r["text"].encode()) for r in rows)


def packed_row_in_doc(lengths: list[int], n: int, n_windows: int) -> list[int]:
    """For each window, how many windows before it hold part of its first document (from the stream)."""
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    out = []
    for w in range(n_windows):
        first_doc = int(np.searchsorted(starts, w * n, side="right")) - 1
        out.append(w - int(starts[first_doc]) // n)
    return out


@pytest.mark.parametrize("per_call", [1, 3, 30])
def test_row_in_doc_records_each_rows_place_in_its_document(tokenizer_dir, c4_path, per_call):
    """Split rows count 0, 1, 2... within their document; a packed window counts the windows before it
    holding part of its first document, across the builder's calls (documents pending between them).
    Two documents with one id stay two: the count restarts at 0."""
    from entroweight.transforms.tokenize import SequenceBuilder

    tok = load_tokenizer(tokenizer_dir)
    texts = [r["text"] for r in c4_rows(c4_path, 30)]
    docs = pa.record_batch({"id": ["same"] * len(texts), "text": texts})  # every id the same
    lengths = [len(tok.tokenizer.encode(t, add_special_tokens=False).ids) + 1 for t in texts]
    for pack in (False, True):
        b = SequenceBuilder(tok, 48, pack, "part-00000")
        batches = [x for i in range(0, len(texts), per_call) for x in b.add(docs.slice(i, per_call))]
        t = pa.Table.from_batches([*batches, *b.finish()])
        row_in_doc = t.column("row_in_doc").to_pylist()
        if pack:
            assert row_in_doc == packed_row_in_doc(lengths, 48, t.num_rows)
        else:
            pieces = [max(1, -(-(n - 1) // 48)) for n in lengths]
            assert row_in_doc == [i for k in pieces for i in range(k)]
        assert 0 < row_in_doc.count(0) and max(row_in_doc) > 0


def test_rejects_are_written_with_reasons_and_accounted(tmp_path, tokenizer_dir):
    lines = [
        json.dumps({"text": "good one"}),
        json.dumps({"text": ""}),
        json.dumps({"text": "   \n\t "}),
        json.dumps({"url": "no text"}),
        json.dumps({"text": 42}),
        json.dumps({"text": "lone \ud800 surrogate"}),
        "{this is not json",
        json.dumps({"text": "another good one", "id": "x1"}),
    ]
    raw = ("\n".join(lines) + "\n").encode() + b'{"text": "bad \xff bytes"}\n'
    (tmp_path / "in.jsonl").write_bytes(raw)
    summary, out = tokenize(tmp_path, [tmp_path / "in.jsonl"], tokenizer_dir)
    rejects = pq.read_table(out / ".rejects" / "part-00000.parquet").to_pylist()
    reasons = sorted(r["reason"] for r in rejects)
    assert reasons == sorted(
        ["empty", "empty", "missing_text", "not_string", "invalid_utf8", "invalid_json", "invalid_utf8"]
    )
    manifest = json.loads((out / ".part-00000.manifest.json").read_text())
    assert manifest["docs_in"] == 9 == manifest["docs_out"] + sum(manifest["rejected"].values())
    assert read_dir(out)["doc_id"].to_pylist()[1] == "x1"
    assert summary.docs_in == 9 and summary.rows_out == 2


def test_metadata_manifest_and_resume(tmp_path, tokenizer_dir, c4_path):
    rows = c4_rows(c4_path, 100)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, out = tokenize(tmp_path, [tmp_path / "in.jsonl"], tokenizer_dir, shard_docs=40)
    assert first.shards_run == 3
    meta = read_file_metadata(out / "part-00000-00001.parquet")
    tok = load_tokenizer(tokenizer_dir)
    for key in (
        "tokenizer_sha256",
        "vocab_size",
        "n_ctx",
        "padding_side",
        "pad_id",
        "config_hash",
        "code_version",
    ):
        assert key in meta
    assert meta["tokenizer_sha256"] == tok.sha256 and meta["n_ctx"] == 64 and meta["padding_side"] == "left"
    assert METADATA_KEY in pq.read_schema(out / "part-00000-00000.parquet").metadata
    manifest = json.loads((out / ".part-00000-00002.manifest.json").read_text())
    assert manifest["docs_out"] == 20 and manifest["rows_out"] >= 20  # long documents span rows
    assert manifest["config_hash"] == meta["config_hash"]
    from entroweight.transforms.writer import sha256_file

    assert manifest["output_sha256"] == sha256_file(out / "part-00000-00002.parquet")

    # a killed run leaves a temp file and misses a shard: the rerun resumes the file from that shard
    hashes = {p.name: sha256_file(p) for p in out.glob("part-*.parquet")}
    (out / ".part-00000-00001.manifest.json").unlink()
    (out / "part-00000-00001.parquet.tmp-deadbeef").write_bytes(b"partial")
    again, _ = tokenize(tmp_path, [tmp_path / "in.jsonl"], tokenizer_dir, shard_docs=40)
    assert (again.shards_run, again.shards_done_before) == (2, 1)
    assert not list(out.glob("*.tmp-*"))
    assert {p.name: sha256_file(p) for p in out.glob("part-*.parquet")} == hashes
    nothing, _ = tokenize(tmp_path, [tmp_path / "in.jsonl"], tokenizer_dir, shard_docs=40)
    assert nothing.shards_run == 0 and "nothing to do" in nothing.line()

    with pytest.raises(StageError, match="n_ctx: 64 -> 32"):
        tokenize(tmp_path, [tmp_path / "in.jsonl"], tokenizer_dir, shard_docs=40, n_ctx=32)


def test_output_loads_with_datasets(tokenized_dir):
    import datasets

    ds = datasets.load_dataset("parquet", data_dir=str(tokenized_dir), split="train")
    assert ds.num_rows == C4_DOCS and len(ds[0]["input_ids"]) == 128


def test_unreadable_file_fails_its_shard_and_names_it(tmp_path, tokenizer_dir, c4_path):
    good = tmp_path / "good.json.gz"
    good.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in c4_rows(c4_path, 20)).encode()))
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(good.read_bytes()[:-200])
    stage = TokenizeStage([str(good), str(bad)], str(tokenizer_dir), n_ctx=64)
    from entroweight.pipelines import StageFailed

    with pytest.raises(StageFailed, match="bad.json.gz") as err:
        run_stage(stage, tmp_path / "out", progress=False)
    assert len(err.value.failures) == 1
    assert (tmp_path / "out" / ".part-00000.manifest.json").exists()


def test_cli_tokenize_and_inspect(tmp_path, tokenizer_dir, c4_path):
    out = tmp_path / "tok"
    base = [sys.executable, "-m", "entroweight.workflows.cli.main"]
    cmd = [
        *base,
        "tokenize",
        str(c4_path),
        "--tokenizer",
        str(tokenizer_dir),
        "--n-ctx",
        "64",
        "--out",
        str(out),
        "--shard-docs",
        "500",
        "--overflow",
        "truncate",  # one row per document: rows == documents below
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "2 shard(s) run" in res.stdout and "1000 docs in" in res.stdout
    info = json.loads(
        subprocess.run(
            [*base, "inspect", str(out), "--json"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert info["rows"] == C4_DOCS and info["docs_in"] == C4_DOCS and info["metadata"]["n_ctx"] == 64
    assert info["docs_out"] + sum(info["rejected"].values()) == info["docs_in"]  # every document counted
    assert 0 < info["pad_fraction"] < 1 and info["id_range"][1] < 1024
    res = subprocess.run(
        [
            *base,
            "tokenize",
            str(tmp_path / "nope.jsonl"),
            "--tokenizer",
            str(tokenizer_dir),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "no such file" in res.stderr


# -- the width of a row


@pytest.mark.parametrize("front", ["tokenize", "run --dry-run", "run"])
@pytest.mark.parametrize("n_ctx", [-5, 0, 1, 2**20 + 1, 99_999_999_999])
def test_an_n_ctx_outside_its_bounds_is_refused_up_front(tmp_path, tokenizer_dir, c4_path, front, n_ctx):
    """Before: `--n-ctx 99999999999` failed its shard with a MemoryError traceback (a row of that many
    ids), after the run had started. Now every front end refuses it (exit 2, one line saying the bound,
    nothing written): n_ctx is from 2 to 2**20 (schemas/arrow.py MAX_N_CTX)."""
    from click.testing import CliRunner

    from entroweight.schemas.arrow import MAX_N_CTX
    from entroweight.workflows.cli.main import main

    out = tmp_path / "out"
    if front == "tokenize":
        argv = ["tokenize", str(c4_path), "--tokenizer", str(tokenizer_dir), "--n-ctx", str(n_ctx)]
        argv += ["--out", str(out)]
    else:
        wf = tmp_path / "wf.yaml"
        wf.write_text(
            f"run_dir: {out}\nsources: [{c4_path}]\ntokenizer: {{path: {tokenizer_dir}}}\n"
            f"tokenize: {{n_ctx: {n_ctx}}}\n"
        )
        argv = ["run", str(wf), *(["--dry-run"] if front.endswith("dry-run") else [])]
    r = CliRunner().invoke(main, argv)
    line = r.output.strip().splitlines()[-1]
    if n_ctx < 2 and front != "tokenize":  # the workflow's spec refuses it first, naming its key
        assert r.exit_code != 0 and "n_ctx" in r.output, r.output
    else:
        assert r.exit_code == 2 and f"{MAX_N_CTX:,}" in line and f"{n_ctx:,}" in line, r.output
    assert "Traceback" not in r.output and not out.exists()


def test_the_widest_row_is_taken(tokenizer_dir):
    from entroweight.schemas.arrow import MAX_N_CTX

    assert TokenizeStage(["x.jsonl"], str(tokenizer_dir), n_ctx=MAX_N_CTX).n_ctx == MAX_N_CTX
