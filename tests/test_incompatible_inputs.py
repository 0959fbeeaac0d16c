"""Inputs that cannot go together, crossed over every command that takes several (issue 26, property
2): exit 2 before any output exists, one line naming the field and both values (schemas/compat.py,
`check_compatible`, the one check every such command calls).

The commands come from the click group: every command with two or more data inputs (`Location`
parameters, or a data argument that takes many) has a row in ROWS, or a reason in EXEMPT; a new one
fails `test_every_command_with_several_inputs_has_a_row`. The pairs are real data made apart where
that is cheap (n_ctx: tokenized twice; weight dtype: score's float16 vs weigh's uint8) and otherwise
the same committed shards with one metadata fact changed (tokenizer, vocabulary, layout, unit),
through tests/stagecopy.py so that each stays a committed stage output.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil

import click
import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner
from stagecopy import stage_subset
from test_weighted_inputs import model, scored, tokens, weighed  # noqa: F401 - fixtures

from entroweight.pipelines import run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.schemas.arrow import METADATA_KEY
from entroweight.schemas.datadir import DataDir
from entroweight.schemas.manifest import manifest_name
from entroweight.transforms.writer import sha256_file
from entroweight.workflows.cli.main import main

# command -> argv builder for (input a, input b, out)
ROWS = {
    "train": lambda a, b, out, loss="weighted_ce": [
        "train",
        a,
        b,
        "--steps",
        "1",
        "--loss",
        loss,
        "--out",
        out,
    ],
    "compare": lambda a, b, out: ["compare", a, b],  # writes nothing
    "score": lambda a, b, out, model_dir="": [
        "score",
        a,
        "--scorer",
        "causal_loss",
        "--model",
        model,
        "--dtype",
        "fp32",
        "--weighting",
        "quantile",
        "--quantiles-from",
        b,
        "--out",
        out,
    ],  # fmt: skip
    "weigh": lambda a, b, out: ["weigh", a, "--weighting", "quantile", "--quantiles-from", b, "--out", out],
}
EXEMPT = {
    "eval-bpb": "one data input (--unigram) beside a checkpoint and a text: its tokenizer is checked "
    "against the checkpoint's (tests/test_export.py, test_the_unigram_baseline_refuses_data_of_another_tokenizer)",
    "tokenize": "its inputs are raw documents: any two sources tokenize together",
    "train-tokenizer": "its inputs are raw documents",
    "synthesize": "one teacher (--checkpoint or --model) and at most one data input (--prefix-from), whose "
    "tokenizer is checked against the teacher's (tests/test_synthesize.py, "
    "test_bad_teachers_are_refused_in_one_line: a prefix in another tokenizer)",
}


def several_input_commands() -> list[str]:
    def inputs(c):
        n = 0
        for p in c.params:
            if type(p.type).__name__ == "Location" and p.name != "out":
                n += 1
            elif isinstance(p, click.Argument) and p.nargs == -1:
                n += 2
        return n

    return sorted(n for n, c in main.commands.items() if inputs(c) >= 2)


def test_every_command_with_several_inputs_has_a_row():
    assert several_input_commands() == sorted([*ROWS, *EXEMPT])


def relabel(src, dst, **changes):
    def edit(t):
        meta = json.loads(t.schema.metadata[METADATA_KEY])
        return t.replace_schema_metadata({METADATA_KEY: json.dumps({**meta, **changes})})

    return stage_subset(src, dst, edit=edit)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tokens, scored, weighed, model, c4_path, tokenizer_dir):  # noqa: F811
    """field -> (kind of data, a, b, the value a shows, the value b shows)."""
    root = tmp_path_factory.mktemp("pairs")
    src = root / "c4.jsonl.gz"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f, gzip.open(src, "wt", encoding="utf-8") as out:
        out.writelines(next(f) for _ in range(20))
    short = root / "tokens32"
    run_stage(
        TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=32, overflow="truncate"), short, progress=False
    )
    short_scored = root / "scored32"
    opts = {"model": str(model), "dtype": "fp32", "batch_size": 8}
    run_stage(ScoreStage(str(short), "causal_loss", opts), short_scored, progress=False)
    sha = DataDir(scored).record.config["input_tokenizer_sha256"]
    return {
        "n_ctx": ("weighted", scored, short_scored, "64", "32"),
        "tokenizer": (
            "weighted",
            scored,
            relabel(scored, root / "tok", tokenizer_sha256="f" * 64),
            sha[:8],
            "ffff",
        ),
        "vocabulary": ("weighted", scored, relabel(scored, root / "voc", vocab_size=2048), "1024", "2048"),
        "layout": ("weighted", scored, relabel(scored, root / "packed", packed=True), "False", "True"),
        "weight dtype": ("weighted", scored, weighed, "float16", "uint8"),
        "unit": ("weighted", scored, relabel(scored, root / "unit", unit="l1_minmax"), "nats", "l1_minmax"),
    }


# which fields each command compares (compare: values of two scorers may differ in unit and dtype;
# --quantiles-from: the unit of the values, the other facts do not change a quantile)
APPLIES = {
    "train": ("n_ctx", "tokenizer", "vocabulary", "layout", "weight dtype", "unit"),
    "compare": ("n_ctx", "tokenizer", "vocabulary", "layout"),
    "score": ("unit",),
    "weigh": ("unit",),
}
CASES = [(c, f) for c in ROWS for f in APPLIES[c]]


def refused(argv, out):
    r = CliRunner().invoke(main, [str(a) for a in argv])
    assert r.exit_code == 2, (argv, r.output, r.exception)
    line = r.output.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert not os.path.exists(out) or not any(os.scandir(out)), "output written before the refusal"
    return line


@pytest.mark.parametrize(("command", "field"), CASES, ids=[f"{c}-{f}" for c, f in CASES])
def test_incompatible_pair_is_refused_naming_the_field_and_both_values(
    command,
    field,
    pairs,
    tokens,  # noqa: F811
    model,  # noqa: F811
    tmp_path,
):  # noqa: F811
    _, a, b, va, vb = pairs[field]
    out = tmp_path / "out"
    if command == "score":  # the tokens `a` was scored from, the quantiles of `b`
        argv = ROWS["score"](tokens, b, out, str(model))
    else:
        argv = ROWS[command](a, b, out)
    line = refused(argv, out)
    name = {"vocabulary": "vocabulary", "layout": "packed", "weight dtype": "dtype"}
    assert name.get(field, field) in line, line
    assert va in line and vb in line, line


# -- one directory holding shards of two configurations


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, scored, weighed):  # noqa: F811
    """`scored` with its part-00001 replaced by weigh's (another configuration), the manifest edited
    to the new bytes: listed as committed, its own metadata says otherwise."""
    out = stage_subset(scored, tmp_path_factory.mktemp("mixed"))
    part = DataDir(out).parts[1]
    f = out / part.name
    shutil.copy(DataDir(weighed).parts[1].location, f)
    m = out / manifest_name(part.manifest.shard)
    record = json.loads(m.read_text())
    record |= {"output_sha256": sha256_file(f), "output_bytes": f.stat().st_size, "output_row_groups": None}
    m.write_text(json.dumps(record))
    return out


MIXED = {
    "train": lambda d, out: ["train", d, "--steps", "1", "--loss", "weighted_ce", "--out", out],
    "export-data": lambda d, out: ["export-data", d, "--format", "hf", "--out", out],
    "weigh": lambda d, out: ["weigh", d, "--out", out],
    "score": lambda d, out: ["score", d, "--scorer", "causal_loss", "--out", out],
}


@pytest.mark.parametrize("command", sorted(MIXED))
def test_a_directory_of_two_configurations_is_refused(command, mixed, model, tmp_path):  # noqa: F811
    argv = MIXED[command](mixed, tmp_path / "out")
    if command == "score":
        argv += ["--model", str(model)]
    line = refused(argv, tmp_path / "out")
    assert "configuration" in line and DataDir(mixed).parts[1].name in line, line


# -- a model's context and weights that sum to zero (train)


def test_data_longer_than_the_models_context_is_refused(scored, tmp_path):  # noqa: F811
    cfg = tmp_path / "model.yaml"
    cfg.write_text("n_ctx: 32\nd_model: 16\nn_layers: 1\nn_heads: 2\nd_ff: 32\n")
    line = refused(
        ["train", scored, "--steps", "1", "--model-config", cfg, "--out", tmp_path / "out"], tmp_path / "out"
    )
    assert "64" in line and "32" in line and "n_ctx" in line, line


def test_weights_that_sum_to_zero_are_refused(scored, tmp_path):  # noqa: F811
    def zero(t):
        w = t.column("weight")
        zeros = pa.ListArray.from_arrays(
            w.combine_chunks().offsets, pa.array(np.zeros(len(w.combine_chunks().values), np.float16))
        )
        return t.set_column(t.schema.get_field_index("weight"), "weight", zeros)

    d = stage_subset(scored, tmp_path / "zero", edit=zero)
    line = refused(
        ["train", d, "--steps", "1", "--loss", "weighted_ce", "--out", tmp_path / "out"], tmp_path / "out"
    )
    assert "every weight" in line and "is 0" in line, line


# -- data wider than a scorer's model reads (score)


@pytest.fixture(scope="module")
def short_checkpoints(tmp_path_factory, tokens):  # noqa: F811
    """Our checkpoints of the data's tokenizer, reading 32 tokens: a llama, and an estimator."""
    import torch
    from test_scorers_estimator import save, tiny_estimator

    from entroweight.models.checkpoint import save_checkpoint
    from entroweight.models.llama import Llama

    sha = DataDir(tokens).metadata["tokenizer_sha256"]
    torch.manual_seed(0)
    llama = Llama(Llama.Config(vocab_size=1024, d_model=16, n_layers=1, n_heads=2, d_ff=32, n_ctx=32))
    root = tmp_path_factory.mktemp("short_ckpts")
    return {
        "llama": save_checkpoint(llama, "llama", root / "llama", n_ctx=32, tokenizer_sha256=sha, pad_id=0),
        "estimator": save(tiny_estimator(n_ctx=32), root / "estimator", sha),
    }


