"""The score stage end to end on real parquet: tiny HF Llama (causal_loss), all three engines, the CLI."""

from __future__ import annotations

import gzip
import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from entroweight.pipelines import StageError, run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.stage import read_manifests
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.schemas import read_file_metadata, weighted_sequence_schema
from entroweight.transforms.weigh import WeighConfig
from entroweight.workflows.cli.main import main


def tiny_llama_dir(out, tokenizer_json, vocab_size=1024):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    shutil.copy(tokenizer_json, out / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer_dir):
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny"), tokenizer_dir / "tokenizer.json")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, c4_path, tokenizer_dir):
    """60 C4 documents, n_ctx 64, left-padded, one row each (longer ones truncated), 3 shards of 20."""
    src = tmp_path_factory.mktemp("src") / "c4.jsonl.gz"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(60)]
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.writelines(lines)
    out = tmp_path_factory.mktemp("small_tokens")
    # one row per document (the write-up's layout): the scoring tests count rows as documents
    stage = TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=64, shard_docs=20, overflow="truncate")
    run_stage(stage, out, progress=False)
    return out


def stage(data, model, **kw):
    opts = {"model": str(model), "dtype": "fp32", "batch_size": 8}
    return ScoreStage(data, "causal_loss", opts, kw.pop("weighting", None), **kw)


@pytest.fixture(scope="module")
def local_scored(tmp_path_factory, small_data, tiny_llama):
    out = tmp_path_factory.mktemp("scored_local")
    summary = run_stage(stage(small_data, tiny_llama), out, progress=False)
    assert summary.shards_run == 3 and summary.rows_out == 60
    return out


def test_weighted_shards_follow_the_contract(local_scored, small_data, tiny_llama):
    names = sorted(p.name for p in small_data.glob("part-*.parquet"))
    assert sorted(p.name for p in local_scored.glob("part-*.parquet")) == names  # same part names
    meta = read_file_metadata(local_scored / names[0])
    assert meta["stage"] == "score" and meta["scorer"] == "causal_loss" and meta["model"] == tiny_llama.name
    assert len(meta["model_sha256"]) == 64 and meta["weighting"]["method"] == "minmax"
    assert meta["tokenizer_sha256"] == read_file_metadata(small_data / names[0])["tokenizer_sha256"]
    for name in names:
        src, out = pq.read_table(small_data / name), pq.read_table(local_scored / name)
        assert out.schema.remove_metadata() == weighted_sequence_schema(1024).remove_metadata()
        assert out.column("input_ids").equals(src.column("input_ids"))
        e = np.stack(out.column("entropy").to_numpy(zero_copy_only=False))
        w = np.stack(out.column("weight").to_numpy(zero_copy_only=False)).astype(np.float32)
        pad = np.arange(64)[None] < out.column("n_pad").to_numpy()[:, None]
        assert (e[pad] == 0).all() and (w[pad] == 0).all()
        assert (e[~pad] > 0).all() and (w >= 0).all() and (w <= 1).all()
        # the stage writes what the scorer computes on the same rows
        s = stage(small_data, tiny_llama).scorer
        s.setup()
        ids = np.stack(src.column("input_ids").to_numpy(zero_copy_only=False))
        np.testing.assert_allclose(e, s.score(ids, src.column("n_pad").to_numpy()).values, atol=1e-5)
    assert read_manifests(local_scored)[0].extra["scorer"] == "causal_loss"


def test_loads_with_datasets_and_reruns_are_incremental(local_scored, small_data, tiny_llama):
    import datasets

    ds = datasets.load_dataset("parquet", data_dir=str(local_scored), split="train")
    assert ds.num_rows == 60 and {"entropy", "weight"} <= set(ds.column_names)
    again = run_stage(stage(small_data, tiny_llama), local_scored, progress=False)
    assert again.shards_run == 0 and again.shards_done_before == 3


def test_refuses_data_of_another_tokenizer(tmp_path, small_data, llama3_tokenizer, tokenizer_dir):
    other = tiny_llama_dir(tmp_path / "llama3_tiny", llama3_tokenizer, vocab_size=128256)
    # refused as planning starts (a stage's constructor reads nothing), before anything is written
    for given in (str(tokenizer_dir), None):  # --tokenizer, or the one the data carries: the same answer
        with pytest.raises(StageError, match="differ: ids mean different text; use --scorer cross_tokenizer"):
            stage(small_data, other, tokenizer=given).plan_inputs()
    with pytest.raises(StageError, match="is not the tokenizer"):
        stage(small_data, other, tokenizer=str(llama3_tokenizer)).plan_inputs()
    # data made before directories carried their tokenizer: the scorer that reads text asks for it
    bare = tmp_path / "bare"
    shutil.copytree(small_data, bare, ignore=shutil.ignore_patterns(".tokenizer"))
    with pytest.raises(StageError, match="--tokenizer"):
        ScoreStage(bare, "cross_tokenizer", {"model": str(other)}).plan_inputs()


@pytest.fixture(scope="module")
def ray_session():
    from entroweight.pipelines.ray import start_ray

    ray, _ = start_ray(None)
    yield ray
    ray.shutdown()


