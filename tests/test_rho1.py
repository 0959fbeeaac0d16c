"""Rho-1 as a recipe: excess loss against a reference on another tokenizer (SmolLM2-135M read through
the exact byte-level transfer), top-k selection by a global quantile, and the selective loss."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from test_scorers_cross import smollm2_gguf
from test_trainer_fixtures import tiny_ckpt, weighted_dir  # noqa: F401 - session fixtures

from entroweight.pipelines import run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.weigh import WeighStage
from entroweight.schemas import read_file_metadata
from entroweight.scorers import ScorerError, make_scorer
from entroweight.trainers.losses import compute_loss, per_token_ce
from entroweight.transforms.tokenizer import load_tokenizer
from entroweight.transforms.weigh import WeighConfig, entropy_quantiles, weigh
from entroweight.workflows.cli.main import main

KEEP = 0.6


@pytest.fixture(scope="module")
def small_data(tokenized_dir, tmp_path_factory) -> Path:
    """Two shards of 12 rows each (of the 1k-BPE C4 data)."""
    from stagecopy import stage_subset

    return stage_subset(tokenized_dir, tmp_path_factory.mktemp("rho1-data"), shards=2, rows=12)


def _rows(data: Path, n: int = 3, width: int = 40):
    t = pq.read_table(sorted(data.glob("part-*.parquet"))[0]).slice(0, n)
    ids = np.stack(t.column("input_ids").to_numpy(zero_copy_only=False)).astype(np.int64)
    n_pad = t.column("n_pad").to_numpy().astype(np.int64)
    return ids[:, -width:], np.maximum(n_pad - (ids.shape[1] - width), 0)


def _matrix(table, col):
    return np.stack(table.column(col).to_numpy(zero_copy_only=False)).astype(np.float64)


def test_excess_loss_with_a_cross_tokenizer_reference(small_data, tokenizer_dir, tiny_ckpt):  # noqa: F811
    tok = load_tokenizer(tokenizer_dir)
    ids, n_pad = _rows(small_data)
    opts = {"dtype": "fp32", "batch_size": 4}
    s = make_scorer(
        "excess_loss", checkpoint=str(tiny_ckpt), reference=str(smollm2_gguf()), cross_tokenizer=True, **opts
    )
    assert s.needs_data_tokenizer and s.unit == "nats_difference"
    s.check_data_tokenizer(tok.sha256, tok)  # SmolLM2's 49k vocabulary is not refused: it reads the text
    s.setup(tok)
    scored = s.score(ids, n_pad)
    got = scored.values
    model = make_scorer("causal_loss", checkpoint=str(tiny_ckpt), **opts)
    model.setup(tok)
    ref = make_scorer("cross_tokenizer", model=str(smollm2_gguf()), aggregate="sum", **opts)
    ref.setup(tok)
    want_ref = ref.score(ids, n_pad).values
    np.testing.assert_allclose(got, model.score(ids, n_pad).values - want_ref, atol=1e-4)
    # `sum` transfers SmolLM2's nats exactly: the reference side keeps each row's total
    assert scored.stats["alignment"].as_dict()["rel_err_total"] < 1e-5
    assert s.metadata()["start_token"]["token"] == "<|endoftext|>"
    assert s.config()["reference"]["aggregate"] == "sum"


def test_cross_tokenizer_reference_must_be_an_hf_model(tiny_ckpt):  # noqa: F811
    with pytest.raises(ScorerError, match="not one of our checkpoints"):
        make_scorer("excess_loss", checkpoint=str(tiny_ckpt), reference=str(tiny_ckpt), cross_tokenizer=True)
    with pytest.raises(ScorerError, match="--context / --stride"):
        make_scorer("excess_loss", checkpoint=str(tiny_ckpt), reference=str(tiny_ckpt), context=64)


@pytest.fixture(scope="module")
def scored(small_data, tiny_ckpt, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("rho1-scored") / "causal"
    stage = ScoreStage(small_data, "causal_loss", {"checkpoint": str(tiny_ckpt), "dtype": "fp32"})
    run_stage(stage, out, progress=False)
    return out


def _real_values(d: Path):
    vals, wts = [], []
    for f in sorted(d.glob("part-*.parquet")):
        t = pq.read_table(f)
        e, n_pad = _matrix(t, "entropy"), t.column("n_pad").to_numpy()
        real = np.arange(e.shape[1])[None, :] >= n_pad[:, None]
        vals.append(e[real])
        if "weight" in t.column_names:
            wts.append(_matrix(t, "weight")[real])
    return np.concatenate(vals), (np.concatenate(wts) if wts else None)


def test_topk_keeps_the_global_top_fraction(scored):
    values, _ = _real_values(scored)
    cfg = WeighConfig(method="topk", keep=KEEP, quantiles=entropy_quantiles(scored))
    threshold = np.quantile(values, 1 - KEEP)
    w = weigh(values[None, :], np.array([0]), cfg)[0]
    assert set(np.unique(w)) == {0.0, 1.0}
    np.testing.assert_array_equal(w == 1.0, values >= threshold - 1e-6)
    assert w.mean() == pytest.approx(KEEP, abs=0.01)
    # one scale for the whole dataset: a row of only low values keeps nothing (min-max would keep some)
    low = np.full((1, 5), values.min())
    low[0, 0] += 1e-3
    assert weigh(low, np.array([0]), cfg).max() == 0.0
    with pytest.raises(ValueError, match="keep"):
        WeighConfig(method="topk", quantiles=(0.0, 1.0))
    with pytest.raises(ValueError, match="invert does not apply"):
        WeighConfig(method="topk", keep=KEEP, quantiles=(0.0, 1.0), invert=True)


def test_topk_reweighs_stored_values_without_scoring_again(scored, tmp_path):
    """The weigh stage (a workflow's `values_from`, `entroweight weigh`) applies Rho-1's top-k to the
    values a score step stored: the same values row by row, 60 % of tokens kept, no model loaded."""
    cfg = WeighConfig(method="topk", keep=KEEP, quantiles=entropy_quantiles(scored))
    out = tmp_path / "rho1"
    run_stage(WeighStage(scored, cfg), out, progress=False)
    values, weights = _real_values(out)
    np.testing.assert_array_equal(values, _real_values(scored)[0])
    assert weights.mean() == pytest.approx(KEEP, abs=0.01)
    np.testing.assert_array_equal(weights == 1.0, values >= np.quantile(values, 1 - KEEP) - 1e-6)
    meta = read_file_metadata(next(out.glob("part-*.parquet")))
    assert meta["unit"] == "nats" and meta["scorer"] == "causal_loss" and meta["stage"] == "weigh"


def test_selective_loss_is_the_mean_ce_of_the_kept_tokens():
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 6, 11), torch.randint(0, 11, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    keep = (torch.rand(2, 6) < KEEP).float()
    got = compute_loss("weighted_ce", logits, targets, mask, weight=keep, normalize="weight")
    sel = (keep > 0) & mask
    assert got.item() == pytest.approx(per_token_ce(logits, targets)[sel].mean().item(), rel=1e-6)


def test_cli_topk(scored, small_data, tiny_ckpt, tmp_path):  # noqa: F811
    out = tmp_path / "cli"
    args = ["score", str(small_data), "--scorer", "causal_loss", "--checkpoint", str(tiny_ckpt)]
    args += ["--dtype", "fp32", "--weighting", "topk", "--keep", str(KEEP), "--quantiles-from", str(scored)]
    r = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert r.exit_code == 0, r.output
    _, weights = _real_values(out)
    assert weights.mean() == pytest.approx(KEEP, abs=0.01)
    assert read_file_metadata(next(out.glob("part-*.parquet")))["weighting"]["keep"] == KEEP
    bad = CliRunner().invoke(
        main, [*args[:-4], "--weighting", "topk", "--keep", "0.6", "--out", str(tmp_path / "x")]
    )
    assert bad.exit_code == 2 and "--quantiles-from" in bad.output
    shutil.rmtree(tmp_path / "x", ignore_errors=True)
