"""Every stage output is a first-class input, on local disk and on a URL (issue 25 items 3 and 5).

What `weigh` writes is read exactly like what `score` writes: inspected, compared, verified, exported
(hf, megatron, litdata) and trained on; "is this weighted data" is `DataDir.kind`, from the stage
record. Then every command that reads a directory, on the loopback S3 server (tests/s3server.py):
one enumerated case per command (`URL_CASES`), so a new reading command is one more entry.

Real data: 60 C4 documents, tokenized (n_ctx 64, 3 shards), scored by a tiny HF Llama (causal_loss,
float16 weights), re-weighed by `weigh` (minmax, uint8 weights: the other encoding).
"""

from __future__ import annotations

import gzip
import importlib.util
import json

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_score_stage import tiny_llama_dir
from test_trainer import cfg

from entroweight.pipelines import run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.pipelines.verify import verify_dir
from entroweight.pipelines.weigh import WeighStage
from entroweight.schemas.datadir import DataDir
from entroweight.schemas.weighted import real_mask, weights_matrix
from entroweight.trainers import train
from entroweight.transforms.weigh import WeighConfig
from entroweight.workflows.cli.main import main
from entroweight.workflows.report.data import read_scores

N_CTX = 64
HAS = {m: importlib.util.find_spec(m) is not None for m in ("megatron", "litdata")}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory, c4_path, tokenizer_dir):
    src = tmp_path_factory.mktemp("src") / "c4.jsonl.gz"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(60)]
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.writelines(lines)
    out = tmp_path_factory.mktemp("tokens")
    stage = TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX, shard_docs=20, overflow="truncate")
    run_stage(stage, out, progress=False)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir):
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny"), tokenizer_dir / "tokenizer.json")


@pytest.fixture(scope="module")
def scored(tmp_path_factory, tokens, model):
    out = tmp_path_factory.mktemp("scored")
    opts = {"model": str(model), "dtype": "fp32", "batch_size": 8}
    run_stage(ScoreStage(str(tokens), "causal_loss", opts), out, progress=False)
    return out


@pytest.fixture(scope="module")
def weighed(tmp_path_factory, scored):
    out = tmp_path_factory.mktemp("weighed")
    run_stage(WeighStage(scored, WeighConfig(dtype="uint8")), out, progress=False)
    return out


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def rows_of(location) -> int:
    return sum(p.manifest.rows_out for p in DataDir(location).parts)


# -- score reads weighted data as the tokens it holds


def test_scoring_weighted_data_is_scoring_its_tokens(tokens, weighed, model, tmp_path):
    """`score W` (W the output of weigh, uint8 weights, the previous scorer's metadata) writes the same
    shard bytes as scoring the tokens W came from: its values, weights and metadata are left behind."""
    from entroweight.schemas import read_file_metadata

    args = ["--scorer", "causal_loss", "--model", model, "--dtype", "fp32", "--clip", "0.1", "0.9"]
    assert cli("score", tokens, *args, "--out", tmp_path / "a")[0] == 0
    code, output = cli("score", weighed, *args, "--out", tmp_path / "b")
    assert code == 0, output
    a, b = DataDir(tmp_path / "a").parts, DataDir(tmp_path / "b").parts
    assert [p.name for p in a] == [p.name for p in b] and len(a) == 3
    for pa_, pb in zip(a, b, strict=True):
        assert pa_.manifest.output_sha256 == pb.manifest.output_sha256  # the same bytes
    meta = read_file_metadata(b[0].location)
    assert "scored_config_hash" not in meta and meta["weighting"]["clip"] == [0.1, 0.9]
    assert meta["stage"] == "score" and meta == read_file_metadata(a[0].location)


# -- weigh output is weighted data, for every reader


def test_datadir_kind_is_read_from_the_stage_record(tokens, scored, weighed):
    assert [DataDir(d).kind for d in (tokens, scored, weighed)] == ["sequences", "weighted", "weighted"]
    assert (DataDir(scored).weight_dtype, DataDir(weighed).weight_dtype) == ("float16", "uint8")
    assert len(DataDir(weighed).parts) == 3 and not DataDir(weighed).missing


