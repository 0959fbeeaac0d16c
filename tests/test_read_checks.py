# ruff: noqa: F811 - pytest fixtures imported from test_score_stage
"""Issue 26, the dataset checked as it is read:

- every reader of a stage's output (`export-data`, `train`) checks each shard's bytes against its
  manifest's sha256, computed while the bytes stream (one read of each shard, measured here): a shard
  with a flipped bit that still decodes is refused (exit 2, naming it) before any output exists;
- a shard with no rows (a source whose only document was rejected) contributes nothing to an export,
  in every format;
- an HF model directory without a tokenizer file is refused, naming what it expects (exit 2).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import C4
from test_score_stage import small_data, tiny_llama  # noqa: F401 - fixtures
from test_trainer_fixtures import TINY

from entroweight import storage
from entroweight.pipelines import run_stage
from entroweight.pipelines.export_data import FORMATS, export_data
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.trainers.data import inspect_data, value_problems
from entroweight.workflows.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore:Transformer Engine:UserWarning")


def score(data, model, out):
    opts = {"model": str(model), "dtype": "fp32", "batch_size": 8}
    run_stage(ScoreStage(data, "causal_loss", opts), out, progress=False)
    return out


@pytest.fixture(scope="module")
def scored(tmp_path_factory, small_data, tiny_llama):
    return score(small_data, tiny_llama, tmp_path_factory.mktemp("scored"))


def flip_a_decodable_byte(f: Path) -> None:
    """Flip one bit inside the `weight` column's data of the first row group such that the file still
    decodes and every weight stays in [0, 1] (what `verify`'s sha256 catches and a reader that only
    decodes and checks values does not)."""
    original = f.read_bytes()
    good = pq.read_table(f)
    md = pq.ParquetFile(f).metadata.row_group(0)
    col = next(
        md.column(i) for i in range(md.num_columns) if md.column(i).path_in_schema.startswith("weight")
    )
    start, n = col.data_page_offset, col.total_compressed_size
    for pos in range(start + n - 1, start, -1):  # from the end: values, not page headers
        for bit in range(8):
            data = bytearray(original)
            data[pos] ^= 1 << bit
            f.write_bytes(bytes(data))
            try:
                t = pq.read_table(f)
                w = pc.list_flatten(t.column("weight")).to_numpy(zero_copy_only=False).astype("float32")
                if not t.equals(good) and ((w >= 0) & (w <= 1)).all():  # values any check would pass
                    return
            except Exception:  # noqa: BLE001 - undecodable: try another byte
                pass
    f.write_bytes(original)
    raise AssertionError("no decodable single-bit flip found")


@pytest.fixture(scope="module")
def flipped(tmp_path_factory, scored):
    out = tmp_path_factory.mktemp("flipped")
    shutil.copytree(scored, out, dirs_exist_ok=True)
    flip_a_decodable_byte(sorted(out.glob("part-*.parquet"))[1])
    return out


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def tiny_yaml(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.yaml"
    p.write_text("".join(f"{k}: {v}\n" for k, v in TINY.items()))
    return p


def train(data, out, tmp_path):
    return cli(
        "train", data, "--loss", "weighted_ce", "--model-config", tiny_yaml(tmp_path), "--out", out,
        "--steps", "2", "--batch-size", "4", "--device", "cpu",
    )  # fmt: skip


# -- a shard that differs from its manifest


def test_verify_sees_the_flip(flipped):
    r = cli("verify", flipped)
    assert r.exit_code == 1 and "part-00001" in r.output


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_refuses_a_shard_that_differs_from_its_manifest(flipped, tmp_path, fmt):
    out = tmp_path / "export"
    r = cli("export-data", flipped, "--format", fmt, "--out", out)
    assert r.exit_code == 2, r.output
    assert "part-00000-00001.parquet" in r.output and "differ from its manifest" in r.output
    assert "entroweight verify" in r.output and "Traceback" not in r.output
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []  # nor its temp sibling


def test_train_refuses_a_shard_that_differs_from_its_manifest(flipped, tmp_path):
    out = tmp_path / "ck"
    r = train(flipped, out, tmp_path)
    assert r.exit_code == 2, r.output
    assert "part-00000-00001.parquet" in r.output and "differ from its manifest" in r.output
    assert not out.exists()


def test_train_refusing_a_shard_exits_2_as_a_process(flipped, tmp_path):
    """The same refusal as a real process, which must exit 2, not abort at exit ("terminate called
    without an active exception", 134): Arrow threads dropping the last reference to a shard's bytes
    while the interpreter exits. The bytes are Arrow's own buffer (storage.read_hashed)."""
    out = tmp_path / "ck"
    args = ["train", flipped, "--loss", "weighted_ce", "--model-config", tiny_yaml(tmp_path), "--out", out,
            "--steps", "2", "--batch-size", "4", "--device", "cpu"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the abort needs threads
    res = subprocess.run(
        [sys.executable, "-m", "entroweight.workflows.cli", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "differ from its manifest" in res.stderr and "terminate called" not in res.stderr
    assert not out.exists()


def test_inspect_refuses_a_shard_that_differs_from_its_manifest(flipped, scored):
    """inspect summarizes each shard read checked, as every reader: no statistics of corrupt bytes."""
    r = cli("inspect", flipped)
    assert r.exit_code == 2, r.output
    assert "part-00000-00001.parquet" in r.output and "differ from its manifest" in r.output
    assert "Traceback" not in r.output
    assert cli("inspect", scored).exit_code == 0


def test_quantiles_from_a_shard_that_differs_from_its_manifest_are_refused(flipped, scored, tmp_path):
    out = tmp_path / "w"
    r = cli("weigh", scored, "--weighting", "quantile", "--quantiles-from", flipped, "--out", out)
    assert r.exit_code == 2, r.output
    assert "differ from its manifest" in r.output and "Traceback" not in r.output
    assert not out.exists()


def corrupt_pages(src: Path, dst: Path) -> Path:
    """A copy of one parquet file whose footer reads but whose pages do not decode (no manifest to
    check it against: it is named alone)."""
    raw = bytearray(src.read_bytes())
    for i in range(64, len(raw) // 2):
        raw[i] ^= 0x5A
    dst.write_bytes(bytes(raw))
    return dst


# a reader handed one parquet file: a file whose pages do not decode is refused (exit 2), not a traceback
LONE_FILE_READERS = {
    "inspect": lambda f, scored, out: ["inspect", f],
    "quantiles-from": lambda f, scored, out: ["weigh", scored, "--weighting", "quantile",
                                              "--quantiles-from", f, "--out", out],
}  # fmt: skip


@pytest.mark.parametrize("reader", LONE_FILE_READERS)
def test_a_lone_file_that_does_not_decode_is_refused(scored, tmp_path, reader):
    bad = corrupt_pages(sorted(scored.glob("part-*.parquet"))[0], tmp_path / "bad.parquet")
    out = tmp_path / "out"
    r = cli(*LONE_FILE_READERS[reader](bad, scored, out))
    assert r.exit_code == 2, r.output
    assert "could not be read whole" in r.output and "Traceback" not in r.output
    assert not out.exists()


# The stages that read another stage's output (score reads tokens, weighted data too; weigh reads
# weighted data): each worker reads its input shard checked against its manifest's sha256, as it reads.
READING_STAGES = {
    "weigh": lambda src, out, model: ["weigh", src, "--out", out],
    "score": lambda src, out, model: ["score", src, "--scorer", "causal_loss", "--model", model,
                                      "--dtype", "fp32", "--out", out],
}  # fmt: skip


@pytest.mark.parametrize("stage", READING_STAGES)
def test_stages_refuse_an_input_shard_that_differs_from_its_manifest(flipped, tiny_llama, tmp_path, stage):
    out = tmp_path / "out"
    r = cli(*READING_STAGES[stage](flipped, out, tiny_llama))
    assert r.exit_code == 1, r.output  # that shard fails, by name; the others are written
    assert "part-00000-00001.parquet" in r.output and "differ from its manifest" in r.output
    assert "Traceback" not in r.output
    assert not (out / "part-00000-00001.parquet").exists()
    assert cli("verify", out).exit_code == 1  # a hole that verify names, not a silent loss


# every reader of a whole scored directory (enumerated: each front end that takes one), handed one
# with a hole (a shard its run planned but never committed: a crashed run's output)
WHOLE_READERS = {
    "compare": lambda d, scored, model, out: ["compare", d, scored],
    "export-data": lambda d, scored, model, out: ["export-data", d, "--format", "hf", "--out", out],
    "weigh": lambda d, scored, model, out: ["weigh", d, "--out", out],
    "weigh --quantiles-from": lambda d, scored, model, out: [
        "weigh", scored, "--weighting", "quantile", "--quantiles-from", d, "--out", out],
    "score --quantiles-from": lambda d, scored, model, out: [
        "score", scored, "--scorer", "causal_loss", "--model", model, "--dtype", "fp32",
        "--weighting", "quantile", "--quantiles-from", d, "--out", out],
}  # fmt: skip


@pytest.mark.parametrize("reader", WHOLE_READERS)
def test_every_reader_refuses_a_scored_directory_with_a_hole(scored, tiny_llama, tmp_path, reader):
    """Rule: no reader takes part of a run's output for the whole. --quantiles-from read what a crashed
    reference run had committed (5 % of it, exit 0, every weight off), where weigh, export-data and
    compare refused it."""
    holed = tmp_path / "holed"
    shutil.copytree(scored, holed)
    next(holed.glob(".part-*1.manifest.json")).unlink()  # a shard not committed
    out = tmp_path / "out"
    r = cli(*WHOLE_READERS[reader](holed, scored, tiny_llama, out))
    assert r.exit_code == 2 and "is incomplete" in r.output and "Traceback" not in r.output, r.output
    assert not out.exists()


def test_compare_refuses_a_shard_that_differs_from_its_manifest_or_a_hole(flipped, scored, tmp_path):
    """compare reads whole directories like every other reader: complete, each shard checked."""
    r = cli("compare", flipped, scored)
    assert r.exit_code == 2 and "differ from its manifest" in r.output, r.output
    holed = tmp_path / "holed"
    shutil.copytree(scored, holed)
    next(holed.glob(".part-*1.manifest.json")).unlink()  # a shard not committed
    r = cli("compare", holed, scored)
    assert r.exit_code == 2 and "incomplete" in r.output, r.output
    assert cli("compare", scored, scored).exit_code == 0


def test_a_shard_of_another_run_copied_in_with_its_manifest_is_named(scored, tmp_path):
    """Readers name the two configurations (not "incomplete ... rerun"), and the advice keeps the
    other run's shard: move it, or --overwrite (which drops it), never a bare delete."""
    other = tmp_path / "other"
    assert cli("weigh", scored, "--weight-dtype", "uint8", "--out", other).exit_code == 0
    mixed = tmp_path / "mixed"
    shutil.copytree(scored, mixed)
    for f in [*other.glob("part-*1.parquet"), *other.glob(".part-*1.manifest.json")]:
        shutil.copy(f, mixed / f.name)
    for args in (
        ["export-data", mixed, "--format", "hf", "--out", tmp_path / "x"],
        ["compare", mixed, scored],
    ):
        r = cli(*args)
        assert r.exit_code == 2 and "two configurations" in r.output and "move that shard" in r.output, (
            r.output
        )
    assert not (tmp_path / "x").exists()


def test_an_intact_dataset_passes(scored, tmp_path):
    r = cli("export-data", scored, "--format", "hf", "--out", tmp_path / "export")
    assert r.exit_code == 0, r.output
    r = train(scored, tmp_path / "ck", tmp_path)
    assert r.exit_code == 0, r.output


class Counting:
    """Bytes read through each file object storage.open_input hands out, by file name."""

    def __init__(self, monkeypatch):
        self.read: dict[str, int] = {}
        real = storage.open_input

        def open_input(p):
            f = real(p)
            name = str(p).rsplit("/", 1)[-1]
            counts = self.read
            counts.setdefault(name, 0)

            class Wrapped:
                def __getattr__(self, a):
                    return getattr(f, a)

                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    f.close()

                def read(self, n=-1):
                    b = f.read(n)
                    counts[name] += len(b)
                    return b

                def readinto(self, b):
                    k = f.readinto(b)
                    counts[name] += k or 0
                    return k

            return Wrapped()

        monkeypatch.setattr(storage, "open_input", open_input)


def test_the_check_costs_no_second_read(scored, tmp_path, monkeypatch):
    """Each shard is read once, whole, by the export and by the trainer's up-front pass alike. Besides,
    before writing anything the export reads each part's footer once (its configuration, checked
    against its manifest: `DataDir.require_one_config`; the first part's also gives the metadata and
    the weights' type), and reads no footer twice (pyarrow reads a file's last 64 KiB for it: these
    test shards whole). The export's own files are read once each, to record their sha256 (what its
    rerun checks: pipelines/export_data.py)."""
    sizes = {f.name: f.stat().st_size for f in sorted(scored.glob("part-*.parquet"))}
    assert len(sizes) > 1
    counting = Counting(monkeypatch)
    export_data(scored, tmp_path / "export", "hf")
    source = {n: v for n, v in counting.read.items() if n in sizes}
    assert source == {n: size + min(size, 1 << 16) for n, size in sizes.items()}
    written = {f.name: f.stat().st_size for f in (tmp_path / "export").rglob("*") if f.is_file()}
    assert {n: v for n, v in counting.read.items() if n not in sizes} == {
        n: size for n, size in written.items() if n != "export.json"
    }
    info = inspect_data(scored, ("weight",))
    counting.read.clear()
    problems, positive = value_problems(info.files, ["weight", "entropy"], info.parts)
    assert problems == [] and positive > 0
    assert counting.read == sizes  # exactly once each


# -- a shard with no rows


@pytest.fixture(scope="module")
def with_an_empty_shard(tmp_path_factory, tokenizer_dir, tiny_llama):
    """Two sources: 12 C4 documents, and one whose only document is rejected (empty text)."""
    src = tmp_path_factory.mktemp("src_empty")
    with gzip.open(C4, "rt", encoding="utf-8") as f, gzip.open(src / "a.jsonl.gz", "wt") as out:
        out.writelines(next(f) for _ in range(12))
    (src / "b.jsonl").write_text(json.dumps({"id": "only", "text": "   "}) + "\n")
    tokens = tmp_path_factory.mktemp("tokens_empty")
    stage = TokenizeStage([str(src / "a.jsonl.gz"), str(src / "b.jsonl")], str(tokenizer_dir), n_ctx=64)
    run_stage(stage, tokens, progress=False)
    scored = score(tokens, tiny_llama, tmp_path_factory.mktemp("scored_empty"))
    rows = [pq.read_metadata(f).num_rows for f in sorted(scored.glob("part-*.parquet"))]
    assert len(rows) == 2 and 0 in rows and sum(rows) > 0, rows
    return scored, sum(rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_empty_shard_contributes_nothing(with_an_empty_shard, tmp_path, fmt):
    scored, n_rows = with_an_empty_shard
    out = tmp_path / "export"
    r = cli("export-data", scored, "--format", fmt, "--out", out)
    assert r.exit_code == 0, r.output
    counts = json.loads((out / "export.json").read_text())["counts"]
    assert counts["shards"] == 2 and counts["rows"] == n_rows and counts["documents"] == 12
    if fmt == "hf":
        t = pa.concat_tables(pq.read_table(f) for f in sorted((out / "data").glob("*.parquet")))
        assert t.num_rows == n_rows


@pytest.fixture(scope="module")
def with_no_rows(tmp_path_factory, with_an_empty_shard):
    """The same data weighed with --min-mean-weight 1.0: every document dropped, every shard 0 rows."""
    from entroweight.pipelines.weigh import WeighStage
    from entroweight.transforms.select import MinMeanWeight
    from entroweight.transforms.weigh import WeighConfig

    out = tmp_path_factory.mktemp("no_rows")
    run_stage(
        WeighStage(with_an_empty_shard[0], WeighConfig(), steps=[MinMeanWeight(1.0)]), out, progress=False
    )
    assert sum(pq.read_metadata(f).num_rows for f in out.glob("part-*.parquet")) == 0
    return out


@pytest.mark.parametrize("command", ["weigh --weighting quantile", "score --weighting quantile", "train"])
def test_a_reader_that_needs_rows_says_the_data_holds_none(with_no_rows, tmp_path, tiny_llama, command):
    """Rule: a reader that cannot work on data of no rows (every document rejected or dropped) says
    so, in one wording (`schemas.datadir.no_rows`), exit 2, nothing written; `weigh --weighting
    quantile` said "holds no `entropy` column: score it without --drop-entropy first", where the
    column was there (a refusal whose advice re-scores for nothing). export-data's litdata case is
    the test below."""
    name, *flags = command.split()
    out = tmp_path / "out"
    args = {
        "weigh": ("weigh", with_no_rows, *flags, "--out", out),
        # the quantiles of another scored directory, read before the data is scored
        "score": ("score", with_no_rows, "--scorer", "causal_loss", "--checkpoint", tiny_llama,
                  *flags, "--quantiles-from", with_no_rows, "--out", out),
        "train": ("train", with_no_rows, "--model-config", tiny_yaml(tmp_path), "--steps", 1, "--out", out),
    }[name]  # fmt: skip
    r = cli(*args)
    assert r.exit_code == 2 and "holds no rows (every document was rejected or dropped" in r.output, r.output
    assert "--drop-entropy" not in r.output and not out.exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_data_of_no_rows_exports_or_is_refused_never_hangs(with_no_rows, tmp_path, fmt):
    """Every format on data whose shards all hold 0 rows: megatron and hf write an empty dataset;
    LitData has none (its writer writes no index for no item, its reader refuses an index without
    chunks), so litdata is refused up front (exit 2, nothing written). Before: `writer.merge()` waited
    forever for that index, leaving `.OUT.export-tmp` behind."""
    out = tmp_path / "export"
    argv = ["export-data", str(with_no_rows), "--format", fmt, "--out", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "entroweight.workflows.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if fmt == "litdata":
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip()
        assert "\n" not in line and "holds no rows" in line and "LitData" in line, line
        assert not out.exists() and not (tmp_path / ".export.export-tmp").exists()
        return
    assert r.returncode == 0, r.stderr
    counts = json.loads((out / "export.json").read_text())["counts"]
    assert counts["rows"] == 0 and counts["documents"] == 0 and counts["real_tokens"] == 0


# -- a model directory without its tokenizer


def test_a_model_directory_without_a_tokenizer_is_refused(small_data, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path / "model"
    cfg = LlamaConfig(
        vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(model)
    out = tmp_path / "scored"
    r = cli("score", small_data, "--scorer", "causal_loss", "--model", model, "--out", out)
    assert r.exit_code == 2, r.output
    assert f"{model} has no tokenizer file (expects tokenizer.json" in r.output, r.output
    assert "sentencepiece" not in r.output and "Traceback" not in r.output
    assert not out.exists()
