# ruff: noqa: F811 - pytest fixtures imported from other test modules
"""Every command that reads one of our checkpoints refuses a directory that is not one (an HF model
directory, which also holds a config.json; a config.json that is not JSON, or not an object naming a
model kind and its config; a kind this version does not know): exit 2, one line naming the file and
what to do, no traceback, nothing written. The commands and the scorers' checkpoint options are
enumerated from the CLI and the scorer registry, so a new one is covered or this test fails."""

from __future__ import annotations

import importlib
import json

import pytest
from click.testing import CliRunner
from test_bad_input_score import data, model, refused  # noqa: F401

from entroweight.scorers.registry import BUILTIN
from entroweight.workflows.cli import main

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