def test_weigh_output_inspects_compares_and_verifies(scored, weighed):
    code, output = cli("inspect", weighed, "--json")
    assert code == 0, output
    info = json.loads(output)
    assert info["kind"] == "weighted" and info["rows"] == rows_of(weighed) and info["files"] == 3
    assert 0.0 <= info["weight"]["min"] <= info["weight"]["max"] <= 1.0  # uint8 decoded by the codec
    # the same entropies in both: R² 1; the weights differ only by the encoding (float16 vs uint8)
    code, output = cli("compare", scored, weighed, "--json")
    assert code == 0, output
    assert json.loads(output)["r2"] == pytest.approx(1.0)
    code, output = cli("compare", scored, weighed, "--column", "weight", "--json")
    assert code == 0 and json.loads(output)["r2"] > 0.999, output
    assert verify_dir(weighed) == []
    code, output = cli("verify", weighed)
    assert code == 0, output


def test_verify_checks_the_excluded_column(tmp_path, weighed):
    """`excluded` positions lie in their row's real tokens and weigh 0 (a hand-edited shard is caught)."""
    import shutil

    import pyarrow as pa

    bad = tmp_path / "bad"
    shutil.copytree(weighed, bad)
    f = bad / DataDir(bad).parts[0].name
    pf = pq.ParquetFile(f)
    t = pf.read()
    n_pad = t.column("n_pad").to_numpy()
    r = 0
    w = weights_matrix(t.column("weight"))
    real = np.flatnonzero(real_mask(n_pad[r : r + 1], N_CTX)[0] & (w[r] > 0))
    excluded = [[] for _ in range(t.num_rows)]
    excluded[r] = [N_CTX + 3]  # beyond the row (a pad, before n_pad, would be outside too)
    t = t.set_column(
        t.schema.get_field_index("excluded"), "excluded", pa.array(excluded, t.schema.field("excluded").type)
    )
    pq.write_table(t, f, compression="zstd")
    problems = " ".join(verify_dir(bad))
    assert "1 excluded positions outside their row's real tokens" in problems
    excluded[r] = [int(real[0])]  # a real token that still has a weight
    t = t.set_column(
        t.schema.get_field_index("excluded"), "excluded", pa.array(excluded, t.schema.field("excluded").type)
    )
    pq.write_table(t, f, compression="zstd")
    assert "1 excluded positions with a weight other than 0" in " ".join(verify_dir(bad))


@pytest.mark.parametrize("fmt", ["hf", "megatron", "litdata"])
def test_weigh_output_exports(weighed, tmp_path, fmt):
    if fmt != "hf" and not HAS[fmt]:
        pytest.skip(f"{fmt} is not installed")
    code, output = cli("export-data", weighed, "--format", fmt, "--out", tmp_path / "x")
    assert code == 0, output
    record = json.loads((tmp_path / "x" / "export.json").read_text())
    assert record["weight_dtype"] == "uint8" and record["counts"]["rows"] == rows_of(weighed)
    if fmt == "hf":
        t = pq.read_table(tmp_path / "x" / "data")
        assert str(t.schema.field("weight").type) == "list<element: uint8>"  # kept as stored
        assert "w = value / 255" in (tmp_path / "x" / "README.md").read_text()


def test_weigh_output_trains(weighed, tmp_path):
    res = train(cfg(weighed, tmp_path / "run", steps=2, batch_size=4, loss="weighted_ce"))
    assert res.step == 2


def test_the_trainer_masks_by_n_pad(weighed):
    """The reader's mask is the codec's real-token mask (from n_pad), not `input_ids != pad_id`."""
    from entroweight.trainers.data import WeightedTokens

    ds = WeightedTokens(weighed, shuffle=False, columns=("weight",))
    t = pq.read_table(DataDir(weighed).files[0], columns=["n_pad", "weight"])
    n_pad = t.column("n_pad").to_numpy()
    items = [item for item, _ in zip(ds, range(len(n_pad)), strict=False)]
    for item, p, w in zip(items, n_pad, weights_matrix(t.column("weight")), strict=True):
        assert item["mask"].tolist() == [j >= p for j in range(N_CTX)]
        assert np.array_equal(item["weight"].numpy(), w)


