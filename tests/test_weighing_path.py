"""One weighing path: scoring with a weighting W writes the same shard bytes (provenance aside) as
scoring with the default and re-weighing with W, for every scorer, weighting method and layout
(left-padded, split, packed); and a document step (--min-mean-weight) plugs into both stages.

The cases are enumerated from the code: every built-in scorer (scorers.registry.BUILTIN), every
weighting method (WeighConfig's `method` choices), every layout the tokenize stage writes.
"""

from __future__ import annotations

import gzip
import json
import shutil
import typing

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from entroweight.models.checkpoint import save_checkpoint
from entroweight.models.estimator import EntropyEstimator
from entroweight.models.llama import Llama
from entroweight.pipelines import StageError, run_stage
from entroweight.pipelines import score as score_module
from entroweight.pipelines import weigh as weigh_module
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.pipelines.verify import verify_dir
from entroweight.pipelines.weigh import WeighStage
from entroweight.schemas import read_file_metadata
from entroweight.schemas.datadir import STAGE_KINDS, DataDir
from entroweight.schemas.manifest import manifest_name
from entroweight.schemas.weighted import excluded_mask, weights_matrix
from entroweight.scorers.registry import BUILTIN
from entroweight.transforms.select import MinMeanWeight
from entroweight.transforms.weigh import WeighConfig, entropy_quantiles

N_CTX = 24
VOCAB = 1024
LAYOUTS = {"left": {"overflow": "truncate"}, "split": {"overflow": "split"}, "packed": {"pack": True}}
METHODS = typing.get_args(WeighConfig.model_fields["method"].annotation)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, c4_path, tokenizer_dir):
    """12 C4 documents of mixed lengths (some longer than a row) in each layout, one shard each."""
    src = tmp_path_factory.mktemp("src") / "c4.jsonl.gz"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        docs = [json.loads(next(f)) for _ in range(12)]
    with gzip.open(src, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            d["text"] = " ".join(d["text"].split()[: 3 + 4 * i])
            f.write(json.dumps(d) + "\n")
    out = {}
    for name, kw in LAYOUTS.items():
        out[name] = tmp_path_factory.mktemp(f"tok-{name}")
        run_stage(TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX, **kw), out[name], progress=False)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory, layouts, tokenizer_dir):
    sha = read_file_metadata(next(layouts["left"].glob("part-*.parquet")))["tokenizer_sha256"]
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)

    def estimator(n_ctx):
        cfg = EntropyEstimator.Config(
            vocab_size=VOCAB, n_ctx=n_ctx, injection="token", encoder="mixer", decoder="llama",
            encoder_config={"d_model": 16, "n_layers": 1},
            decoder_config={"d_model": 16, "n_layers": 1, "n_heads": 2},
            embed_dim=8, noise="none", init_std=0.2,
        )  # fmt: skip
        return EntropyEstimator(cfg).eval()

    def save(model, name, kind):
        return str(
            save_checkpoint(
                model, kind, root / name, tokenizer_sha256=sha, n_ctx=model.config.n_ctx, pad_id=0
            )
        )

    from transformers import LlamaConfig, LlamaForCausalLM

    hf_dir = root / "hf"
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        )  # fmt: skip
    ).save_pretrained(hf_dir)
    shutil.copy(tokenizer_dir / "tokenizer.json", hf_dir / "tokenizer.json")
    llama = Llama(Llama.Config(vocab_size=VOCAB, n_ctx=N_CTX, d_model=16, n_layers=1, n_heads=2, d_ff=32))
    return {
        "est": save(estimator(N_CTX), "est", "estimator"),
        "short": save(estimator(N_CTX - 1), "short", "estimator"),
        "llama": save(llama.eval(), "llama", "llama"),
        "hf": str(hf_dir),
    }


# every built-in scorer, with the options that make it run on the tiny models above
SCORERS = {
    "causal_loss": lambda m: {"checkpoint": m["llama"]},
    "cross_tokenizer": lambda m: {"model": m["hf"], "context": 8},
    "occlusion": lambda m: {"checkpoint": m["est"]},
    "decomposition": lambda m: {"checkpoint": m["est"]},
    "two_model": lambda m: {"checkpoint": m["est"], "checkpoint_short": m["short"]},
    "grad_input": lambda m: {"checkpoint": m["est"]},
    "excess_loss": lambda m: {"checkpoint": m["llama"], "reference": m["hf"], "cross_tokenizer": True},
}