def rows(out):
    tables = [pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))]
    ids = np.concatenate([np.stack(t.column("input_ids").to_numpy(zero_copy_only=False)) for t in tables])
    e = np.concatenate([np.stack(t.column("entropy").to_numpy(zero_copy_only=False)) for t in tables])
    w = np.concatenate([np.stack(t.column("weight").to_numpy(zero_copy_only=False)) for t in tables])
    return ids, e, w.astype(np.float32)


@pytest.mark.parametrize(
    "engine,workers",
    [("beam", None), pytest.param("ray", 2, marks=pytest.mark.slow)],  # Ray's start costs ~20 s on 2 cores
)
def test_engine_parity(engine, workers, request, tmp_path, small_data, tiny_llama, local_scored):
    if engine == "ray":
        request.getfixturevalue("ray_session")
    summary = run_stage(
        stage(small_data, tiny_llama), tmp_path, engine=engine, progress=False, workers=workers
    )
    assert summary.shards_run == 3 and summary.rows_out == 60
    ids, e, w = rows(tmp_path)
    ids0, e0, w0 = rows(local_scored)
    np.testing.assert_array_equal(ids, ids0)
    np.testing.assert_allclose(e, e0, atol=1e-5)  # thread counts may reorder float sums
    np.testing.assert_allclose(w, w0, atol=2e-3)


def test_cli_uint8_weights_without_entropy(tmp_path, small_data, tiny_llama):
    out = tmp_path / "scored"
    args = [
        "score", str(small_data), "--scorer", "causal_loss", "--model", str(tiny_llama), "--out", str(out),
        "--weight-dtype", "uint8", "--drop-entropy", "--dtype", "fp32", "--floor", "0.1",
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    table = pq.read_table(next(out.glob("part-*.parquet")))
    assert "entropy" not in table.column_names
    w = np.stack(table.column("weight").to_numpy(zero_copy_only=False))
    assert w.dtype == np.uint8 and w.max() == 255
    real = np.arange(64)[None] >= table.column("n_pad").to_numpy()[:, None]
    assert w[real].min() == 26  # the floor: 0.1 rounded up to a step of 1/255
    meta = read_file_metadata(next(out.glob("part-*.parquet")))
    assert meta["weighting"]["dtype"] == "uint8" and meta["weighting"]["floor"] == 26 / 255  # as applied
    inspect = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert json.loads(inspect.output)["weight"]["max"] == 1.0


def test_cli_refusals_exit_2(tmp_path, small_data, tiny_llama):
    base = ["score", str(small_data), "--out", str(tmp_path / "o")]
    r = CliRunner().invoke(main, [*base, "--scorer", "nope", "--model", str(tiny_llama)])
    assert r.exit_code == 2 and "unknown scorer" in r.output
    bare = tmp_path / "bare"  # data made before directories carried their tokenizer
    shutil.copytree(small_data, bare, ignore=shutil.ignore_patterns(".tokenizer"))
    r = CliRunner().invoke(
        main,
        [
            "score",
            str(bare),
            "--out",
            str(tmp_path / "o"),
            "--scorer",
            "cross_tokenizer",
            "--model",
            str(tiny_llama),
        ],
    )
    assert r.exit_code == 2 and "--tokenizer" in r.output
    r = CliRunner().invoke(
        main, [*base, "--scorer", "causal_loss", "--model", str(tiny_llama), "--weighting", "quantile"]
    )
    assert r.exit_code == 2 and "--quantiles-from" in r.output


def test_quantile_weighting_from_a_scored_run(tmp_path, small_data, tiny_llama, local_scored):
    from entroweight.transforms.weigh import entropy_quantiles

    q = entropy_quantiles(local_scored)
    assert len(q) == 101 and q[0] < q[50] < q[100]
    run_stage(
        stage(small_data, tiny_llama, weighting=WeighConfig(method="quantile", quantiles=q)),
        tmp_path,
        progress=False,
    )
    _, e, w = rows(tmp_path)
    assert 0.4 < float(np.median(w[e > 0])) < 0.6  # quantile ranks: the median token weighs ~0.5


def test_custom_scorer_from_the_docs(tmp_path, small_data, tokenizer_dir):
    """The ten-line example of docs/scoring.md, registered in process, through the stage."""
    from entroweight.scorers import Scorer, register

    class TokenLength(Scorer):
        name = "token_length"
        needs_data_tokenizer = True

        def config(self):
            return {"scorer": self.name}

        def setup(self, data_tokenizer=None):
            self.nbytes = data_tokenizer.token_nbytes

        def score_batch(self, input_ids, n_pad):
            return self.nbytes[input_ids].astype(np.float32)

    register(TokenLength)
    run_stage(
        ScoreStage(small_data, "token_length", {}, tokenizer=str(tokenizer_dir)), tmp_path, progress=False
    )
    table = pq.read_table(next(tmp_path.glob("part-*.parquet")))
    ids = np.stack(table.column("input_ids").to_numpy(zero_copy_only=False))
    e = np.stack(table.column("entropy").to_numpy(zero_copy_only=False))
    pad = np.arange(64)[None] < table.column("n_pad").to_numpy()[:, None]
    from entroweight.transforms.tokenizer import load_tokenizer

    np.testing.assert_array_equal(e[~pad], load_tokenizer(tokenizer_dir).token_nbytes[ids[~pad]])
    assert (e[pad] == 0).all()