# -- every command that reads a directory, on an object store


@pytest.fixture(scope="module")
def remote(s3_endpoint, scored, weighed):
    from s3server import new_bucket

    bucket = new_bucket()
    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
    for name, local in (("scored", scored), ("weighed", weighed)):
        fs.put(str(local), f"{bucket.removeprefix('s3://')}/{name}", recursive=True)
    return bucket


def _inspect(b, tmp_path, weighed, scored):
    code, output = cli("inspect", f"{b}/weighed", "--json")
    assert code == 0, output
    assert json.loads(output)["rows"] == rows_of(weighed)


def _compare(b, tmp_path, weighed, scored):
    code, output = cli("compare", f"{b}/scored", f"{b}/weighed", "--json")
    assert code == 0, output
    assert json.loads(output)["r2"] == pytest.approx(1.0)


def _weigh_quantiles_from(b, tmp_path, weighed, scored):
    out = tmp_path / "q"
    code, output = cli(
        "weigh", scored, "--out", out, "--weighting", "quantile", "--quantiles-from", f"{b}/scored"
    )
    assert code == 0, output
    # the weighted data of a URL is read (its uint8 encoding from the stored type), re-weighed as asked
    code, output = cli("weigh", f"{b}/weighed", "--out", tmp_path / "w", "--weight-dtype", "uint8")
    assert code == 0, output
    assert DataDir(tmp_path / "w").weight_dtype == "uint8"


def _weigh_quantiles_from_memory(b, tmp_path, weighed, scored):
    mem = fsspec.filesystem("memory")
    mem.put(str(scored), "/readers-test/scored", recursive=True)
    code, output = cli(
        "weigh",
        scored,
        "--out",
        tmp_path / "q",
        "--weighting",
        "quantile",
        "--quantiles-from",
        "memory://readers-test/scored",
    )
    assert code == 0, output


def _verify(b, tmp_path, weighed, scored):
    code, output = cli("verify", f"{b}/weighed")
    assert code == 0, output


def _report_data(b, tmp_path, weighed, scored):
    remote_scores = read_scores(f"{b}/scored", 1_000_000)
    local_scores = read_scores(scored, 1_000_000)
    assert remote_scores is not None and remote_scores["n_tokens"] == local_scores["n_tokens"] > 0
    assert np.array_equal(remote_scores["entropy"], local_scores["entropy"])


def _export_data(b, tmp_path, weighed, scored):
    code, output = cli("export-data", f"{b}/weighed", "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0, output
    assert json.loads((tmp_path / "hf" / "export.json").read_text())["counts"]["rows"] == rows_of(weighed)


def _train(b, tmp_path, weighed, scored):
    res = train(cfg(f"{b}/weighed", tmp_path / "run", steps=2, batch_size=4, loss="weighted_ce"))
    assert res.step == 2


# command -> what it does with a URL; a new command that reads a directory adds its case here
URL_CASES = {
    "inspect": _inspect,
    "compare": _compare,
    "weigh --quantiles-from s3://": _weigh_quantiles_from,
    "weigh --quantiles-from memory://": _weigh_quantiles_from_memory,
    "verify": _verify,
    "report data": _report_data,
    "export-data": _export_data,
    "train": _train,
}


@pytest.mark.parametrize("command", list(URL_CASES))
def test_every_reading_command_takes_a_url(command, remote, tmp_path, weighed, scored):
    URL_CASES[command](remote, tmp_path, weighed, scored)


def test_a_url_that_is_no_stage_output_is_refused_clearly(remote):
    code, output = cli("compare", f"{remote}/scored", f"{remote}/nothing-here")
    assert code == 2 and "Traceback" not in output