def test_every_builtin_scorer_is_covered():
    assert set(SCORERS) == set(BUILTIN)


def data_table(directory) -> pa.Table:
    """The shard's data: its columns and their types, without the file metadata (provenance)."""
    (f,) = DataDir(directory).files
    t = pq.read_table(f)
    return t.replace_schema_metadata(None)


def weightings(default_dir) -> dict[str, WeighConfig]:
    q = entropy_quantiles(default_dir)
    out = {
        "minmax": WeighConfig(method="minmax", clip=(0.1, 0.9), floor=0.05, dtype="uint8"),
        "quantile": WeighConfig(method="quantile", quantiles=q, invert=True),
        "raw": WeighConfig(method="raw", dtype="uint8"),
        "topk": WeighConfig(method="topk", quantiles=q, keep=0.6),
    }
    assert set(out) == set(METHODS)  # a new method must be added here
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("scorer", list(SCORERS))
def test_scoring_with_w_equals_reweighing_with_w(scorer, layout, layouts, models, tokenizer_dir, tmp_path):
    options = {**SCORERS[scorer](models), "dtype": "fp32"}
    tok = str(tokenizer_dir / "tokenizer.json")

    def score(out, w=None):
        run_stage(ScoreStage(layouts[layout], scorer, options, w, tokenizer=tok), out, progress=False)
        return out

    default = score(tmp_path / "default")
    cases = weightings(default)
    # every method on the separator-holding case, one method (chosen by the case) elsewhere: a scorer
    # that excludes positions is cross_tokenizer (and excess_loss through it) on packed rows
    pick = (list(SCORERS).index(scorer) + list(LAYOUTS).index(layout)) % len(cases)
    names = list(cases) if (scorer == "cross_tokenizer" and layout == "packed") else [list(cases)[pick]]
    for name in names:
        w = cases[name]
        direct = data_table(score(tmp_path / f"score-{name}", w))
        run_stage(WeighStage(default, w), tmp_path / f"weigh-{name}", progress=False)
        again = data_table(tmp_path / f"weigh-{name}")
        assert direct.schema.equals(again.schema), name
        for col in direct.column_names:
            assert direct.column(col).equals(again.column(col)), (name, col)
    if layout == "packed" and scorer in ("cross_tokenizer", "excess_loss"):
        t = pq.read_table(DataDir(default).files[0])
        excluded = excluded_mask(t.column("excluded"), N_CTX)
        assert excluded is not None and excluded.any()  # separators are stored...
        assert (weights_matrix(t.column("weight"))[excluded] == 0).all()  # ...and weigh 0


def test_quantiles_leave_excluded_positions_out(layouts, models, tokenizer_dir, tmp_path):
    options = {**SCORERS["cross_tokenizer"](models), "dtype": "fp32"}
    out = tmp_path / "s"
    run_stage(
        ScoreStage(
            layouts["packed"], "cross_tokenizer", options, tokenizer=str(tokenizer_dir / "tokenizer.json")
        ),
        out,
        progress=False,
    )
    t = pq.read_table(DataDir(out).files[0])
    e = np.stack(t.column("entropy").to_numpy(zero_copy_only=False))
    n_pad = t.column("n_pad").to_numpy()
    keep = (np.arange(N_CTX)[None, :] >= n_pad[:, None]) & ~excluded_mask(t.column("excluded"), N_CTX)
    want = np.quantile(e[keep], np.linspace(0, 1, 101))
    np.testing.assert_allclose(entropy_quantiles(out), want)


