"""`entroweight score` on bad input (issue 15): every refusal exits 2 before any output exists, with
a one-line message and no traceback; options that do not apply are refused, not ignored; a shard
reports rows as it goes. Real C4 text, a real tokenizer, a real (tiny) HF Llama.
"""

from __future__ import annotations

import gzip

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from test_score_stage import tiny_llama_dir

from entroweight.pipelines import StageError, run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.stage import read_manifests
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.schemas import read_file_metadata
from entroweight.workflows.cli.main import main

N_DOCS = 600  # > READ_ROWS (256): a shard is read, scored and written in three batches


@pytest.fixture(scope="module")
def data(tmp_path_factory, c4_path, tokenizer_dir):
    """600 C4 documents, n_ctx 16, one shard."""
    src = tmp_path_factory.mktemp("src") / "c4.jsonl.gz"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(N_DOCS)]
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.writelines(lines)
    out = tmp_path_factory.mktemp("tokens")
    run_stage(TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=16, shard_docs=N_DOCS), out, progress=False)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir):
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny"), tokenizer_dir / "tokenizer.json")


def score(data, out, *args):
    res = CliRunner().invoke(main, ["score", str(data), "--out", str(out), *map(str, args)])
    return res


def refused(res, out, *needles):
    """Exit 2, one clean message naming the problem, no traceback, nothing written."""
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in res.output, (needle, res.output)
    assert not out.exists(), f"{out} was created by a refused run"


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--batch-size", 0], ["--batch-size: Input should be greater than or equal to 1"]),
        (["--batch-size", -4], ["--batch-size: Input should be greater than or equal to 1"]),
        (["--option", "batch_size=0"], ["--option batch_size: Input should be greater than or equal to 1"]),
        (["--device", "banana"], ["--device: 'banana' is not a torch device"]),
        (["--metric", "l1"], ["--metric: does not apply to the causal_loss scorer (its options: "]),
        (["--aggregate", "sum"], ["--aggregate: does not apply to the causal_loss scorer"]),
        (["--option", "dtyp=fp32"], ["--option dtyp: does not apply to the causal_loss scorer", "--dtype"]),
        (
            ["--option", "dtype=fp8"],
            ["--option dtype: unknown dtype 'fp8'; input should be 'bf16', 'fp16' or 'fp32'"],
        ),
        (["--dtype", "fp32", "--option", "dtype=bf16"], ["--option dtype: already given as --dtype"]),
        (["--option", "dtype"], ["--option takes KEY=VALUE"]),
        (
            ["--weighting", "minmax", "--quantiles-from", "{data}"],
            ["--quantiles-from applies to --weighting quantile"],
        ),
    ],
)
def test_refused_up_front(tmp_path, data, model, args, needles):
    """Before: batch size 0 / a bad device failed every shard (exit 1); --metric, --aggregate and
    --quantiles-from were dropped silently (exit 0); there was no --option."""
    out = tmp_path / "out"
    args = [str(data) if a == "{data}" else a for a in args]
    refused(score(data, out, "--scorer", "causal_loss", "--model", model, *args), out, *needles)


def test_unknown_scorer_names_the_available_ones(tmp_path, data):
    out = tmp_path / "out"
    refused(
        score(data, out, "--scorer", "causal_los"), out, "unknown scorer 'causal_los'; available: causal_loss"
    )


def test_options_of_another_scorer_are_refused(tmp_path, data, model):
    """--trust-remote-code means nothing to our checkpoints' scorers: said, not ignored."""
    out = tmp_path / "out"
    res = score(data, out, "--scorer", "occlusion", "--checkpoint", model, "--trust-remote-code")
    refused(res, out, "--trust-remote-code: does not apply to the occlusion scorer")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_reaches_the_workers_and_the_local_engine_refuses_it_here(tmp_path, data, model):
    """A cluster's driver may have no GPU: the stage is built with --device cuda (a remote worker checks);
    where the worker is this process (the local engine) it is refused up front."""
    stage = ScoreStage(data, "causal_loss", {"model": str(model), "device": "cuda"})
    assert stage.resources()["num_gpus"] == 1
    with pytest.raises(StageError, match="no CUDA device is visible here"):
        stage.setup()  # what a worker does first
    out = tmp_path / "out"
    res = score(data, out, "--scorer", "causal_loss", "--model", model, "--device", "cuda")
    refused(res, out, "--device cuda but no CUDA device is visible here")


def test_a_model_smaller_than_the_datas_ids_is_refused(tmp_path, data, model, tokenizer_dir):
    """An HF directory whose config has vocab_size 512 over data with ids up to ~1023 (the same
    tokenizer.json): before, every shard failed with an IndexError after --out was claimed."""
    small = tiny_llama_dir(tmp_path / "small", tokenizer_dir / "tokenizer.json", vocab_size=512)
    out = tmp_path / "out"
    res = score(data, out, "--scorer", "causal_loss", "--model", small)
    refused(res, out, "part-00000", "holds token id", "reads ids below 512 only")
    # smaller than the tokenizer but above every id the data holds: nothing to refuse
    ids = pq.read_table(next(data.glob("part-*.parquet")), columns=["input_ids"]).column("input_ids")
    top = max(max(row) for row in ids.to_pylist())
    enough = tiny_llama_dir(tmp_path / "enough", tokenizer_dir / "tokenizer.json", vocab_size=top + 1)
    assert ScoreStage(data, "causal_loss", {"model": str(enough)}).scorer.vocab_size() == top + 1


def test_generic_options_reach_the_scorer_and_a_shard_reports_rows_as_it_goes(tmp_path, data, model):
    """`--option dtype=fp32 --option batch_size=64` configure the scorer (recorded in the metadata); the
    local engine shows each shard's rows as they are scored (256 of 600, 512 of 600), not only at its end."""
    out = tmp_path / "out"
    res = score(
        data,
        out,
        "--scorer",
        "causal_loss",
        "--model",
        model,
        "--option",
        "dtype=fp32",
        "--option",
        "batch_size=64",
    )
    assert res.exit_code == 0, res.output
    (part,) = out.glob("part-*.parquet")
    assert read_file_metadata(part)["dtype"] == "fp32"
    rows = read_manifests(out)[0].rows_out
    assert rows == read_manifests(data)[0].rows_out >= N_DOCS
    for done in (256, 512):
        assert f"{done}/{rows}" in res.output, res.output
