# ruff: noqa: F811 - pytest fixtures imported from other test modules
"""Every command that reads one of our checkpoints refuses a directory that is not one (an HF model
directory, which also holds a config.json; a config.json that is not JSON, or not an object naming a
model kind and its config; a kind this version does not know): exit 2, one line naming the file and
what to do, no traceback, nothing written. The commands and the scorers' checkpoint options are
enumerated from the CLI and the scorer registry, so a new one is covered or this test fails."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_bad_input_score import data, model, refused  # noqa: F401
from test_trainer_fixtures import tiny_ckpt, weighted_dir  # noqa: F401

from entroweight.scorers.registry import BUILTIN
from entroweight.workflows.cli.main import main

NOT_OURS = {
    "an HF model directory": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "Hugging Face"),
    "invalid JSON": ("{bad", "not valid JSON"),
    "a JSON list": ([1, 2], "not an entroweight checkpoint"),
    "an unknown kind": ({"kind": "gpt9", "model": {}}, "'gpt9'"),
}

# every command with a CKPT_DIR argument, with the other arguments it needs to get that far
COMMANDS = {
    "eval-bpb": lambda data, out, docs: [],
    "eval-quant": lambda data, out, docs: ["--data", data],
    "evaluate": lambda data, out, docs: ["--out", out, "--documents", docs],
    "export-hf": lambda data, out, docs: ["--out", out],
}


def _checkpoint_options(name: str) -> list[str]:
    module, cls = BUILTIN[name].split(":")
    return [
        k for k in getattr(importlib.import_module(module), cls).Options.model_fields if "checkpoint" in k
    ]


SCORERS = [name for name in BUILTIN if _checkpoint_options(name)]


def _bad(tmp_path, content) -> str:
    bad = tmp_path / "not-ours"
    bad.mkdir()
    (bad / "config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    (bad / "model.safetensors").write_bytes(b"")  # present, so the config alone decides
    return str(bad)


def test_the_lists_cover_every_command_and_scorer_that_reads_a_checkpoint():
    takes = {n for n, c in main.commands.items() if any(p.name == "ckpt_dir" for p in c.params)}
    assert takes == set(COMMANDS)
    assert {"causal_loss", "occlusion", "decomposition", "two_model", "grad_input", "excess_loss"} <= set(
        SCORERS
    )


@pytest.mark.parametrize("kind", NOT_OURS)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_refuses_a_directory_that_is_not_our_checkpoint(tmp_path, data, command, kind):
    content, needle = NOT_OURS[kind]
    out, docs = tmp_path / "out", tmp_path / "docs.txt"
    docs.write_text("held-out text\n")
    args = [command, _bad(tmp_path, content), *map(str, COMMANDS[command](data, out, docs))]
    refused(CliRunner().invoke(main, args), out, needle)


@pytest.mark.parametrize("kind", NOT_OURS)
@pytest.mark.parametrize("scorer", SCORERS)
def test_score_refuses_a_checkpoint_option_that_is_not_our_checkpoint(tmp_path, data, model, scorer, kind):
    content, needle = NOT_OURS[kind]
    bad, out = _bad(tmp_path, content), tmp_path / "out"
    options = [a for k in _checkpoint_options(scorer) for a in ("--option", f"{k}={bad}")]
    if scorer == "excess_loss":
        options += ["--option", f"reference={model}"]
    res = CliRunner().invoke(main, ["score", str(data), "--scorer", scorer, "--out", str(out), *options])
    refused(res, out, needle)


def test_a_refusal_names_every_model_kind_with_its_article():
    """'an estimator model', 'a llama model': the one wording every refusal of a checkpoint's kind uses
    (a new kind fails here until its wording is checked)."""
    from entroweight.models import REGISTRY
    from entroweight.models.checkpoint import a_model_of

    want = {"llama": "a", "mixer": "a", "estimator": "an", "autoencoder": "an", "tfree": "a"}
    assert set(want) == set(REGISTRY)
    for kind, article in want.items():
        assert a_model_of(kind) == f"{article} {kind} model"


# ---------------------------------------------------------------- one of ours, edited or cut short
# Every reader of our weights goes through one function (models.checkpoint.load_checkpoint, and its
# load_weights, which the trainer's resume calls too): a config.json edited by hand or weights cut
# short are a CheckpointError naming the file (exit 2), where they were a state dict's "size
# mismatch", a SafetensorError or a TypeError from a model's Config, as tracebacks.


def _edit_config(ckpt: Path, **changes) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    for key, value in changes.items():
        if key == "drop":
            config.pop(value)
        elif key == "model":
            config["model"].update(value)
        else:
            config[key] = value
    (ckpt / "config.json").write_text(json.dumps(config))


def _weights(ckpt: Path, data: bytes | None = None, keep: float | None = None) -> None:
    """Replace model.safetensors by `data`, or cut it to `keep` of its size; the sha256 that would
    catch it is dropped from config.json (an older checkpoint, or one edited by hand, has none)."""
    f = ckpt / "model.safetensors"
    f.write_bytes(data if data is not None else f.read_bytes()[: int(f.stat().st_size * keep)])
    _edit_config(ckpt, drop="weights_sha256")


# case -> (the edit, what the refusal says and which file it names)
EDITS = {
    "d_model edited": (lambda c: _edit_config(c, model={"d_model": 32}), "model.safetensors does not fit"),
    "a layer added": (lambda c: _edit_config(c, model={"n_layers": 2}), "model.safetensors does not fit"),
    "d_model a string": (lambda c: _edit_config(c, model={"d_model": "16"}), "config.json does not describe"),
    # settings the weights' shapes do not show: the safetensors header records what they were saved as
    "mask_pads edited": (
        lambda c: _edit_config(c, model={"mask_pads": True}),
        "config.json does not describe the model its weights were saved as (mask_pads true where the weights were saved as false",
    ),
    "rope_theta edited": (
        lambda c: _edit_config(c, model={"rope_theta": 500000.0}),
        "config.json does not describe the model its weights were saved as (rope_theta 500000.0 where the weights were saved as 10000.0",
    ),
    **{
        f"kind edited to {kind}": (lambda c, k=kind: _edit_config(c, kind=k), "config.json does not describe")
        for kind in ("mixer", "estimator", "autoencoder")
    },
    # a llama's files are a T-FREE model's too where n_hash is the vocabulary size (its default): the
    # same keys and shapes; the header says what they were saved as (eval-bpb read it as a tfree)
    "kind edited to tfree": (
        lambda c: _edit_config(c, kind="tfree"),
        'config.json does not describe the model its weights were saved as (kind "tfree" where the weights '
        'were saved as "llama")',
    ),
    "weights cut short": (lambda c: _weights(c, keep=0.5), "model.safetensors is not a readable safetensors"),
    "weights empty": (lambda c: _weights(c, data=b""), "model.safetensors is not a readable safetensors"),
    "weights not safetensors": (
        lambda c: _weights(c, data=b"\x08\x00\x00\x00\x00\x00\x00\x00not json" * 10),
        "model.safetensors is not a readable safetensors",
    ),
}


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    """A tiny llama checkpoint of ours, as `train` saves it (untrained: only its files matter), of the
    vocabulary of `data` (score reads that first)."""
    import torch

    from entroweight.models import build_model
    from entroweight.models.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = build_model(
        "llama", {"vocab_size": 1024, "n_ctx": 16, "d_model": 16, "n_layers": 1, "n_heads": 2}
    )
    return save_checkpoint(model, "llama", tmp_path_factory.mktemp("ours") / "ckpt", n_ctx=16, pad_id=0)


def _edited(ours: Path, tmp_path: Path, edit) -> Path:
    ckpt = tmp_path / "edited"
    shutil.copytree(ours, ckpt)
    edit(ckpt)
    return ckpt


def test_the_kind_edits_cover_every_other_kind():
    from entroweight.models import REGISTRY

    edited = {k.removeprefix("kind edited to ") for k in EDITS if k.startswith("kind")}
    assert edited == set(REGISTRY) - {"llama"}


def test_an_intact_checkpoint_loads(ours):
    from entroweight.models.checkpoint import load_checkpoint

    model, config = load_checkpoint(ours)
    assert config["kind"] == "llama" and not model.training


@pytest.mark.parametrize("case", EDITS)
def test_load_checkpoint_refuses_an_edited_or_cut_checkpoint_naming_the_file(ours, tmp_path, case):
    from entroweight.models.checkpoint import CheckpointError, load_checkpoint

    edit, said = EDITS[case]
    ckpt = _edited(ours, tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt)
    message = str(e.value)
    assert said in message and str(ckpt) in message and "\n" not in message, message


@pytest.mark.parametrize("case", EDITS)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_refuses_an_edited_or_cut_checkpoint(tmp_path, data, ours, command, case):
    """Every command with a CKPT_DIR: exit 2, one line naming the checkpoint, nothing written
    (`evaluate` reads the weights before --out is made, where it wrote its items first)."""
    edit, _ = EDITS[case]
    ckpt = _edited(ours, tmp_path, edit)
    out, docs = tmp_path / "out", tmp_path / "docs.txt"
    docs.write_text("held-out text\n")
    res = CliRunner().invoke(main, [command, str(ckpt), *map(str, COMMANDS[command](data, out, docs))])
    # evaluate reads llama checkpoints only, and says so of another kind before it reads the weights
    said = (
        EDITS[case][1] if not (command == "evaluate" and case.startswith("kind")) else "lm-eval reads llama"
    )
    refused(res, out, str(ckpt), said)
    assert len([ln for ln in res.output.splitlines() if ln.strip()]) == 1, res.output


@pytest.mark.parametrize("case", ["d_model edited", "weights cut short"])
def test_score_refuses_an_edited_or_cut_checkpoint(tmp_path, data, ours, case):
    ckpt = _edited(ours, tmp_path, EDITS[case][0])
    out = tmp_path / "out"
    res = CliRunner().invoke(
        main,
        ["score", str(data), "--scorer", "causal_loss", "--option", f"checkpoint={ckpt}", "--out", str(out)],
    )
    refused(res, out, str(ckpt), EDITS[case][1])


def test_a_resume_refuses_a_checkpoint_whose_config_was_edited(
    tmp_path, tiny_ckpt, weighted_dir, tokenizer_dir
):
    """The trainer's resume reads the weights through the same check (it loaded them with
    strict=False: a "size mismatch" traceback, and a missing key passed silently)."""
    from entroweight.models.checkpoint import CheckpointError
    from entroweight.trainers import TrainConfig, train

    run = tmp_path / "run"
    shutil.copytree(tiny_ckpt, run)
    _edit_config(run, model={"d_model": 32})
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    config = TrainConfig(
        data=str(weighted_dir),
        out=str(run),
        loss="weighted_ce",
        tokenizer=str(tokenizer_dir),
        steps=31,
        batch_size=8,
        lr=3e-3,
        resume=True,
        quiet=True,
    )
    with pytest.raises(CheckpointError, match="model.safetensors does not fit the llama model"):
        train(config, allow_config_change=True)
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before