@pytest.mark.parametrize("layout", ["left", "split"])
def test_min_mean_weight_drops_whole_documents_as_counted_rejects(layout, layouts, models, tmp_path):
    options = {**SCORERS["causal_loss"](models), "dtype": "fp32"}
    base = tmp_path / "all"
    run_stage(ScoreStage(layouts[layout], "causal_loss", options), base, progress=False)
    t = pq.read_table(DataDir(base).files[0])
    w = weights_matrix(t.column("weight"))
    real = np.arange(N_CTX)[None, :] >= t.column("n_pad").to_numpy()[:, None]
    doc_ids = t.column("doc_id").to_pylist()
    docs = list(dict.fromkeys(doc_ids))
    mean = {d: w[np.array(doc_ids) == d][real[np.array(doc_ids) == d]].mean() for d in docs}
    threshold = float(np.median(list(mean.values())))
    low = {d for d in docs if mean[d] < threshold}
    assert 0 < len(low) < len(docs)

    # the step on the score stage, and on the weigh stage reading the unfiltered output: same result
    for name, stage in {
        "score": ScoreStage(layouts[layout], "causal_loss", options, steps=[MinMeanWeight(threshold)]),
        "weigh": WeighStage(base, WeighConfig(), steps=[MinMeanWeight(threshold)]),
    }.items():
        out = tmp_path / name
        run_stage(stage, out, progress=False)
        kept = pq.read_table(DataDir(out).files[0])
        assert set(kept.column("doc_id").to_pylist()) == set(docs) - low  # all rows of a dropped document
        (m,) = DataDir(out).parts[0:1]
        manifest = m.manifest
        assert manifest.rejected == {"low_weight": len(low)}
        assert manifest.docs_in == len(docs) and manifest.docs_out == len(docs) - len(low)
        assert manifest.rows_in == t.num_rows and manifest.rows_out == kept.num_rows
        rejects = pq.read_table(DataDir(out).rejects_location(m.name)).to_pylist()
        assert {r["id"] for r in rejects} == low and {r["reason"] for r in rejects} == {"low_weight"}
        assert verify_dir(out) == []


def test_min_mean_weight_is_refused_on_packed_rows_before_anything_is_written(layouts, models, tmp_path):
    options = {**SCORERS["causal_loss"](models), "dtype": "fp32"}
    out = tmp_path / "out"
    with pytest.raises(StageError, match="packed row holds parts of several"):
        run_stage(ScoreStage(layouts["packed"], "causal_loss", options, steps=[MinMeanWeight(0.5)]), out)
    assert not out.exists() or not any(out.iterdir())


