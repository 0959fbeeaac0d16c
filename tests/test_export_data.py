"""`export-data`: each export read back by its consumer's own library equals the scored parquet.

Megatron: megatron-core's IndexedDataset (doc by doc) and GPTDataset (sample by sample, through
WeightedGPTDataset's loss_mask); LitData: its StreamingDataset; the hub layout: datasets.load_dataset.
The oracle is the scored parquet read row by row in Python (pads cut by n_pad, documents by doc_id).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import C4
from test_score_stage import small_data, tiny_llama  # noqa: F401 - fixtures
from test_trainer_fixtures import one_thread  # noqa: F401 - fixture

from entroweight.pipelines import run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.schemas.datadir import DataDir
from entroweight.transforms.weigh import WeighConfig
from entroweight.workflows.cli.main import main
from entroweight.workflows.results import sealed

# megatron-core warns on import that Transformer Engine and Apex are absent (CPU: expected)
pytestmark = pytest.mark.filterwarnings("ignore:Transformer Engine:UserWarning")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def score(data, model, out, **kw):
    opts = {"model": str(model), "dtype": "fp32", "batch_size": 8}
    run_stage(ScoreStage(data, "causal_loss", opts, **kw), out, progress=False)
    return out


@pytest.fixture(scope="module")
def scored(tmp_path_factory, small_data, tiny_llama):  # noqa: F811
    return score(small_data, tiny_llama, tmp_path_factory.mktemp("scored"))


@pytest.fixture(scope="module")
def scored_whole(tmp_path_factory, tokenizer_dir, tiny_llama):  # noqa: F811
    """small_data's 60 documents in tokenize's default layout (--overflow split: no text dropped)."""
    src = tmp_path_factory.mktemp("src_whole") / "c4.jsonl.gz"
    with gzip.open(C4, "rt", encoding="utf-8") as f, gzip.open(src, "wt", encoding="utf-8") as out:
        out.writelines(next(f) for _ in range(60))
    tokens = tmp_path_factory.mktemp("tokens_whole")
    run_stage(TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=64, shard_docs=20), tokens, progress=False)
    return score(tokens, tiny_llama, tmp_path_factory.mktemp("scored_whole"))


def _edited(scored, out, ids_of, row_in_doc_of):
    shutil.copytree(scored, out, dirs_exist_ok=True)
    f = out / DataDir(out).parts[0].name
    t = pq.read_table(f)
    ids, row_in_doc = t.column("doc_id").to_pylist(), t.column("row_in_doc").to_pylist()
    ids_of(ids)
    row_in_doc_of(row_in_doc)
    t = t.set_column(t.schema.get_field_index("doc_id"), "doc_id", pa.array(ids, pa.string()))
    t = t.set_column(t.schema.get_field_index("row_in_doc"), "row_in_doc", pa.array(row_in_doc, pa.int32()))
    pq.write_table(t, f)  # the schema (and its entroweight metadata) is kept
    # the manifest records the new bytes, so the shard stays a committed part (schemas/datadir.py)
    m = out / ".part-00000.manifest.json"
    record = json.loads(m.read_text())
    record |= {"output_bytes": f.stat().st_size, "output_sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    m.write_text(json.dumps(record))
    return out


@pytest.fixture(scope="module")
def scored_split(tmp_path_factory, scored):
    """The split-overflow layout: a document continues over consecutive rows (row_in_doc 1, 2, ...)."""

    def ids_of(ids):
        ids[1] = ids[2] = ids[0]  # rows 0-2: one document
        ids[5] = ids[4]

    def row_in_doc_of(r):
        r[1], r[2], r[5] = 1, 2, 1

    return _edited(scored, tmp_path_factory.mktemp("scored_split"), ids_of, row_in_doc_of)


@pytest.fixture(scope="module")
def scored_dup(tmp_path_factory, scored):
    """Two documents with one id (kept by default): rows 0 and 1 share an id, each starts a document."""

    def ids_of(ids):
        ids[1] = ids[0]

    return _edited(scored, tmp_path_factory.mktemp("scored_dup"), ids_of, lambda r: None)


def expected(scored_dir, scale=1.0):
    """(doc_id, real ids, real weights) per row, and the documents (a row_in_doc 0 row and the rows
    continuing it)."""
    rows, starts = [], []
    for f in sorted(scored_dir.glob("part-*.parquet")):
        for r in pq.read_table(f).to_pylist():
            k = r["n_pad"]
            rows.append((r["doc_id"], np.array(r["input_ids"][k:]), np.array(r["weight"][k:]) * scale))
            starts.append(r["row_in_doc"] == 0)
    docs = []
    for (doc_id, ids, w), start in zip(rows, starts, strict=True):
        if docs and not start:
            docs[-1] = (doc_id, np.r_[docs[-1][1], ids], np.r_[docs[-1][2], w])
        else:
            docs.append((doc_id, ids, w))
    return rows, docs


def export(src, out, fmt, *extra):
    return CliRunner().invoke(main, ["export-data", str(src), "--format", fmt, "--out", str(out), *extra])


# -- Megatron


def megatron_docs(out):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(out / "text_document")), IndexedDataset(str(out / "text_document_weight"))


@pytest.mark.parametrize("layout", ["row", "split", "duplicate_ids"])
def test_megatron_reader_doc_by_doc(scored, scored_split, scored_dup, tmp_path, layout):
    src = {"row": scored, "split": scored_split, "duplicate_ids": scored_dup}[layout]
    res = export(src, tmp_path / "m", "megatron")
    assert res.exit_code == 0, res.output
    tokens, weights = megatron_docs(tmp_path / "m")
    rows, docs = expected(src)
    assert len(tokens) == len(weights) == len(docs) and (layout != "split" or len(docs) < len(rows))
    # two documents that share an id stay two documents (the old exporter glued them into one)
    assert layout != "duplicate_ids" or len(docs) == len(rows)
    assert tokens.index.dtype == np.uint16 and weights.index.dtype == np.float32
    for i, (_, ids, w) in enumerate(docs):
        assert np.array_equal(tokens[i], ids)
        assert np.array_equal(weights[i], w.astype(np.float16).astype(np.float32))  # exact
    record = json.loads((tmp_path / "m" / "export.json").read_text())
    real = sum(len(r[1]) for r in rows)
    assert record["counts"] == {"shards": 3, "rows": len(rows), "documents": len(docs), "real_tokens": real}


def test_megatron_documents_are_the_whole_texts(scored_whole, tokenizer_dir, tmp_path):
    """With the split-overflow layout (tokenize's default), each Megatron document is its whole
    text's encoding, reassembled from its rows."""
    from entroweight.transforms.tokenizer import load_tokenizer

    assert export(scored_whole, tmp_path / "m", "megatron").exit_code == 0
    tokens, _ = megatron_docs(tmp_path / "m")
    tok = load_tokenizer(str(tokenizer_dir)).tokenizer
    with gzip.open(C4, "rt", encoding="utf-8") as f:
        texts = [json.loads(next(f))["text"] for _ in range(60)]  # small_data's documents
    assert len(tokens) == 60
    for i, text in enumerate(texts):
        assert np.array_equal(tokens[i], tok.encode(text, add_special_tokens=False).ids)


def test_megatron_gpt_dataset_loss_mask_is_the_weights(scored, tmp_path):
    """Megatron's own document/sample/shuffle walk, checked through an oracle export whose 'tokens'
    are global positions: sample j's labels are positions p, its loss_mask must be weight[p]."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    build = example("weighted_megatron_dataset").build
    out = tmp_path / "m"
    assert export(scored, out, "megatron").exit_code == 0
    tokens, weights = megatron_docs(out)
    flat_ids = np.concatenate([tokens[i] for i in range(len(tokens))])
    flat_w = np.concatenate([weights[i] for i in range(len(weights))])
    # the oracle: the same documents, token -> its global position (int32: more than 2^16 values
    # needs no tokenizer to say so; vocab_size then comes from export.json only for the model)
    pos = tmp_path / "pos"
    pos.mkdir()
    shutil.copy(out / "export.json", pos)
    b = IndexedDatasetBuilder(str(pos / "text_document.bin"), dtype=np.int32)
    wb = IndexedDatasetBuilder(str(pos / "text_document_weight.bin"), dtype=np.float32)
    start = 0
    for i in range(len(tokens)):
        n = len(tokens[i])
        b.add_document(np.arange(start, start + n), [n])
        wb.add_document(flat_w[start : start + n], [n])
        start += n
    b.finalize(str(pos / "text_document.idx"))
    wb.finalize(str(pos / "text_document_weight.idx"))

    ds, oracle = build(str(out), seq_length=48), build(str(pos), seq_length=48)
    assert len(ds) == len(oracle) == (len(flat_ids) - 1) // 48  # one epoch: every token once
    for j in range(len(ds)):
        s, o = ds[j], oracle[j]
        p_tok, p_lab = o["tokens"].numpy(), o["labels"].numpy()
        assert np.array_equal(s["tokens"].numpy(), flat_ids[p_tok])
        assert np.array_equal(s["labels"].numpy(), flat_ids[p_lab])
        assert np.array_equal(s["loss_mask"].numpy(), flat_w[p_lab])


def test_megatron_uint8_weights(small_data, tiny_llama, tmp_path):  # noqa: F811
    src = score(small_data, tiny_llama, tmp_path / "s8", weighting=WeighConfig(dtype="uint8"))
    assert export(src, tmp_path / "m", "megatron").exit_code == 0
    tokens, weights = megatron_docs(tmp_path / "m")
    _, docs = expected(src)
    assert weights.index.dtype == np.uint8
    for i, (_, ids, w) in enumerate(docs):
        assert np.array_equal(tokens[i], ids) and np.array_equal(weights[i], w)
    s = example("weighted_megatron_dataset").build(str(tmp_path / "m"), seq_length=48)[0]
    assert 0 < s["loss_mask"].max() <= 1  # scaled back to [0, 1]


def test_megatron_packed(tmp_path, tiny_llama, tokenizer_dir):  # noqa: F811
    """Packed rows: the documents are the eos-separated runs of each shard's token stream."""
    packed = tmp_path / "packed"
    texts = tmp_path / "docs.jsonl"
    with gzip.open(C4, "rt") as f:
        texts.write_text("".join(next(f) for _ in range(20)))
    run_stage(TokenizeStage([str(texts)], str(tokenizer_dir), n_ctx=64, pack=True), packed, progress=False)
    src = score(packed, tiny_llama, tmp_path / "sp")
    assert export(src, tmp_path / "m", "megatron").exit_code == 0
    tokens, weights = megatron_docs(tmp_path / "m")
    assert len(tokens) == 20
    eos = json.loads((tmp_path / "m" / "export.json").read_text())["metadata"]["eos_id"]
    rows, _ = expected(src)
    assert np.array_equal(
        np.concatenate([tokens[i] for i in range(20)]), np.concatenate([r[1] for r in rows])
    )
    assert all(tokens[i][-1] == eos and (tokens[i][:-1] != eos).all() for i in range(20))
    assert np.array_equal(
        np.concatenate([weights[i] for i in range(20)]),
        np.concatenate([r[2] for r in rows]).astype(np.float16).astype(np.float32),
    )


def test_document_bounds_edge_cases():
    from entroweight.pipelines.export_data import Rows, document_bounds

    empty = Rows(
        "part-00000",
        np.array([], dtype=object),
        np.zeros(0, np.int32),
        np.zeros(1, np.int64),
        np.zeros(0),
        np.zeros(0),
        None,
    )
    assert document_bounds(empty, None).tolist() == [0]  # no phantom document
    rows = Rows(
        "p",
        np.array(["a", "a", "a", "b", "a"], dtype=object),
        np.array([0, 1, 0, 0, 0]),  # row_in_doc: rows 0-1 one document; rows 2 and 4 others named "a"
        np.array([0, 3, 5, 6, 8, 9]),
        np.zeros(9),
        np.zeros(9),
        None,
    )
    # the rows are grouped by row_in_doc, never by equal ids: three documents named "a"
    assert document_bounds(rows, None).tolist() == [0, 5, 6, 8, 9]


# -- LitData


def test_litdata_streaming_dataset_reads_every_row(scored_split, tmp_path):
    from litdata import StreamingDataset

    res = export(scored_split, tmp_path / "l", "litdata")
    assert res.exit_code == 0, res.output
    ds = StreamingDataset(str(tmp_path / "l"))
    rows, _ = expected(scored_split)
    assert len(ds) == len(rows)
    for i, (doc_id, ids, w) in enumerate(rows):
        s = ds[i]
        assert s["doc_id"] == doc_id and s["input_ids"].dtype == np.uint16 and s["weight"].dtype == np.float16
        assert np.array_equal(s["input_ids"], ids) and np.array_equal(s["weight"], w.astype(np.float16))
    assert [s["doc_id"] for s in ds] == [r[0] for r in rows]  # iteration: the shard order


# -- the hub layout


def test_hf_layout_loads_with_datasets(scored, tmp_path):
    import datasets
    import yaml

    # a workflow's run directory: the card carries its BPB table
    root = tmp_path / "run"
    shutil.copytree(scored, root / "scores" / "causal_loss")
    (root / "run.json").write_text(json.dumps({"config": {"eval": {"out": "ev"}}}))
    (root / "ev" / "weighted").mkdir(parents=True)
    (root / "ev" / "weighted" / "seed-0.json").write_text(  # sealed, as the workflow's step writes it
        json.dumps(sealed({"run": "weighted", "seed": 0, "loss": "weighted_ce", "bpb": 2.3456, "key": "x"}))
    )
    (root / "ev" / "unigram.json").write_text(json.dumps(sealed({"bpb": 4.5})))
    # the held-out split's evaluation of the same run and seed: not a second row of the main table
    (root / "ev" / "weighted" / "seed-0.heldout.json").write_text(
        json.dumps(sealed({"run": "weighted", "seed": 0, "loss": "weighted_ce", "bpb": 9.876, "key": "y"}))
    )
    out = tmp_path / "hub"
    res = export(root / "scores" / "causal_loss", out, "hf")
    assert res.exit_code == 0, res.output

    # its own cache: datasets may reuse an earlier test run's cached copy of a directory named alike
    ds = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert ds.features["input_ids"] == datasets.List(datasets.Value("uint16"))
    assert ds.features["weight"] == datasets.List(datasets.Value("float16"))
    rows, _ = expected(scored)
    assert ds.num_rows == len(rows)
    for got, (doc_id, ids, w) in zip(ds.with_format("numpy"), rows, strict=True):
        assert got["doc_id"] == doc_id
        assert np.array_equal(got["input_ids"], ids) and np.array_equal(got["weight"], w.astype(np.float16))

    from huggingface_hub import DatasetCard  # what push_to_hub and the hub read the card with

    card_data = DatasetCard.load(out / "README.md").data.to_dict()
    assert card_data["configs"][0]["data_files"][0]["split"] == "train"
    card = (out / "README.md").read_text()
    header = yaml.safe_load(card.split("---")[1])
    assert header["configs"][0]["data_files"][0]["path"] == "data/train-*"
    assert header["dataset_info"]["splits"][0]["num_examples"] == len(rows)
    # a split as `datasets` reads it (without num_bytes it warned "The `splits` field in YAML is malformed")
    assert datasets.splits.SplitDict._from_yaml_list(header["dataset_info"]["splits"])["train"].num_bytes > 0
    assert "| document steps | `[]` |" in card  # what dropped documents (none here), as export.json says
    meta = json.loads((out / "export.json").read_text())["metadata"]
    for fact in (
        meta["tokenizer_sha256"],
        "causal_loss",
        meta["model_sha256"],
        '"method": "minmax"',
        str(sum(len(r[1]) for r in rows)),
    ):
        assert fact in card
    assert "| weighted | 0 | weighted_ce | 2.3456 |" in card and "| unigram baseline |" in card
    assert "9.876" not in card


# -- refusals: exit 2, one clear line, nothing written


@pytest.mark.parametrize(
    "case,message",
    [
        ("unscored", "holds the output of `tokenize`, not weighted data"),
        ("empty", "is not a stage's output (no .stage.json)"),
        ("incomplete", "is incomplete (part-"),
        ("shard_gone", "is incomplete (part-"),
        ("mds", "MosaicML Streaming (mds) is not supported"),
        ("unknown", "unknown format 'parquet'"),
        ("out_is_src", "is SCORED"),
        ("out_inside_src", "lies inside SCORED"),
        ("out_holds_src", "holds SCORED"),
        ("not_empty", "holds files of no entroweight command (keep.txt)"),
    ],
)
def test_refusals(scored, small_data, tmp_path, case, message):  # noqa: F811
    src, out, fmt = tmp_path / "src", tmp_path / "out", "hf"
    shutil.copytree(scored, src)
    if case == "unscored":
        shutil.rmtree(src)
        shutil.copytree(small_data, src)
    elif case == "empty":
        shutil.rmtree(src)
        src.mkdir()
    elif case == "incomplete":
        (src / f".{DataDir(src).parts[1].manifest.shard}.manifest.json").unlink()
    elif case == "shard_gone":
        (src / DataDir(src).parts[2].name).unlink()
    elif case in ("mds", "unknown"):
        fmt = "mds" if case == "mds" else "parquet"
    elif case == "out_is_src":
        out = src
    elif case == "out_inside_src":
        out = src / "export"
    elif case == "out_holds_src":
        out.mkdir()
        src = shutil.move(src, out / "src")
    elif case == "not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    res = export(src, out, fmt, *(["--overwrite"] if case == "out_holds_src" else []))
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_overwrite_replaces_an_export_never_a_users_files(scored, tmp_path):
    out = tmp_path / "out"
    assert export(scored, out, "hf").exit_code == 0
    (out / "stale.bin").write_text("x")  # an older export's file: --overwrite replaces the export whole
    res = export(scored, out, "litdata", "--overwrite")
    assert res.exit_code == 0, res.output
    assert not (out / "stale.bin").exists() and (out / "index.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left beside it
    # a user's files are no export: refused, --overwrite or not, and kept
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / ".git").mkdir()
    for extra in ([], ["--overwrite"]):
        res = export(scored, mine, "litdata", *extra)
        assert res.exit_code == 2 and "holds files of no entroweight command (notes.txt)" in res.output, (
            res.output
        )
    (mine / "notes.txt").unlink()  # hidden files alone: the export is written beside them, kept
    res = export(scored, mine, "litdata", "--overwrite")
    assert res.exit_code == 0 and (mine / "index.json").exists(), res.output
    assert (mine / ".git").is_dir()


# -- the worked examples run


def test_examples_train(scored, tmp_path):
    litdata_loop = example("weighted_litdata_loop").main
    megatron_loop = example("weighted_megatron_dataset").main

    assert export(scored, tmp_path / "l", "litdata").exit_code == 0
    assert export(scored, tmp_path / "m", "megatron").exit_code == 0
    _, losses = litdata_loop(str(tmp_path / "l"), steps=4, batch_size=8)
    assert len(losses) == 4 and all(np.isfinite(losses))
    _, losses = megatron_loop(str(tmp_path / "m"), steps=4, batch_size=8, seq_length=32)
    assert len(losses) == 4 and all(np.isfinite(losses))


def test_an_out_that_is_a_link_is_exported_where_it_leads(scored, tmp_path):
    """export-data renames its export into place: over a symlink --out it was a traceback (`rmtree`
    on a link, or a rename onto a dangling one) after the whole export was written (an audit's
    finding). It writes where the link leads, and the link stays a link to it."""
    cases = {"to-empty": tmp_path / "empty", "dangling": tmp_path / "nothere", "to-export": tmp_path / "done"}
    cases["to-empty"].mkdir()
    r = CliRunner().invoke(
        main, ["export-data", str(scored), "--format", "hf", "--out", str(cases["to-export"])]
    )
    assert r.exit_code == 0, r.output
    for name, target in cases.items():
        link = tmp_path / f"link-{name}"
        link.symlink_to(target, target_is_directory=True)
        extra = ["--overwrite"] if name == "to-export" else []
        r = CliRunner().invoke(
            main, ["export-data", str(scored), "--format", "hf", "--out", str(link), *extra]
        )
        assert r.exit_code == 0 and "Traceback" not in r.output, (name, r.output, r.exception)
        assert link.is_symlink() and link.resolve() == target.resolve(), name
        assert (target / "export.json").is_file(), name
    assert not list(tmp_path.glob(".*export-tmp"))


@pytest.mark.parametrize("fmt", ["hf", "megatron", "litdata"])
def test_a_rerun_of_the_same_export_does_nothing(scored, tmp_path, fmt):
    """Rule: a command rerun as it was (a scheduler's retry, or after a kill that came just after the
    export was renamed into place) completes as the stages do: "nothing to do", exit 0, the export
    untouched; it was refused ("already holds an export"). Another source or format, or an export
    whose files differ from its record, is refused as before (a kept output: entroweight.output)."""
    out = tmp_path / "out"
    assert export(scored, out, fmt).exit_code == 0
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    res = export(scored, out, fmt)
    assert res.exit_code == 0 and res.output.startswith(f"nothing to do: {out} already holds this export"), (
        res.output
    )
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()} == files
    res = export(scored, out, "hf" if fmt != "hf" else "megatron")
    assert res.exit_code == 2 and "holds an export of other options (format: " in res.output, res.output
    moved = shutil.copytree(scored, tmp_path / "moved")  # the same shards elsewhere: named as such
    res = export(moved, out, fmt)
    assert res.exit_code == 2 and "an export of other options (source: " in res.output, res.output
    # a byte flipped at the same size, then a file removed: the export's files are not as recorded
    victim = sorted(p for p in files if p.name != "export.json")[-1]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    for _ in range(2):
        res = export(scored, out, fmt)
        assert res.exit_code == 2 and "whose files differ from its record" in res.output, res.output
        victim.unlink(missing_ok=True)
    assert export(scored, out, fmt, "--overwrite").exit_code == 0
