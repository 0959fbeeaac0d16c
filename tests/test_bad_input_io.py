"""Issue 15, sources and outputs: an --out among the inputs, bookkeeping read as documents,
--shard-docs 0, bad bytes in one field, BOMs, compressed files under the wrong name, a missing text
column, read-only outputs, unreachable hubs and Ray clusters, symlinked directories, Beam progress.

Each refusal exits 2 with a one-line message and no traceback, and leaves no --out behind; each
reject is counted and the other documents are kept. Real C4 documents throughout."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import zstandard
from click.testing import CliRunner
from model_free import IdMod

from entroweight.pipelines import StageError, StageFailed, run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.stage import read_manifests
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.pipelines.verify import verify_dir
from entroweight.scorers import register
from entroweight.transforms.writer import sha256_file
from entroweight.workflows.cli.main import main

N_CTX = 64


@pytest.fixture(scope="module")
def c4_lines(c4_path) -> list[str]:
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        return list(itertools.islice(f, 30))


def write(path, lines, mode="text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(lines).encode()
    path.write_bytes({"text": data, "gzip": gzip.compress(data), "zstd": zstandard.compress(data)}[mode])
    return path


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in res.output, res.output
    return res


def tokenize(sources, tokenizer_dir, out, **kw):
    stage = TokenizeStage([str(s) for s in sources], str(tokenizer_dir), **{"n_ctx": N_CTX, **kw})
    return run_stage(stage, out, progress=False)


def rejected(out) -> dict[str, int]:
    total: dict[str, int] = {}
    for m in read_manifests(out):
        for k, v in m.rejected.items():
            total[k] = total.get(k, 0) + v
    return total


def tree(path) -> dict[str, str]:
    return {str(p.relative_to(path)): sha256_file(p) for p in sorted(path.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- 1. --out among the inputs


class Mod3(IdMod):
    name = "test_io_mod3"
    modulus = 3


register(Mod3)


def test_score_out_equal_to_or_inside_its_input_is_refused_even_with_overwrite(
    tmp_path, c4_lines, tokenizer_dir
):
    tokens = tmp_path / "tokens"
    tokenize([write(tmp_path / "src" / "c4.jsonl", c4_lines)], tokenizer_dir, tokens)
    before = tree(tokens)
    for out in (tokens, tokens / "scored", tmp_path):
        with pytest.raises(StageError, match="--out .* (is|lies inside|holds) the input"):
            run_stage(ScoreStage(tokens, "test_io_mod3"), out, overwrite=True, progress=False)
    assert tree(tokens) == before and not (tokens / "scored").exists()
    assert verify_dir(tokens) == []


def test_tokenize_out_equal_to_or_inside_its_source_dir_is_refused(tmp_path, c4_lines, tokenizer_dir):
    src = tmp_path / "src"
    write(src / "c4.jsonl", c4_lines)
    before = tree(src)
    for out in (src, src / "tokens", tmp_path):
        res = cli("tokenize", src, "--tokenizer", tokenizer_dir, "--out", out, "--overwrite")
        assert res.exit_code == 2 and "which tokenize reads" in res.output
    assert tree(src) == before  # no .lock, no .stage.json, no tokens/


def test_sources_never_include_bookkeeping_or_stage_outputs(tmp_path, c4_lines, tokenizer_dir):
    """A directory holding documents and a stage's output (shards, manifests, a tokenizer copy):
    only the documents are read, however often it is tokenized again."""
    data = tmp_path / "data"
    write(data / "c4.jsonl", c4_lines[:20])
    tokenize([write(tmp_path / "other.jsonl", c4_lines[20:])], tokenizer_dir, data / "tokens")
    shutil.copy(tokenizer_dir / "tokenizer.json", data / "tokens" / "tokenizer.json")
    (data / ".hidden.jsonl").write_text(c4_lines[0])  # hidden: bookkeeping, never a source
    for run in range(2):
        s = tokenize([data], tokenizer_dir, tmp_path / "out")
        assert s.docs_in == 20 and rejected(tmp_path / "out") == {}, run
    res = cli("tokenize", data / "tokens", "--tokenizer", tokenizer_dir, "--out", tmp_path / "x")
    assert res.exit_code == 2 and "output of an entroweight stage" in res.output
    res = cli(
        "tokenize",
        data / "tokens" / "part-00000.parquet",
        "--tokenizer",
        tokenizer_dir,
        "--out",
        tmp_path / "x",
    )
    assert res.exit_code == 2 and not (tmp_path / "x").exists()


# ---------------------------------------------------------------- 3. --shard-docs


@pytest.mark.parametrize("n", ["0", "-1"])
def test_shard_docs_below_one_is_refused(tmp_path, c4_lines, tokenizer_dir, n):
    src = write(tmp_path / "c4.jsonl", c4_lines)
    res = cli("tokenize", src, "--tokenizer", tokenizer_dir, "--out", tmp_path / "out", "--shard-docs", n)
    assert res.exit_code == 2 and "--shard-docs must be at least 1" in res.output
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- 8. bytes


def test_invalid_utf8_in_url_rejects_only_that_document(tmp_path, c4_lines, tokenizer_dir):
    lines = [line.encode() for line in c4_lines[:10]]
    row = json.loads(c4_lines[3])
    bad = (
        json.dumps({"text": row["text"], "url": "URLMARK"}).encode().replace(b"URLMARK", b"http://x/\xff\xfe")
    )
    lines[3] = bad + b"\n"
    src = tmp_path / "c4.jsonl"
    src.write_bytes(b"".join(lines))
    s = tokenize([src], tokenizer_dir, tmp_path / "out")
    assert s.docs_in == 10 and rejected(tmp_path / "out") == {"invalid_utf8": 1}
    (m,) = read_manifests(tmp_path / "out")
    assert m.docs_out == 9
    assert verify_dir(tmp_path / "out") == []


def test_bom_does_not_reject_the_first_document(tmp_path, c4_lines, tokenizer_dir):
    src = tmp_path / "c4.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "".join(c4_lines[:5]).encode())
    s = tokenize([src], tokenizer_dir, tmp_path / "out")
    assert s.docs_in == 5 and rejected(tmp_path / "out") == {}


@pytest.mark.parametrize("mode", ["gzip", "zstd"])
def test_compressed_file_named_jsonl_is_read_by_its_magic(tmp_path, c4_lines, tokenizer_dir, mode):
    src = write(tmp_path / "c4.jsonl", c4_lines[:12], mode)
    s = tokenize([src], tokenizer_dir, tmp_path / "out", shard_docs=5)  # row counting reads it too
    assert s.docs_in == 12 and rejected(tmp_path / "out") == {}


# ---------------------------------------------------------------- 9. the text column


def test_all_rows_missing_text_fails_naming_the_fields(tmp_path, c4_lines, tokenizer_dir):
    rows = [json.loads(line) for line in c4_lines[:8]]
    src = tmp_path / "c4.jsonl"
    src.write_text("".join(json.dumps({"content": r["text"], "url": r["url"]}) + "\n" for r in rows))
    first = write(tmp_path / "a-first.jsonl", c4_lines[8:10])  # the file judged up front has the field
    for shard_docs in (1, 100):  # every shard judges the file alike
        res = cli("tokenize", first, src, "--tokenizer", tokenizer_dir, "--out", tmp_path / f"out{shard_docs}",
                  "--shard-docs", shard_docs)  # fmt: skip
        assert res.exit_code == 1, res.output
        assert "content" in res.output and "--text-column" in res.output
    s = tokenize([src], tokenizer_dir, tmp_path / "ok", text_column="content")
    assert s.docs_in == 8 and s.rejected == {}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_bad_row_is_one_reject_whatever_the_shard_size(tmp_path, c4_lines, tokenizer_dir, fmt):
    """A row without its text (another field, or null) and a line nested past the JSON decoder's
    depth are one reject each, the same at every --shard-docs: the text column is judged on the
    file, not on a shard (a shard of bad rows alone failed its file for good, and the documents
    after it were never read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in c4_lines[:20]]
    rows[3] = {"id": "no-text", "body": rows[3]["text"]}
    rows[7] = {"id": "null-text", "text": None}
    if fmt == "jsonl":
        lines = [json.dumps(r) + "\n" for r in rows]
        lines[11] = '{"id": "deep", "text": "x", "m": ' + "[" * 5000 + "]" * 5000 + "}\n"
        src = write(tmp_path / "c4.jsonl", lines)
        want = {"missing_text": 2, "invalid_json": 1}
    else:  # one row a row group: a shard of one bad row
        table = pa.table({"id": [r.get("id") for r in rows], "text": [r.get("text") for r in rows]})
        src = tmp_path / "c4.parquet"
        pq.write_table(table, src, row_group_size=1)
        want = {"missing_text": 2}
    kept = None
    for shard_docs in (1, 3, 100):
        out = tmp_path / f"out{shard_docs}"
        s = tokenize([src], tokenizer_dir, out, shard_docs=shard_docs)
        assert s.docs_in == 20 and rejected(out) == want, (shard_docs, rejected(out))
        ids = [r for f in sorted(out.glob("part-*.parquet")) for r in pq.read_table(f)["doc_id"].to_pylist()]
        kept = kept or ids
        assert ids == kept and len(set(ids)) == 20 - sum(want.values())