# -- the shuffled control and derived values go through the same path
def _score(layout, scorer, models, out, w=None, **extra):
    options = {**SCORERS[scorer](models), "dtype": "fp32", **extra}
    run_stage(ScoreStage(layout, scorer, options, w), out, progress=False)  # the data carries its tokenizer
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shuffled_weights_keep_each_rows_weights_and_move_them(layout, layouts, models, tmp_path):
    """The control: each row's weights, the same multiset, on other real tokens; pads and excluded
    positions (cross_tokenizer's separators on packed rows) keep weight 0 where they are; seeded by the
    row's seq_id, so score and weigh write the same bytes and a rerun the same permutation."""
    default = _score(layouts[layout], "cross_tokenizer", models, tmp_path / "default")
    shuffled = WeighConfig(shuffle=7)
    direct = data_table(_score(layouts[layout], "cross_tokenizer", models, tmp_path / "direct", shuffled))
    run_stage(WeighStage(default, shuffled), tmp_path / "weigh", progress=False)
    again = data_table(tmp_path / "weigh")
    for col in direct.column_names:
        assert direct.column(col).equals(again.column(col)), col
    base = data_table(default)
    assert base.column("entropy").equals(again.column("entropy"))  # the stored values stay the scorer's
    w0, w1 = weights_matrix(base.column("weight")), weights_matrix(again.column("weight"))
    real = np.arange(N_CTX)[None, :] >= base.column("n_pad").to_numpy()[:, None]
    excluded = excluded_mask(base.column("excluded"), N_CTX)
    weighable = real & ~excluded if excluded is not None else real
    if layout == "packed":
        assert excluded is not None and excluded.any()
    assert (w1[~weighable] == 0).all() and (w0[~weighable] == 0).all()
    moved = rows = 0
    for r in range(len(w0)):
        a, b = w0[r, weighable[r]], w1[r, weighable[r]]
        np.testing.assert_array_equal(np.sort(a), np.sort(b))
        if len(np.unique(a)) >= 4:
            rows += 1
            moved += not np.array_equal(a, b)
    assert rows >= 5 and moved == rows
    # another seed, another permutation
    run_stage(WeighStage(default, WeighConfig(shuffle=8)), tmp_path / "seed8", progress=False)
    assert not data_table(tmp_path / "seed8").column("weight").equals(again.column("weight"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_derived_excess_equals_the_excess_loss_scorer(layout, layouts, models, tmp_path):
    """Rho-1's excess from stored losses (causal_loss minus cross_tokenizer `sum` on the same tokens,
    the weigh stage's difference) is the excess_loss scorer's, which runs both models itself."""
    data = layouts[layout]
    causal = _score(data, "causal_loss", models, tmp_path / "causal")
    large = _score(data, "cross_tokenizer", models, tmp_path / "large", aggregate="sum")
    excess = _score(data, "excess_loss", models, tmp_path / "excess", context=8)  # the same windows
    run_stage(
        WeighStage(causal, WeighConfig(), combine=("difference", large)), tmp_path / "d", progress=False
    )
    assert verify_dir(tmp_path / "d") == []
    got, want = data_table(tmp_path / "d"), data_table(excess)
    for col in ("seq_id", "input_ids", "n_pad", "excluded"):
        assert got.column(col).equals(want.column(col)), col
    e_got = np.stack(got.column("entropy").to_numpy(zero_copy_only=False))
    e_want = np.stack(want.column("entropy").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(e_got, e_want, atol=1e-5, rtol=0)
    meta = read_file_metadata(DataDir(tmp_path / "d").files[0])
    assert meta["unit"] == "nats_difference" == read_file_metadata(DataDir(excess).files[0])["unit"]
    assert (meta["derived"]["op"], meta["derived"]["b"]["aggregate"]) == ("difference", "sum")


def test_derived_values_refuse_other_tokens_and_mean_losses(layouts, models, tmp_path):
    causal = _score(layouts["left"], "causal_loss", models, tmp_path / "causal")
    split = _score(layouts["split"], "causal_loss", models, tmp_path / "split")
    mean = _score(layouts["left"], "cross_tokenizer", models, tmp_path / "mean")  # aggregate: mean
    for other, match in ((split, "other parts or rows"), (mean, "aggregate: sum")):
        out = tmp_path / f"out-{other.name}"
        with pytest.raises(StageError, match=match):
            run_stage(WeighStage(causal, WeighConfig(), combine=("difference", other)), out, progress=False)
        assert not out.exists() or not any(out.glob("part-*"))


def test_same_tokens_refuses_rows_that_differ(layouts):
    from entroweight.transforms.derive import DeriveError, same_tokens

    t = pq.read_table(DataDir(layouts["left"]).files[0]).to_batches()[0]
    ids = t.column("input_ids").to_pylist()
    ids[1][-1] = (ids[1][-1] + 1) % VOCAB
    other = t.set_column(
        t.schema.get_field_index("input_ids"), "input_ids", pa.array(ids, t.schema.field("input_ids").type)
    )
    same_tokens(t, t, "x")
    with pytest.raises(DeriveError, match="different input_ids"):
        same_tokens(t, other, "x")


def test_a_row_sample_scores_each_shards_first_rows_and_verifies(layouts, models, tmp_path):
    """limit_rows: the first N rows of each shard (the decomposition's sample), its input recorded as
    that row range, so verify checks the rows against it; an unlimited score's config is unchanged."""
    data = layouts["left"]
    options = {**SCORERS["causal_loss"](models), "dtype": "fp32"}
    full = ScoreStage(data, "causal_loss", options)
    sample = ScoreStage(data, "causal_loss", options, rows=5)
    assert "rows" not in full.config() and sample.config()["rows"] == 5
    run_stage(full, tmp_path / "full", progress=False)
    run_stage(sample, tmp_path / "sample", progress=False)
    assert verify_dir(tmp_path / "sample") == []
    got, want = data_table(tmp_path / "sample"), data_table(tmp_path / "full").slice(0, 5)
    assert got.num_rows == 5 and got.equals(want)
    (part,) = DataDir(tmp_path / "sample").parts
    assert (part.manifest.rows_in, part.manifest.inputs[0].stop) == (5, 5)
    with pytest.raises(StageError, match="at least 1"):
        ScoreStage(data, "causal_loss", options, rows=0)


def test_min_mean_weight_tells_documents_apart_by_row_in_doc_not_by_id():
    """Two documents with one id (kept by default) are judged apart; a document split over rows, and
    over two batches fed one after the other, is judged whole."""
    import pyarrow as pa

    from entroweight.schemas.weighted import lists

    def batch(ids, row_in_doc, w):
        w = np.asarray(w, np.float16)
        return pa.record_batch(
            {
                "doc_id": ids,
                "row_in_doc": pa.array(row_in_doc, pa.int32()),
                "n_pad": pa.array([0] * len(ids), pa.int32()),
                "excluded": pa.array([[] for _ in ids], pa.list_(pa.int32())),
                "weight": lists(w, pa.float16()),
            }
        )

    step = MinMeanWeight(0.5)
    # "a" low, "a" again (another document) high, "b" over three rows (mean 0.6) across the two batches
    kept1, rej1 = step.feed(batch(["a", "a", "b"], [0, 0, 0], [[0.1, 0.1], [0.9, 0.9], [0.2, 0.2]]), "src")
    kept2, rej2 = step.feed(batch(["b", "b", "c"], [1, 2, 0], [[0.8, 0.8], [0.8, 0.8], [0.1, 0.1]]), "src")
    kept3, rej3 = step.finish("src")
    kept = pa.concat_tables([kept1, kept2, kept3])
    assert kept.column("doc_id").to_pylist() == ["a", "b", "b", "b"]
    assert kept.column("row_in_doc").to_pylist() == [0, 0, 1, 2]
    assert [r["id"] for r in rej1 + rej2 + rej3] == ["a", "c"]


# -- documents are counted as tokenize counts them, by every stage that writes weighted data
# synthesize reads no documents: each row it draws is one document (tests/test_synthesize.py counts them)
DRAWS_ITS_OWN = {"synthesize"}
WEIGHTED_STAGES = sorted(
    n for n, kind in STAGE_KINDS.items() if kind == "weighted" and n not in DRAWS_ITS_OWN
)


def _chain(layout_dir, models, tmp_path, monkeypatch) -> dict[str, DataDir]:
    """Each weighted stage run over `layout_dir` (weigh over score's output), in segments of 2 rows,
    so documents go on across segment edges as they do across a real shard's."""
    monkeypatch.setattr(score_module, "SEGMENT_TOKENS", 0)
    monkeypatch.setattr(score_module, "MIN_SEGMENT_ROWS", 2)
    monkeypatch.setattr(weigh_module, "READ_ROWS", 2)
    run = {
        "score": lambda out: _score(layout_dir, "causal_loss", models, out),
        "weigh": lambda out: run_stage(WeighStage(tmp_path / "score", WeighConfig()), out, progress=False),
    }
    assert sorted(run) == WEIGHTED_STAGES  # a new weighted stage is added here
    for name in WEIGHTED_STAGES:
        run[name](tmp_path / name)
    return {name: DataDir(tmp_path / name) for name in WEIGHTED_STAGES}


@pytest.mark.parametrize("layout", [*LAYOUTS, "packed-shards"])
def test_weighted_stages_count_documents_as_tokenize_does(
    layout, layouts, models, tokenizer_dir, tmp_path, monkeypatch
):
    """score and weigh record, per shard, the documents tokenize put out (not their rows: a packed row
    holds several documents and a document several rows), and verify checks that the counts chain."""
    if layout == "packed-shards":  # packed, 12 documents over 3 shards
        src = DataDir(layouts["packed"]).parts[0].manifest.inputs[0].uri
        data = tmp_path / "tok"
        stage = TokenizeStage([src], str(tokenizer_dir), n_ctx=N_CTX, pack=True, shard_docs=5)
        run_stage(stage, data, progress=False)
    else:
        data = layouts[layout]
    tokenized = {p.name: p.manifest for p in DataDir(data).parts}
    assert sum(m.docs_out for m in tokenized.values()) == 12
    if layout.startswith("packed"):  # the case where rows are not documents
        assert sum(m.rows_out for m in tokenized.values()) > 12
    for name, out in _chain(data, models, tmp_path, monkeypatch).items():
        got = {p.name: (p.manifest.docs_in, p.manifest.docs_out) for p in out.parts}
        assert got == {k: (m.docs_out, m.docs_out) for k, m in tokenized.items()}, name
        assert verify_dir(out.root) == [], name


def test_verify_refuses_packed_rows_counted_as_documents(layouts, models, tmp_path):
    """A weighted shard whose manifest counts packed rows as documents (as score and weigh once did)
    fails verify three times: its counts do not chain to what tokenize kept (the rule every reader
    applies), its rows hold other documents, and its input put out other documents."""
    out = _score(layouts["packed"], "causal_loss", models, tmp_path / "score")
    (part,) = DataDir(out).parts
    manifest = out / manifest_name(part.manifest.shard)
    m = json.loads(manifest.read_text())
    assert m["docs_in"] == 12 < m["rows_in"]
    manifest.write_text(json.dumps({**m, "docs_in": m["rows_in"], "docs_out": m["rows_in"]}))
    problems = verify_dir(out)
    assert len(problems) == 3, problems
    assert f"score read {m['rows_in']} documents of the 12 tokenize kept" in problems[0]
    assert f"its rows hold 12 documents, its manifest says {m['rows_in']} out" in problems[1]
    assert f"{m['rows_in']} documents in, its input" in problems[2] and "put out 12" in problems[2]
