"""Duplicate document ids over a run's whole input (issue 55): with --reject-duplicates a document whose
id was seen before anywhere in the run (another file, the same file, a shard committed by an earlier
run) is a `duplicate_id` reject naming its first copy, which is kept; without it, counted. Every copy
is accounted for, on every source format and every engine, byte for byte alike."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from entroweight.pipelines import ENGINES, run_stage
from entroweight.pipelines.stage import read_manifests
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.transforms import duplicates
from entroweight.transforms.inspect import summarize
from entroweight.transforms.sources import SUFFIXES

FORMATS = sorted(set(SUFFIXES.values()))  # every source format tokenize reads


def doc(i: int, copy: int = 0) -> dict:
    return {"id": f"doc-{i}", "text": f"document {i}, copy {copy}: some words to tokenize"}


def write(path: Path, fmt: str, rows: list[dict]) -> Path:
    """`rows` as a source file of format `fmt` (parquet: a row group of 3 rows, so --shard-docs cuts it)."""
    path = path.with_name(path.name + {"parquet": ".parquet", "jsonl": ".jsonl"}.get(fmt, "." + fmt))
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
        return path
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    if fmt == "jsonl.gz":
        data = gzip.compress(data)
    elif fmt == "jsonl.zst":
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


# a: documents 0-5 and document 2 again (a copy within the file, 5 rows after its first);
# b: documents 4-9 (4 and 5: copies of a's), and 9 twice
A_ROWS = [doc(i) for i in range(6)] + [doc(2, 1)]
B_ROWS = [doc(i, 1) for i in range(4, 10)] + [doc(9, 2)]
FIRST = {"doc-2": ("a", 2), "doc-4": ("a", 4), "doc-5": ("a", 5), "doc-9": ("b", 5)}


def tokenize(src, out, tokenizer_dir, engine="local", **kw):
    kw.setdefault("shard_docs", 4)  # the copies within a file fall in other shards of it
    stage = TokenizeStage([str(s) for s in src], str(tokenizer_dir), n_ctx=32, **kw)
    options = {"workers": 2} if engine != "local" else {}
    return run_stage(stage, out, engine=engine, progress=False, **options)


def output(out: Path) -> tuple[list[str], list[dict]]:
    """(the document ids written, in shard order; the rejects)."""
    ids, rejects = [], []
    for m in sorted(read_manifests(out), key=lambda m: m.shard):
        ids += pq.read_table(out / m.output, columns=["doc_id"]).column("doc_id").to_pylist()
        if m.rejects_file:
            rejects += pq.read_table(out / m.rejects_file).to_pylist()
    return ids, rejects


def accounted(out: Path, sources: dict[str, list[dict]], summary) -> None:
    """Each id once in the output, its first copy; every other copy a reject naming where the first is."""
    ids, rejects = output(out)
    for m in read_manifests(out):  # the copy kept is the first: in the file that holds it
        name = Path(m.inputs[0].uri).name.split(".")[0]
        held = pq.read_table(out / m.output, columns=["doc_id"]).column("doc_id").to_pylist()
        assert all(FIRST[i][0] == name for i in held if i in FIRST), (m.shard, held)
    rows = [(name, i, r) for name, rs in sources.items() for i, r in enumerate(rs)]
    assert sorted(ids) == sorted({r["id"] for _, _, r in rows})  # each id once
    assert len(rejects) == len(rows) - len(set(ids)) == summary.rejected["duplicate_id"]
    files = {Path(m.inputs[0].uri).name.split(".")[0]: m.inputs[0].uri for m in read_manifests(out)}
    for r in rejects:
        name, row = FIRST[r["id"]]
        assert r["reason"] == "duplicate_id" and r["detail"].endswith(
            f"id seen first at {files[name]} row {row}"
        )
    assert summary.docs_in == len(rows) == summary.docs_out + len(rejects)


@pytest.mark.parametrize("fa,fb", list(itertools.product(FORMATS, repeat=2)))
def test_every_copy_is_kept_once_or_rejected_naming_the_first_over_every_format_pair(
    fa, fb, tmp_path, tokenizer_dir
):
    src = [write(tmp_path / "a", fa, A_ROWS), write(tmp_path / "b", fb, B_ROWS)]
    summary = tokenize(src, tmp_path / "out", tokenizer_dir, reject_duplicates=True)
    accounted(tmp_path / "out", {"a": A_ROWS, "b": B_ROWS}, summary)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("mixed")
    return [write(d / "a", "jsonl", A_ROWS), write(d / "b", "parquet", B_ROWS)]


@pytest.fixture(scope="module")
def local_ref(tmp_path_factory, mixed, tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("local-ref")
    tokenize(mixed, out, tokenizer_dir, reject_duplicates=True)
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_rejects_the_same_copies_byte_for_byte(
    engine, tmp_path, mixed, local_ref, tokenizer_dir, monkeypatch
):
    """Byte parity with the local engine's reference, the ids cut into many partitions here (one per
    50 bytes of input), each grouped apart: what is decided does not depend on how the ids were cut."""
    monkeypatch.setattr(duplicates, "BYTES_PER_PARTITION", 50)
    assert (
        duplicates.partitions(TokenizeStage([str(s) for s in mixed], str(tokenizer_dir)).plan_inputs()) > 10
    )
    summary = tokenize(mixed, tmp_path, tokenizer_dir, engine=engine, reject_duplicates=True)
    accounted(tmp_path, {"a": A_ROWS, "b": B_ROWS}, summary)
    ours = {m.shard: m for m in read_manifests(tmp_path)}
    ref = {m.shard: m for m in read_manifests(local_ref)}
    assert ours.keys() == ref.keys()
    for shard, m in ref.items():
        assert (ours[shard].output_sha256, ours[shard].rejects_sha256) == (m.output_sha256, m.rejects_sha256)
        assert ours[shard].inputs == m.inputs
    assert not (tmp_path / ".engine").exists()


def test_without_the_flag_duplicates_are_kept_and_counted_everywhere(tmp_path, mixed, tokenizer_dir):
    summary = tokenize(mixed, tmp_path, tokenizer_dir)
    copies = len(A_ROWS) + len(B_ROWS) - 10
    assert not summary.rejected and summary.docs_out == len(A_ROWS) + len(B_ROWS)
    assert summary.duplicates_kept == copies and f"{copies} docs repeat an id" in summary.line()
    assert sum(m.extra["duplicate_ids_kept"] for m in read_manifests(tmp_path)) == copies
    assert summarize(tmp_path)["duplicate_ids_kept"] == copies


def test_a_rerun_that_adds_a_file_keeps_the_committed_copies(tmp_path, tokenizer_dir):
    """A file added later, even one that sorts first, comes after the shards already committed: its
    copies are rejected, naming theirs, and no committed shard is made again."""
    (src := tmp_path / "src").mkdir()
    a = write(src / "a", "jsonl", A_ROWS)
    tokenize([src], tmp_path / "out", tokenizer_dir, reject_duplicates=True)
    before = {m.shard: m.output_sha256 for m in read_manifests(tmp_path / "out")}
    write(src / "0-added", "parquet", [doc(0, 3), doc(20), doc(5, 3)])
    summary = tokenize([src], tmp_path / "out", tokenizer_dir, reject_duplicates=True)
    assert summary.shards_done_before == len(before) and summary.shards_run == 1
    assert {m.shard: m.output_sha256 for m in read_manifests(tmp_path / "out")}.items() >= before.items()
    ids, rejects = output(tmp_path / "out")
    assert sorted(ids) == sorted({*(r["id"] for r in A_ROWS), "doc-20"})
    details = sorted(r["detail"] for r in rejects if r["source"].startswith("0-added"))
    assert details == [f"row 0: id seen first at {a} row 0", f"row 2: id seen first at {a} row 5"]


def test_an_earlier_input_that_now_holds_a_first_copy_redoes_the_later_shard(tmp_path, tokenizer_dir):
    """A shard's rejects depend on the inputs before it: when one of them changes to hold a first copy
    of its ids, the later shard is made again (its recorded plan differs), and a rerun then has
    nothing to do."""
    (src := tmp_path / "src").mkdir()
    write(src / "a", "jsonl", [doc(0)])
    write(src / "b", "jsonl", [doc(1), doc(2)])
    tokenize([src], tmp_path / "out", tokenizer_dir, reject_duplicates=True, shard_docs=None)
    write(src / "a", "jsonl", [doc(0), doc(2, 1), doc(3)])
    summary = tokenize([src], tmp_path / "out", tokenizer_dir, reject_duplicates=True, shard_docs=None)
    assert summary.shards_run == 2 and summary.rejected == {"duplicate_id": 1}
    ids, rejects = output(tmp_path / "out")
    assert sorted(ids) == ["doc-0", "doc-1", "doc-2", "doc-3"] and rejects[0]["source"] == "b.jsonl"
    again = tokenize([src], tmp_path / "out", tokenizer_dir, reject_duplicates=True, shard_docs=None)
    assert again.shards_run == 0


def test_a_rerun_with_nothing_to_do_reads_no_source(tmp_path, mixed, tokenizer_dir, monkeypatch):
    """The plan of duplicate ids is made when a shard is to be made: a rerun of a finished output reads
    what its shards record, not the sources (a parquet's footer aside)."""
    from entroweight import storage

    tokenize(mixed, tmp_path, tokenizer_dir, reject_duplicates=True)
    opened, real = [], storage.open_input
    monkeypatch.setattr(storage, "open_input", lambda p: opened.append(Path(str(p)).name) or real(p))
    assert tokenize(mixed, tmp_path, tokenizer_dir, reject_duplicates=True).shards_run == 0
    assert sorted(opened) == ["a.jsonl", "b.parquet"]  # b's footer; a's first rows (--text-column)