def test_train_tokenizer_refuses_zero_documents_and_takes_text_column(tmp_path, c4_lines):
    rows = [json.loads(line) for line in c4_lines]
    src = tmp_path / "c4.jsonl"
    src.write_text("".join(json.dumps({"body": r["text"]}) + "\n" for r in rows))
    res = cli("train-tokenizer", src, "--vocab-size", 300, "--out", tmp_path / "tok")
    assert res.exit_code == 2 and "body" in res.output and "--text-column" in res.output
    assert not (tmp_path / "tok").exists()
    res = cli("train-tokenizer", src, "--vocab-size", 300, "--text-column", "body", "--out", tmp_path / "tok")
    assert res.exit_code == 0 and (tmp_path / "tok" / "tokenizer.json").exists()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_wrong_text_column_is_one_refusal_in_every_command_that_reads_documents(
    tmp_path, c4_lines, tokenizer_dir, fmt
):
    """A --text-column no row of the first file has (a typo) is refused by tokenize as by
    train-tokenizer: exit 2, one line naming the fields found, nothing written. Before, tokenize
    failed every shard (exit 1, a report of failed shards)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in c4_lines]
    src = write(tmp_path / "c4.jsonl", c4_lines)
    if fmt == "parquet":
        src = tmp_path / "c4.parquet"
        pq.write_table(pa.table({"text": [r["text"] for r in rows]}), src)
    for args in (
        ("tokenize", src, "--tokenizer", tokenizer_dir),
        ("train-tokenizer", src, "--vocab-size", 300),
    ):
        res = cli(*args, "--text-column", "txt", "--out", tmp_path / "out")
        line = res.output.strip()
        assert res.exit_code == 2 and "'txt'" in line and "--text-column NAME" in line, (args, res.output)
        assert "\n" not in line and "Traceback" not in line, line
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("column", ["", "  "])
def test_a_blank_text_column_is_refused_before_anything_is_read(tmp_path, c4_lines, tokenizer_dir, column):
    """A blank --text-column matches no row: every document of every shard would be rejected. Each
    place that takes one (tokenize, train-tokenizer, a workflow's tokenize step) refuses it up front."""
    from entroweight.workflows.spec import SpecError, parse_workflow

    src = write(tmp_path / "c4.jsonl", c4_lines)
    for args in (
        ("tokenize", src, "--tokenizer", tokenizer_dir),
        ("train-tokenizer", src, "--vocab-size", 300),
    ):
        res = cli(*args, "--text-column", column, "--out", tmp_path / "out")
        assert res.exit_code == 2 and "--text-column" in res.output and "Traceback" not in res.output
        assert not (tmp_path / "out").exists()
    with pytest.raises(SpecError, match="tokenize.text_column: the text column"):
        parse_workflow({"name": "w", "sources": [str(src)], "tokenize": {"text_column": column}})


# ---------------------------------------------------------------- errors before any output


def test_unwritable_out_is_refused(tmp_path, c4_lines, tokenizer_dir):
    src = write(tmp_path / "c4.jsonl", c4_lines)
    (tmp_path / "file").write_text("not a directory")
    res = cli("tokenize", src, "--tokenizer", tokenizer_dir, "--out", tmp_path / "file" / "out")
    assert res.exit_code == 2 and f"lies below {tmp_path / 'file'}, which is a file" in res.output
    res = cli("tokenize", src, "--tokenizer", tokenizer_dir, "--out", "/sys/entroweight-test-out")
    assert res.exit_code == 2 and "cannot write to --out" in res.output
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        res = cli("tokenize", src, "--tokenizer", tokenizer_dir, "--out", ro)
        assert res.exit_code == 2 and list(ro.iterdir()) == []


def test_bad_ray_address_is_refused_at_once(tmp_path, c4_lines, tokenizer_dir):
    src = write(tmp_path / "c4.jsonl", c4_lines)
    for address in ("127.0.0.1:1", "banana"):
        start = time.perf_counter()
        res = cli(
            "tokenize", src, "--tokenizer", tokenizer_dir, "--out", tmp_path / "r", "--engine", "ray",
            "--ray-address", address,
        )  # fmt: skip
        assert res.exit_code == 2 and "--ray-address" in res.output
        assert time.perf_counter() - start < 30 and not (tmp_path / "r").exists()


def test_unreachable_hub_dataset_is_refused_and_leaves_nothing(
    tmp_path, c4_lines, tokenizer_dir, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    res = cli("tokenize", "hf:nobody-here/no-such-dataset", "--tokenizer", tokenizer_dir, "--out", out)
    assert res.exit_code == 2 and "hf:nobody-here/no-such-dataset" in res.output
    assert not out.exists()
    # the corrected rerun (another text column, so another config) is not refused
    rows = [json.loads(line) for line in c4_lines[:5]]
    src = tmp_path / "c4.jsonl"
    src.write_text("".join(json.dumps({"body": r["text"]}) + "\n" for r in rows))
    res = cli("tokenize", src, "--tokenizer", tokenizer_dir, "--out", out, "--text-column", "body")
    assert res.exit_code == 0, res.output


def test_a_record_without_shards_does_not_block_another_config(tmp_path, c4_lines, tokenizer_dir):
    src = write(tmp_path / "c4.jsonl", c4_lines[:5])
    out = tmp_path / "out"
    tokenize([src], tokenizer_dir, out)
    for p in [*out.glob("part-*"), *out.glob(".part-*")]:
        p.unlink()  # a run that stopped before its first shard
    assert tokenize([src], tokenizer_dir, out, n_ctx=32).docs_in == 5
    with pytest.raises(StageError, match="another config"):  # shards exist now: protected
        tokenize([src], tokenizer_dir, out, n_ctx=48)


def test_symlinked_subdirectory_is_followed_and_a_loop_refused(tmp_path, c4_lines, tokenizer_dir):
    write(tmp_path / "elsewhere" / "c4.jsonl", c4_lines[:7])
    src = tmp_path / "src"
    write(src / "own.jsonl", c4_lines[7:10])
    (src / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    s = tokenize([src], tokenizer_dir, tmp_path / "out")
    assert s.docs_in == 10
    (src / "loop").symlink_to(src, target_is_directory=True)
    res = cli("tokenize", src, "--tokenizer", tokenizer_dir, "--out", tmp_path / "out2")
    assert res.exit_code == 2 and "symlink loop" in res.output and not (tmp_path / "out2").exists()


# ---------------------------------------------------------------- progress


@pytest.mark.parametrize("named", ["directory", "glob"])
def test_a_file_a_directory_or_glob_leaves_out_is_said_and_a_dead_link_refused(
    tmp_path, c4_lines, tokenizer_dir, named
):
    """A directory's or glob's files of no source suffix are not read and the summary says which
    (a misnamed `.jsonl.gzip` was dropped without a word); a link to nothing among them is refused,
    as it is when named itself (a lost mount dropped its files, exit 0)."""
    src = tmp_path / "src"
    write(src / "b.jsonl", c4_lines[:6])
    write(src / "c.jsonl.gzip", c4_lines[6:9])
    (src / "README").write_text("about these files\n")
    spec = src if named == "directory" else f"{src}/*"
    res = CliRunner().invoke(
        main, ["tokenize", str(spec), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "out")]
    )
    assert res.exit_code == 0 and "6 docs in" in res.output, res.output
    assert f"note: 2 file(s) of no source suffix not read: {src}/README, {src}/c.jsonl.gzip" in res.stderr
    (src / "a.jsonl").symlink_to(tmp_path / "gone" / "a.jsonl")
    res = cli("tokenize", spec, "--tokenizer", tokenizer_dir, "--out", tmp_path / "out2")
    assert res.exit_code == 2 and f"{src}/a.jsonl is a link to" in res.output, res.output
    assert not (tmp_path / "out2").exists()


SOURCE_COMMANDS = sorted(
    name for name, c in main.commands.items() if any(p.name == "sources" for p in c.params)
)


@pytest.mark.parametrize("command", [*SOURCE_COMMANDS, "run --dry-run"])
def test_every_command_that_lists_sources_says_what_it_leaves_out_or_reads_once(
    tmp_path, c4_lines, tokenizer_dir, command
):
    """A file of no source suffix is not read, a hidden file or directory is not read, and a file two
    sources name (the file and its directory) is read once: every command that lists sources says
    each on stderr. The workflow run said none, a file named twice was read once without a word by
    every command, and hidden documents were left out without one."""
    assert SOURCE_COMMANDS == ["tokenize", "train-tokenizer"], "a new command of SOURCES: add it here"
    src = tmp_path / "src"
    write(src / "b.jsonl", c4_lines[:6])
    write(src / "c.jsonl.gzip", c4_lines[6:9])
    write(src / ".d.jsonl", c4_lines[9:10])
    write(src / ".e" / "f.jsonl", c4_lines[10:11])
    sources = [str(src), str(src / "b.jsonl")]
    out = str(tmp_path / "out")
    args = {
        "tokenize": ["tokenize", *sources, "--tokenizer", str(tokenizer_dir), "--out", out],
        "train-tokenizer": ["train-tokenizer", *sources, "--vocab-size", "300", "--out", out],
    }.get(command)
    if args is None:
        spec = {"run_dir": out, "sources": sources, "tokenizer": {"path": str(tokenizer_dir)}}
        (tmp_path / "wf.yaml").write_text(json.dumps(spec))
        args = ["run", str(tmp_path / "wf.yaml"), "--dry-run"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert f"note: 1 file(s) of no source suffix not read: {src}/c.jsonl.gzip" in res.stderr + res.output
    said = f"note: 2 hidden file(s) or director(ies) not read: {src}/.d.jsonl, {src}/.e"
    assert said in res.stderr + res.output, res.output
    said = f"1 file(s) reached more than once (named by two sources, or through a link), read once: {src / 'b.jsonl'}"
    assert said in res.stderr + res.output, res.output


def test_shards_of_a_moved_source_are_said_to_be_moved_and_overwrite_remakes_them(
    tmp_path, c4_lines, tokenizer_dir
):
    """A source directory moved (or a run directory copied) since its shards were made: the refusal
    named "inputs this run does not read ... renamed, moved or deleted" and listed the old paths; it
    now says where they were made from and where the same files are read now. A file of another name
    keeps the general words."""
    write(tmp_path / "src" / "a.jsonl", c4_lines[:6])
    out = tmp_path / "out"
    assert (
        cli("tokenize", tmp_path / "src" / "a.jsonl", "--tokenizer", tokenizer_dir, "--out", out).exit_code
        == 0
    )

    def rows():
        import pyarrow.parquet as pq

        return [
            pq.read_table(p, columns=["input_ids", "n_pad"]).to_pylist() for p in sorted(out.glob("part-*"))
        ]

    before = rows()
    (tmp_path / "src").rename(tmp_path / "moved")
    args = ("tokenize", tmp_path / "moved" / "a.jsonl", "--tokenizer", tokenizer_dir, "--out", out)
    res = cli(*args)
    said = f"made from {tmp_path / 'src'}, and this run reads files of the same names in {tmp_path / 'moved'}"
    assert res.exit_code == 2 and said in res.output and "moved or copied" in res.output, res.output
    assert cli(*args, "--overwrite").exit_code == 0
    assert rows() == before  # the same documents, made again from where they are
    (tmp_path / "moved" / "a.jsonl").rename(tmp_path / "moved" / "b.jsonl")
    res = cli("tokenize", tmp_path / "moved" / "b.jsonl", "--tokenizer", tokenizer_dir, "--out", out)
    assert res.exit_code == 2 and "renamed, moved or deleted" in res.output, res.output


def test_beam_shows_shard_progress(tmp_path, c4_lines, tokenizer_dir):
    # one task per JSON-lines file (it cuts its own shards as it reads): the bar counts tasks
    src = tmp_path / "src"
    src.mkdir()
    for k in range(3):
        write(src / f"c4-{k}.jsonl", c4_lines[10 * k : 10 * k + 10])
    cmd = [
        sys.executable,
        "-m",
        "entroweight.workflows.cli",
        "tokenize",
        str(src),
        "--tokenizer",
        str(tokenizer_dir),
    ]
    cmd += ["--out", str(tmp_path / "out"), "--engine", "beam"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "tokenize (beam)" in res.stderr and "3/3" in res.stderr


def test_a_failing_shard_still_fails(tmp_path, c4_lines, tokenizer_dir):
    """The readers' new leniency (BOM, magic bytes) does not hide a truncated file."""
    src = write(tmp_path / "c4.jsonl", c4_lines, "gzip")
    src.write_bytes(src.read_bytes()[:-100])
    with pytest.raises(StageFailed, match="c4.jsonl"):
        tokenize([src], tokenizer_dir, tmp_path / "out")


@pytest.mark.parametrize("held", ["ours", "a user's file"])
def test_train_tokenizer_never_replaces_a_tokenizer_unasked(tmp_path, c4_lines, held):
    """A tokenizer in --out (the one data was tokenized with, or a user's file) is replaced only with
    --overwrite: without it, exit 2 and the file is as it was."""
    src = write(tmp_path / "c4.jsonl", c4_lines)
    out = tmp_path / "tok"
    if held == "ours":
        assert cli("train-tokenizer", src, "--vocab-size", 300, "--out", out).exit_code == 0
    else:
        out.mkdir()
        (out / "tokenizer.json").write_text('{"mine": 1}')
    before = (out / "tokenizer.json").read_bytes()
    res = cli("train-tokenizer", src, "--vocab-size", 320, "--out", out)
    assert res.exit_code == 2 and "holds a tokenizer" in res.output and "--overwrite" in res.output
    assert (out / "tokenizer.json").read_bytes() == before
    res = cli("train-tokenizer", src, "--vocab-size", 320, "--out", out, "--overwrite")
    assert res.exit_code == 0 and (out / "tokenizer.json").read_bytes() != before


def test_a_rerun_of_the_same_train_tokenizer_does_nothing(tmp_path, c4_lines):
    """A scheduler's retry of train-tokenizer (or a rerun after a kill that came after the write) with
    the same arguments finds its tokenizer and does nothing, exit 0, as a stage's rerun does; it was
    refused (exit 2). Anything else is refused (a kept output, entroweight.output), saying what
    differs: a source changed since (its size or mtime), the sources in another order (with
    --max-docs, other documents), another option, or a tokenizer.json that is not the one the record
    names (edited, or another copied in)."""
    import os
    import shutil

    src = write(tmp_path / "c4.jsonl", c4_lines[:20])
    other = write(tmp_path / "more.jsonl", c4_lines[20:])
    out = tmp_path / "tok"
    argv = ["train-tokenizer", src, other, "--vocab-size", 300, "--out", out]
    assert cli(*argv).exit_code == 0
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    res = cli(*argv)
    assert res.exit_code == 0 and "nothing to do" in res.output, res.output
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == files
    others = {
        "vocab_size: 300 -> 301": ["--vocab-size", 301],
        "max_docs: None -> 10": ["--max-docs", 10],
        "text_column: 'text' -> 'url'": ["--text-column", "url"],
        "algorithm: 'bpe' -> 'lz78'": ["--algorithm", "lz78"],
    }
    for says, change in others.items():
        res = cli(*argv, *change)
        assert res.exit_code == 2 and f"a tokenizer of other options ({says})" in res.output, (
            says,
            res.output,
        )
    swapped = ["train-tokenizer", other, src, "--vocab-size", 300, "--out", out]
    res = cli(*swapped)
    assert res.exit_code == 2 and "of other options (sources: [" in res.output, res.output
    mtime = src.stat().st_mtime_ns
    write(src, c4_lines[:20])
    os.utime(src, ns=(mtime + 10**9,) * 2)  # rewritten: the same bytes, a later modification time
    res = cli(*argv)
    assert res.exit_code == 2 and "a tokenizer of inputs changed since (sources)" in res.output, res.output
    assert cli(*argv, "--overwrite").exit_code == 0
    tok = out / "tokenizer.json"
    tok.write_bytes(tok.read_bytes().replace(b'"<|pad|>"', b'"<|PAD|>"'))  # edited by hand since
    res = cli(*argv)
    assert res.exit_code == 2 and "whose files differ from its record" in res.output, res.output
    assert cli(*argv, "--overwrite").exit_code == 0
    # another tokenizer copied in with `cp tok2/* tok/` (the glob leaves the hidden record behind)
    assert cli("train-tokenizer", src, "--vocab-size", 400, "--out", tmp_path / "tok2").exit_code == 0
    for name in ("tokenizer.json", "tokenizer.sha256"):
        shutil.copy(tmp_path / "tok2" / name, out / name)
    res = cli(*argv)
    assert res.exit_code == 2 and "whose files differ from its record" in res.output, res.output
    assert {p.name for p in out.iterdir()} == {"tokenizer.json", "tokenizer.sha256", ".train-tokenizer.json"}
    for record in ("[1, 2]", "{not json", '{"sources": 3}'):  # a record edited into something else
        (out / ".train-tokenizer.json").write_text(record)
        res = cli(*argv)
        assert res.exit_code == 2 and "holds a tokenizer " in res.output, (record, res.output)
        assert "Traceback" not in res.output


def test_train_tokenizer_says_when_it_makes_fewer_tokens_than_asked(tmp_path, c4_lines):
    src = write(tmp_path / "c4.jsonl", c4_lines[:5])
    res = cli("train-tokenizer", src, "--vocab-size", 60000, "--out", tmp_path / "tok")
    assert res.exit_code == 0 and "60000 asked: the documents give no more" in res.output, res.output


@pytest.mark.parametrize("algorithm", ["bpe", "lz78"])
@pytest.mark.parametrize("size", [0, 259, 2**20 + 1, 2**31 - 1])
def test_train_tokenizer_refuses_a_vocabulary_size_out_of_bounds(tmp_path, c4_lines, algorithm, size):
    """Below the byte alphabet, or above MAX_VOCAB_SIZE (the workflow's bound too): exit 2, one line,
    nothing written. 2**31 − 1 aborted the process inside the BPE trainer (a 141-GB allocation)."""
    if algorithm == "lz78" and size == 259:
        pytest.skip("an LZ78 dictionary needs no byte alphabet")
    src = write(tmp_path / "c4.jsonl", c4_lines[:5])
    res = cli(
        "train-tokenizer", src, "--vocab-size", size, "--algorithm", algorithm, "--out", tmp_path / "tok"
    )
    assert res.exit_code == 2 and "--vocab-size must" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "tok").exists()