# scorer -> its flags, given our checkpoints ({kind: dir}): each reads rows of at most the model's n_ctx
NARROW = {
    "causal_loss": lambda c: ["--checkpoint", c["llama"]],
    "excess_loss": lambda c: ["--checkpoint", c["llama"], "--reference", c["llama"]],
    "occlusion": lambda c: ["--checkpoint", c["estimator"]],
    "grad_input": lambda c: ["--checkpoint", c["estimator"]],
}
SLIDING = {  # read rows of any width, their windows sliding: options given our checkpoints and an HF model
    "decomposition": lambda c, hf: {"checkpoint": c["llama"]},
    "two_model": lambda c, hf: {"checkpoint": c["llama"], "checkpoint_short": c["llama"]},
    "cross_tokenizer": lambda c, hf: {"model": hf},
}


def test_every_builtin_scorer_says_how_wide_a_row_it_reads():
    from entroweight.scorers.registry import BUILTIN

    assert set(NARROW) | set(SLIDING) == set(BUILTIN)


@pytest.mark.parametrize("scorer", sorted(NARROW))
def test_data_wider_than_the_scorers_model_is_refused_up_front(
    scorer,
    tokens,  # noqa: F811
    short_checkpoints,
    tmp_path,
):
    """Before: `score` loaded the model and failed every shard ("sequence of 64 tokens is longer than
    the model's n_ctx 32", exit 1). Now refused before anything is written (Scorer.max_row_tokens,
    checked by the score stage's driver)."""
    out = tmp_path / "out"
    argv = ["score", tokens, "--scorer", scorer, *NARROW[scorer](short_checkpoints), "--out", out]
    line = refused(argv, out)
    assert "64 tokens" in line and "(32, its n_ctx)" in line and "--n-ctx 32" in line, line


@pytest.mark.parametrize("scorer", sorted(SLIDING))
def test_a_scorer_whose_windows_slide_takes_rows_of_any_width(scorer, short_checkpoints, model):  # noqa: F811
    from entroweight.scorers import make_scorer

    options = {k: str(v) for k, v in SLIDING[scorer](short_checkpoints, model).items()}
    assert make_scorer(scorer, **options).max_row_tokens() is None
