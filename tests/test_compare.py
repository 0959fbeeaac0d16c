"""`entroweight compare` / transforms.agreement.compare_dirs on real scored shards (occlusion l1 vs cosine)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from model_free import IdMod
from scipy import stats

from entroweight.models.checkpoint import save_checkpoint
from entroweight.models.estimator import EntropyEstimator
from entroweight.pipelines import run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.schemas import METADATA_KEY, read_file_metadata
from entroweight.schemas.datadir import DataDir
from entroweight.scorers import register
from entroweight.transforms.agreement import AgreementError, compare_dirs, rankdata
from entroweight.workflows.cli.main import main


def _tokenize(tmp, c4_path, tokenizer_dir, skip):
    tmp.mkdir(parents=True, exist_ok=True)
    src = tmp / "c4.jsonl.gz"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [line for i, line in zip(range(skip + 16), f, strict=False) if i >= skip]
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.writelines(lines)
    out = tmp / "tokens"
    run_stage(
        TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=32, shard_docs=8, overflow="truncate"),
        out,
        progress=False,
    )
    return out


@pytest.fixture(scope="module")
def scored(tmp_path_factory, c4_path, tokenizer_dir):
    """The same 16 documents scored by occlusion l1 and cosine; 16 other documents scored by l1."""
    tmp = tmp_path_factory.mktemp("compare")
    data = _tokenize(tmp / "a", c4_path, tokenizer_dir, 0)
    other = _tokenize(tmp / "b", c4_path, tokenizer_dir, 100)
    sha = read_file_metadata(next(data.glob("part-*.parquet")))["tokenizer_sha256"]
    torch.manual_seed(0)
    cfg = EntropyEstimator.Config(
        vocab_size=1024,
        n_ctx=32,
        encoder="mixer",
        encoder_config={"d_model": 32, "n_layers": 1},
        decoder_config={"d_model": 32, "n_layers": 1, "n_heads": 2},
        embed_dim=8,
        noise="none",
        init_std=0.2,
    )
    ckpt = save_checkpoint(
        EntropyEstimator(cfg), "estimator", tmp / "est", tokenizer_sha256=sha, n_ctx=32, pad_id=0
    )
    out = {}
    for name, src, metric in (("l1", data, "l1"), ("cos", data, "cosine"), ("other", other, "l1")):
        opts = {"checkpoint": str(ckpt), "metric": metric, "dtype": "fp32"}
        run_stage(ScoreStage(src, "occlusion", opts), tmp / name, progress=False)
        out[name] = tmp / name
    return out


def _values(out, column):
    vals = []
    for p in sorted(out.glob("part-*.parquet")):
        t = pq.read_table(p)
        v = np.stack(t.column(column).to_numpy(zero_copy_only=False)).astype(np.float64)
        n_pad = t.column("n_pad").to_numpy()
        vals += [v[r, n_pad[r] :] for r in range(len(v))]
    return np.concatenate(vals)


def test_compare_matches_scipy(scored):
    res = compare_dirs(scored["l1"], scored["cos"])
    x, y = _values(scored["l1"], "entropy"), _values(scored["cos"], "entropy")
    assert res["n_tokens"] == x.size and res["n_sequences"] == 16 and res["only_a"] == res["only_b"] == 0
    assert res["pearson"] == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-9)
    assert res["r2"] == pytest.approx(stats.linregress(x, y).rvalue ** 2, abs=1e-9)
    assert res["spearman"] == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-9)
    assert res["scorer_a"] == res["scorer_b"] == "occlusion"
    same = compare_dirs(scored["l1"], scored["l1"], column="weight")
    assert same["r2"] == pytest.approx(1.0) and same["spearman"] == pytest.approx(1.0)


def test_rankdata_ties():
    x = np.array([3.0, 1.0, 3.0, 2.0, 3.0])
    np.testing.assert_array_equal(rankdata(x), stats.rankdata(x))


def test_compare_uses_sequences_in_both(tmp_path, scored):
    part = DataDir(scored["cos"]).files[0]  # one shard of a directory: its sequences only
    res = compare_dirs(scored["l1"], part)
    assert res["n_sequences"] == 8 and res["only_a"] == 8 and res["only_b"] == 0


def test_compare_refusals(tmp_path, scored):
    with pytest.raises(AgreementError, match="different tokens"):
        compare_dirs(scored["l1"], scored["other"])
    # another tokenizer: same rows, metadata says otherwise
    bad = tmp_path / "bad.parquet"
    p = DataDir(scored["cos"]).files[0]
    meta = {**read_file_metadata(p), "tokenizer_sha256": "f" * 64}
    pq.write_table(pq.read_table(p).replace_schema_metadata({METADATA_KEY: json.dumps(meta)}), bad)
    with pytest.raises(AgreementError, match=r"tokenizer \(sha256\) differs: .* has 'ffff"):
        compare_dirs(scored["l1"], bad)
    with pytest.raises(AgreementError, match="is not a stage's output"):
        compare_dirs(scored["l1"], tmp_path)


def test_cli_compare(tmp_path, scored):
    r = CliRunner().invoke(main, ["compare", str(scored["l1"]), str(scored["cos"]), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["r2"] == pytest.approx(compare_dirs(scored["l1"], scored["cos"])["r2"])
    r = CliRunner().invoke(main, ["compare", str(scored["l1"]), str(scored["cos"]), "--column", "weight"])
    assert r.exit_code == 0 and "Spearman" in r.output and "R²" in r.output
    # two runs of one scorer (L1 and cosine occlusion) told apart by their directories
    assert (
        r.output.splitlines()[0] == f"A {scored['l1']} (occlusion) vs B {scored['cos']} (occlusion), weight"
    )
    r = CliRunner().invoke(main, ["compare", str(scored["l1"]), str(scored["other"])])
    assert r.exit_code == 2 and "different tokens" in r.output


class Flat(IdMod):  # every value 0 (an excess_loss of a model against itself)
    name = "flat_for_compare"
    modulus = 1


register(Flat)


def test_a_side_of_one_value_leaves_the_statistics_undefined(scored):
    """Values that are all one value have no correlation: the statistics are null in JSON (strict
    JSON, where Python wrote NaN) and the text says why, where it printed `nan` for each; the line
    of B on A stays defined while A varies."""
    flat = scored["l1"].parent / "flat"
    run_stage(ScoreStage(scored["l1"].parent / "a" / "tokens", "flat_for_compare", {}), flat, progress=False)
    res = compare_dirs(scored["l1"], flat)
    assert res["constant"] == ["B"] and res["r2"] is res["pearson"] is res["spearman"] is None
    assert res["slope"] == 0 and res["intercept"] == 0  # B on A: flat, defined
    assert compare_dirs(scored["l1"], scored["cos"])["constant"] == []

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))

    r = CliRunner().invoke(main, ["compare", str(scored["l1"]), str(flat), "--json"])
    assert r.exit_code == 0 and strict(r.output)["r2"] is None, r.output
    r = CliRunner().invoke(main, ["compare", str(scored["l1"]), str(flat)])
    assert r.exit_code == 0 and "undefined: B holds one value for every token" in r.output, r.output
    assert "nan" not in r.output
