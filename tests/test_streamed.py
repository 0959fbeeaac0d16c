"""Full-size corpora: a compressed JSON-lines file is read once however many shards it makes, planning
opens no file body, and a task killed mid-file resumes after its last committed shard."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from entroweight import storage
from entroweight.pipelines import run_stage
from entroweight.pipelines.stage import plan_run, read_manifests
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.pipelines.verify import verify_dir
from entroweight.schemas.manifest import manifest_name
from entroweight.transforms import sources
from entroweight.transforms.writer import sha256_file

N_DOCS = 400


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, c4_path):
    """400 C4 documents in one .json.gz (20 shards of 20), one with a blank line and a broken row."""
    with gzip.open(c4_path, "rt") as f:
        lines = [line for line, _ in zip(f, range(N_DOCS - 2), strict=False)]
    lines[7:7] = ["\n", "{not json\n"]  # rejects: every input row is accounted for
    d = tmp_path_factory.mktemp("corpus")
    path = d / "c4.json.gz"
    path.write_bytes(gzip.compress("".join(lines).encode()))
    return path


class _Counted:
    """A source file object that counts the bytes read through it."""

    def __init__(self, f, counts):
        self.f, self.counts = f, counts

    def read(self, n=-1):
        data = self.f.read(n)
        self.counts["bytes"] += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def count_source_reads(monkeypatch, source) -> dict:
    """Wrap the one opener every reader goes through; count what is read of `source`."""
    counts = {"opens": 0, "bytes": 0}
    real = storage.open_input

    def open_input(p):
        f = real(p)
        if str(p) != str(source):
            return f
        counts["opens"] += 1
        return _Counted(f, counts)

    monkeypatch.setattr(storage, "open_input", open_input)
    return counts


def test_a_compressed_file_as_20_shards_is_read_once_by_its_task(
    tmp_path, corpus, tokenizer_dir, monkeypatch
):
    stage = TokenizeStage([str(corpus)], str(tokenizer_dir), n_ctx=64, shard_docs=20)
    stage.plan_inputs()  # (it reads the first file's first rows once: a wrong --text-column refused up front)
    counts = count_source_reads(monkeypatch, corpus)
    summary = run_stage(stage, tmp_path / "out", progress=False)
    assert summary.shards_run == 20 and summary.docs_in == N_DOCS
    assert summary.docs_out + sum(summary.rejected.values()) == N_DOCS
    # two opens, every compressed byte read twice: the ids of the run's documents (its duplicate ids
    # are planned over the whole input first: transforms/duplicates.py), then the one task's pass over
    # it (the old plan counted rows first, then each of the 20 shards decompressed the file from its
    # start up to its own rows: 21 opens) (and the 4 bytes of its magic, sniffed first each time: the
    # content decides gzip, zstd or plain)
    assert counts == {"opens": 2, "bytes": 2 * (corpus.stat().st_size + 4)}
    manifests = read_manifests(tmp_path / "out")
    assert [m.shard for m in manifests] == [f"part-00000-{k:05d}" for k in range(20)]
    ranges = [(m.inputs[0].start, m.inputs[0].stop) for m in manifests]
    assert ranges == [(k * 20, k * 20 + 20) for k in range(19)] + [(380, None)]  # the last: to the end
    assert all(m.docs_in == m.docs_out + m.n_rejected for m in manifests)
    assert verify_dir(tmp_path / "out") == []


def test_planning_opens_no_file_body(tmp_path, corpus, monkeypatch, c4_path):
    """Listing and sizes only: JSON lines of any compression, even unreadable ones, plan their shards
    without a read; parquet reads its footer and nothing else. (The stage's plan of duplicate ids then
    reads each input's ids once.)"""
    import pyarrow as pa

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.json.gz").write_bytes(corpus.read_bytes())
    (src / "b.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd not really zstd")
    (src / "c.jsonl").write_text('{"text": "plain"}\n' * 10)
    (src / "d.jsonl.gz").write_bytes(b"")  # empty: fails its shard when read, not the plan
    rows = [{"text": f"doc {i}"} for i in range(100)]
    pq.write_table(pa.Table.from_pylist(rows), src / "e.parquet", row_group_size=30)
    opened: list[str] = []
    real = storage.open_input

    def open_input(p):
        opened.append(os.path.basename(str(p)))
        return real(p)

    monkeypatch.setattr(storage, "open_input", open_input)
    shards = sources.plan_inputs([str(src)], shard_docs=50)
    assert opened == ["e.parquet"]  # its footer: row-group shards
    assert [(os.path.basename(s.uri), s.start, s.stop) for s in shards] == [
        ("a.json.gz", 0, None),
        ("b.jsonl.zst", 0, None),
        ("c.jsonl", 0, None),
        ("d.jsonl.gz", 0, None),
        ("e.parquet", 0, 60),
        ("e.parquet", 60, 100),
    ]
    assert all(s.size == os.path.getsize(s.uri) and s.mtime_ns for s in shards)

    opened.clear()
    stage = TokenizeStage([str(src)], str(_tok(tmp_path, c4_path)), n_ctx=64, shard_docs=50)
    opened.clear()
    plan = plan_run(stage, tmp_path / "out")
    # the stage reads the first file's first rows besides (`check_head`: a wrong --text-column), and,
    # as shards are to be made, each input's ids once (duplicate ids over the whole input,
    # transforms/duplicates.py; e.parquet: its footer, then its two row ranges; the empty d.jsonl.gz is
    # refused unopened); a rerun with nothing to do reads none (tests/test_duplicates.py)
    assert sorted(opened) == ["a.json.gz"] * 2 + ["b.jsonl.zst", "c.jsonl"] + ["e.parquet"] * 3
    assert len(plan.todo) == 6


def _tok(tmp_path, c4_path):
    from entroweight.transforms.train_tokenizer import DEFAULT_BASE, corpus_texts, save_tokenizer, train_bpe

    d = tmp_path / "tok"
    save_tokenizer(train_bpe(corpus_texts([str(c4_path)], max_docs=50), 300, DEFAULT_BASE), d)
    return d


def test_a_kill_mid_file_resumes_after_the_last_committed_shard(tmp_path, corpus, tokenizer_dir):
    """SIGKILL between shards of one file: the rerun keeps every committed shard (not rewritten), reads
    on from the row after them, and the directory is byte for byte an uninterrupted run's."""
    reference = tmp_path / "reference"
    run_stage(
        TokenizeStage([str(corpus)], str(tokenizer_dir), n_ctx=64, shard_docs=20), reference, progress=False
    )
    out = tmp_path / "out"
    args = [
        str(corpus),
        "--tokenizer",
        str(tokenizer_dir),
        "--n-ctx",
        "64",
        "--shard-docs",
        "20",
        "--out",
        str(out),
    ]
    env = {**os.environ, "ENTROWEIGHT_TEST_SHARD_DELAY": "0.4"}  # a pause before each manifest
    proc = subprocess.Popen(
        [sys.executable, "-m", "entroweight.workflows.cli", "tokenize", *args],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while len([n for n in storage.listing(out) if n.endswith(".manifest.json")]) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    committed = read_manifests(out)
    assert 3 <= len(committed) < 20, "the kill should land mid-file"
    mtimes = {m.output: (out / m.output).stat().st_mtime_ns for m in committed}
    problems = verify_dir(out)
    # a killed run is a hole verify names: once for the file, as a run to resume, not as a shard
    # fault per committed shard (they are kept)
    named = [p for p in problems if str(corpus) in p]
    assert (
        len(named) == 1
        and f"{len(committed)} shard(s)" in named[0]
        and "rerun the stage to resume" in named[0]
    )
    assert not any("not registered" in p for p in problems), problems
    _readers_refuse_the_hole(out, tmp_path)

    summary = run_stage(
        TokenizeStage([str(corpus)], str(tokenizer_dir), n_ctx=64, shard_docs=20), out, progress=False
    )
    assert summary.shards_done_before == len(committed) and summary.shards_run == 20 - len(committed)
    # only the rows after the committed shards were tokenized again
    assert summary.docs_in == N_DOCS
    assert sum(m.docs_in for m in read_manifests(out) if m.output not in mtimes) == N_DOCS - 20 * len(
        committed
    )
    assert {o: (out / o).stat().st_mtime_ns for o in mtimes} == mtimes
    # every document exactly once: the uninterrupted run's bytes, shard for shard
    assert {p.name: sha256_file(p) for p in out.rglob("part-*.parquet")} == {
        p.name: sha256_file(p) for p in reference.rglob("part-*.parquet")
    }
    assert verify_dir(out) == []
    assert json.loads((out / ".shards.json").read_text()) == json.loads(
        (reference / ".shards.json").read_text()
    )


def test_a_failing_file_keeps_its_committed_shards_and_names_the_hole(tmp_path, corpus, tokenizer_dir):
    """A file truncated mid-way: the shards before the damage are committed and kept, the failure names
    the shard that failed, and verify names the hole (registered, no manifest)."""
    from entroweight.pipelines import StageFailed

    data = corpus.read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(StageFailed) as err:
        run_stage(
            TokenizeStage([str(cut)], str(tokenizer_dir), n_ctx=64, shard_docs=20),
            tmp_path / "out",
            progress=False,
        )
    (failure,) = err.value.failures
    committed = read_manifests(tmp_path / "out")
    assert (
        committed
        and f"part-00000-{len(committed):05d} failed after {len(committed)} committed" in failure.error
    )
    (problem,) = verify_dir(tmp_path / "out")
    assert f"part-00000-{len(committed):05d}" in problem and "no manifest" in problem
    assert manifest_name(f"part-00000-{len(committed):05d}") not in storage.listing(tmp_path / "out")


def _readers_refuse_the_hole(out, tmp_path):
    """A file killed mid-stream is registered under its first shard only (the later ones are
    registered when the run ends): every reader still sees that the committed shards stop short of
    the file's end, and refuses the directory as incomplete, rather than read part of it as the whole."""
    from click.testing import CliRunner
    from test_trainer_fixtures import TINY

    from entroweight.schemas.datadir import DataDir, DataDirError
    from entroweight.workflows.cli.main import main

    d = DataDir(out)
    assert d.missing and "rows from" in d.missing[0]
    with pytest.raises(DataDirError, match="incomplete"):
        d.require()
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("".join(f"{k}: {v}\n" for k, v in TINY.items()))
    ckpt = tmp_path / "ckpt"
    r = CliRunner().invoke(
        main, ["train", str(out), "--model-config", str(cfg), "--steps", "1", "--out", str(ckpt)]
    )
    assert r.exit_code == 2 and "incomplete" in r.output and not ckpt.exists(), r.output
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert "missing_shards" in r.output, r.output
    # the figures describe part of the directory: said on stderr, where a script reading --json sees it
    assert "note: 1 shard(s) of" in r.stderr and "entroweight verify" in r.stderr, r.stderr
