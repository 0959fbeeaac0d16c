# ruff: noqa: F811 - pytest fixtures imported from the modules that define them
"""The rerun rule over the whole CLI: a command that writes, given the same arguments again after it
finished, has nothing to do and says so, exit 0, no file under its output touched (a scheduler's
retry; a stage's rerun always did this). The commands come from the click group (those with an `out`
parameter): each has a row in ROWS or a reason in EXEMPT, so a new writing command fails
`test_every_writing_command_has_a_row`. Before, `train` refused its own rerun ("already holds a
checkpoint; pass --resume") and `export-hf` and `evaluate` made their output again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_trainer_fixtures import TINY, tiny_ckpt, weighted_dir  # noqa: F401 - fixtures
from test_weighted_inputs import model, scored, tokens  # noqa: F401 - fixtures

from entroweight import output
from entroweight.workflows.cli.main import main

# command -> (its arguments but --out, from the fixtures below; what its rerun says)
ROWS = {
    "tokenize": (lambda f: [f["c4_60"], "--tokenizer", f["tokenizer_dir"], "--n-ctx", 64], "nothing to do"),
    "train-tokenizer": (lambda f: [f["c4_60"], "--vocab-size", 300], "nothing to do"),
    "score": (
        lambda f: [f["tokens"], "--scorer", "causal_loss", "--dtype", "fp32", "--model", f["model"]],
        "nothing to do",
    ),
    "weigh": (lambda f: [f["scored"], "--weight-dtype", "uint8"], "nothing to do"),
    "synthesize": (lambda f: ["--model", f["model"], "--sequences", 4, "--n-ctx", 12], "nothing to do"),
    "export-data": (lambda f: [f["scored"], "--format", "hf"], "nothing to do"),
    "export-hf": (lambda f: [f["tiny_ckpt"]], "nothing to do"),
    "evaluate": (
        lambda f: [f["tiny_ckpt"], "--documents", f["c4_60"], "--items", 4, "--device", "cpu"],
        "nothing to do",
    ),
    "train": (
        lambda f: [f["tokenized_dir"], "--model-config", f["tiny.yaml"], "--steps", 2, "--batch-size", 4],
        "nothing to train",
    ),
}
EXEMPT = {
    "report": "a view of a run, remade in seconds from what the run holds now; it writes over its own "
    "earlier reports only (tests/test_report.py)",
}


def writing_commands() -> list[str]:
    return sorted(n for n, c in main.commands.items() if any(p.name == "out" for p in c.params))


def test_every_writing_command_has_a_row():
    assert writing_commands() == sorted([*ROWS, *EXEMPT]), "give a new writing command a row in ROWS"


def snapshot(root: Path) -> dict[str, tuple]:
    seen = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            st = (Path(dirpath) / n).lstat()
            seen[str((Path(dirpath) / n).relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return seen


@pytest.mark.parametrize("command", sorted(ROWS))
def test_the_same_command_again_has_nothing_to_do(
    command, c4_60, tokenizer_dir, tokenized_dir, tokens, scored, model, tiny_ckpt, tmp_path, monkeypatch
):
    """...and each run asks the path rule once (`output.check_output`): a stage's by the planner's
    `judge_out`, train's by the trainer, the others' by `output.writing`, never the CLI and again
    the library it calls."""
    asked = []
    rule = output.check_output
    monkeypatch.setattr(output, "check_output", lambda *a, **k: asked.append(a[0]) or rule(*a, **k))
    config = tmp_path / "tiny.yaml"
    config.write_text("".join(f"{k}: {v}\n" for k, v in TINY.items()))
    found = {
        "c4_60": c4_60,
        "tokenizer_dir": tokenizer_dir,
        "tokens": tokens,
        "scored": scored,
        "model": model,
        "tiny_ckpt": tiny_ckpt,
        "tokenized_dir": tokenized_dir,
        "tiny.yaml": config,
    }
    args, says = ROWS[command]
    out = tmp_path / "out"
    argv = [command, *map(str, args(found)), "--out", str(out)]
    first = CliRunner().invoke(main, argv)
    assert first.exit_code == 0, first.output
    assert asked == [str(out)], asked
    before = snapshot(out)
    again = CliRunner().invoke(main, argv)
    assert again.exit_code == 0 and says in again.output, again.output
    assert snapshot(out) == before, "the rerun touched its output"
