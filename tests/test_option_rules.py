# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""The rules every option of every command follows (docs/reliability.md), each kept in one place
(entroweight/options.py; the command line's own flags through workflows/cli/common.py) and tested
here over every flag of the CLI and every field of every options model, enumerated, so a new one is
covered or fails here:

- a count is at least 1: an int flag where 0 means something is in ZERO_MEANS, with what it means;
- a seed is 0 <= seed < 2**63, what torch.manual_seed and numpy's generators both take;
- a float is finite (NaN passes every range check; `train --lr inf` trained to NaN at step 2);
- a device is one torch knows and entroweight runs on, and is on this machine (`--device cuda`
  on a CPU-only machine was a traceback from deep in torch, after `evaluate` wrote its items).

A refusal is exit 2, one line naming the flag, no traceback, nothing written.
"""

from __future__ import annotations

import math
import os
import typing
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner
from pydantic import ValidationError
from test_options import _options_models
from test_trainer_fixtures import tiny_ckpt, weighted_dir  # noqa: F401

from entroweight.options import SEED_LIMIT, device_here, device_name
from entroweight.scorers.registry import BUILTIN, get_scorer_class
from entroweight.workflows.cli.main import main

SEEDS = {"--seed", "--shuffle"}  # `--shuffle SEED`: the weighting's control, seeded
# int flags where 0 is a value that means something; the others refuse 0 as they refuse -1
ZERO_MEANS = {
    "--warmup-steps": "no warmup",
    "--num-fewshot": "zero-shot",
    "--samples": "no sample texts in the report",
}
# where a flag cannot be reached with dummy inputs, the model-level test below covers its rule
NOT_REACHED = {
    "--keep": "topk reads a scored directory's quantiles before the weighting is validated; the field's "
    "rule is WeighOptions', tested in test_every_options_model_field_follows_the_rules",
}
# found by this test, in files another change owns: strict, so the day they are fixed this fails
KNOWN_GAPS: dict[tuple[str, str, int], str] = {}


def _kind(p: click.Parameter) -> str | None:
    if isinstance(p.type, click.types.IntParamType):
        return "int"
    if isinstance(p.type, click.types.FloatParamType):
        return "float"
    return None


def flags(kind_of=_kind) -> list[tuple[str, click.Option, str]]:
    """(command, option, its kind) for every int or float flag of every command, generated ones too."""
    found = []
    for name, cmd in sorted(main.commands.items()):
        with click.Context(cmd) as ctx:
            params = cmd.get_params(ctx)
        for p in params:
            kind = kind_of(p)
            if isinstance(p, click.Option) and kind:
                found.append((name, p, kind))
    return found


def bad_values(flag: str, kind: str) -> list:
    if flag in SEEDS:
        return [-1, SEED_LIMIT]
    if kind == "int":
        return [-1] if flag in ZERO_MEANS else [0, -1]
    return [math.nan, math.inf, -math.inf, -1.0]


def _cases():
    for command, p, kind in flags():
        flag = p.opts[0]
        if flag in NOT_REACHED:
            continue
        for value in bad_values(flag, kind):
            gap = KNOWN_GAPS.get((command, flag, value))
            marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
            yield pytest.param(command, flag, p.nargs, value, id=f"{command} {flag} {value}", marks=marks)


CASES = list(_cases())


def test_the_cases_cover_every_kind_of_number_flag():
    """Counts, seeds and floats of the trainer's model, the scorers', the weighting's, the engines' and
    the commands' own flags are all here."""
    reached = {(c, f) for c, f, *_ in (p.values for p in CASES)}
    for pair in [
        ("train", "--steps"),
        ("train", "--seed"),
        ("train", "--lr"),
        ("score", "--batch-size"),
        ("score", "--context"),
        ("weigh", "--shuffle"),
        ("weigh", "--floor"),
        ("tokenize", "--workers"),
        ("run", "--ray-wait-nodes"),
        ("eval-quant", "--max-sequences"),
        ("eval-bpb", "--n-ctx"),
        ("evaluate", "--seed"),
        ("train-tokenizer", "--max-docs"),
    ]:
        assert pair in reached, pair


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_ckpt, tokenizer_dir) -> dict[str, str]:
    """What each command needs to reach its options: dummy directories where the refusal comes before
    anything is read, a real checkpoint where eval-bpb checks a window against the model's."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "dir").mkdir()
    (root / "docs.jsonl").write_text('{"text": "a document"}\n')
    (root / "workflow.yaml").write_text("{}\n")
    return {
        "dir": str(root / "dir"),
        "docs": str(root / "docs.jsonl"),
        "workflow": str(root / "workflow.yaml"),
        "ckpt": str(tiny_ckpt),
        "tokenizer": str(tokenizer_dir),
    }


def _scorer_taking(flag: str) -> str:
    """The first built-in scorer whose options have `flag` (causal_loss for the shared ones)."""
    field = flag[2:].replace("-", "_")
    names = ["causal_loss", *BUILTIN]
    return next(n for n in names if field in get_scorer_class(n).Options.model_fields)


def argv(command: str, flag: str, inputs: dict, out: str) -> list[str]:
    """The command's arguments up to the flag under test."""
    d = inputs["dir"]
    if command == "score":
        scorer = _scorer_taking(flag) if flag[2:].replace("-", "_") in _all_scorer_fields() else "causal_loss"
        model = ["--option", f"model={d}"] if scorer == "cross_tokenizer" else ["--option", f"checkpoint={d}"]
        return ["score", d, "--scorer", scorer, *model, "--out", out]
    return {
        "train": ["train", d, "--out", out],
        "eval-bpb": ["eval-bpb", inputs["ckpt"], "--max-bytes", "2000"],
        "eval-quant": ["eval-quant", d, "--data", d],
        "evaluate": ["evaluate", d, "--out", out],
        "tokenize": ["tokenize", inputs["docs"], "--tokenizer", inputs["tokenizer"], "--out", out],
        "train-tokenizer": ["train-tokenizer", inputs["docs"], "--out", out],
        "weigh": ["weigh", d, "--out", out],
        "synthesize": ["synthesize", "--model", d, "--sequences", "1", "--n-ctx", "8", "--out", out],
        "run": ["run", inputs["workflow"]],
        "report": ["report", d, "--out", out + ".html"],
    }[command]


def _all_scorer_fields() -> set[str]:
    return {f for n in BUILTIN for f in get_scorer_class(n).Options.model_fields}


def snapshot(root: Path) -> dict[str, tuple]:
    seen = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            st = (Path(dirpath) / n).lstat()
            seen[str(Path(dirpath, n).relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return seen


def refused_in_one_line(result, *named) -> str:
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for word in named:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _named(flag: str) -> str:
    """How a refusal names a flag: `--lr` on the command line, `lr` in the trainer's config refusals."""
    return flag.lstrip("-").replace("-", "_")


@pytest.mark.parametrize(("command", "flag", "nargs", "value"), CASES)
def test_every_number_flag_refuses_what_it_cannot_mean(tmp_path, inputs, command, flag, nargs, value):
    """0 or -1 for a count, a seed torch or numpy would refuse late, NaN or ±inf (or -1) for a float:
    refused before anything is read or written, naming the flag."""
    out = str(tmp_path / "out")
    given = [str(value)] + (["0.9"] * (nargs - 1))  # --clip LO HI: the bad value first
    before = snapshot(tmp_path)
    result = CliRunner().invoke(main, [*argv(command, flag, inputs, out), flag, *given])
    line = refused_in_one_line(result)
    assert flag in line or _named(flag) in line, line
    assert snapshot(tmp_path) == before, "a refused command wrote something"


# ---------------------------------------------------------------- every options model


def _floats(annotation) -> bool:
    return annotation is float or any(_floats(a) for a in typing.get_args(annotation))


def _bad_field_values(field_name: str, annotation):
    """The values the field must refuse, shaped as the field is (a list, a pair)."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    inner = typing.get_origin(args[0]) if len(args) == 1 else origin
    if field_name in ("seed", "seeds", "shuffle"):
        shape = (lambda v: [v]) if (origin is list or inner is list) else (lambda v: v)
        return [shape(-1), shape(SEED_LIMIT)]
    if field_name == "device":
        return ["", "gpu", "meta"]
    if _floats(annotation):
        is_tuple = origin is tuple or inner is tuple
        shape = (lambda v: (v, 0.5)) if is_tuple else (lambda v: v)
        return [shape(v) for v in (math.nan, math.inf, -math.inf)]
    return []


# the workflow file's models (workflows/spec.py, owned by another change) that take a seed or a device
# as a bare int or str: strict, so the day they use entroweight.options.Seed / DeviceName this fails
SPEC_GAPS: set[tuple[str, str]] = set()


def _field_cases():
    for model in _options_models():
        for name, field in model.model_fields.items():
            key = field.alias or name
            for value in _bad_field_values(name, field.annotation):
                gap = (model.__name__, name) in SPEC_GAPS
                marks = (
                    [pytest.mark.xfail(strict=True, reason="workflows/spec.py: a bare int/str")]
                    if gap
                    else []
                )
                yield pytest.param(model, key, value, id=f"{model.__qualname__}.{key}={value!r}", marks=marks)


FIELD_CASES = list(_field_cases())


def test_the_field_cases_cover_every_front_end():
    covered = {(p.values[0].__name__, p.values[1]) for p in FIELD_CASES}
    for pair in [
        ("TrainConfig", "lr"),
        ("TrainConfig", "seed"),
        ("TrainConfig", "device"),
        ("TrainConfig", "betas"),
        ("WeighOptions", "clip"),
        ("WeighOptions", "shuffle"),
        ("WeighConfig", "quantiles"),
        ("ScorerOptions", "device"),
        ("TrainSpec", "device"),
        ("ExperimentRun", "margin"),
    ]:
        assert pair in covered, pair


@pytest.mark.parametrize(("model", "key", "value"), FIELD_CASES)
def test_every_options_model_field_follows_the_rules(model, key, value):
    """Every float field of every options model (the trainer's, the weighting's, the scorers', the
    workflow file's) refuses NaN and ±inf; every seed -1 and 2**63; every device a name torch does
    not know or entroweight does not run on. Refused at the key."""
    with pytest.raises(ValidationError) as e:
        model.model_validate({key: value})
    # at the key, or in the whole model's message that names each key (TrainConfig's)
    at_key = [err for err in e.value.errors() if err["loc"][:1] == (key,)]
    in_message = [
        m
        for err in e.value.errors()
        if not err["loc"]
        for m in err["msg"].split("; ")
        if m.startswith((f"{key}: ", f"{key}[")) or f" {key}: " in m or f" {key}[" in m
    ]
    assert at_key or in_message, e.value.errors()


# ---------------------------------------------------------------- devices

DEVICE_COMMANDS = sorted(
    c for c, cmd in main.commands.items() if any("--device" in getattr(p, "opts", ()) for p in cmd.params)
)


def not_here() -> list[str]:
    """Device names torch knows whose device this machine lacks (a CUDA index past the last)."""
    names = []
    if torch.cuda.is_available():
        names.append(f"cuda:{torch.cuda.device_count()}")
    else:
        names += ["cuda", "cuda:0"]
    if not torch.backends.mps.is_available():
        names.append("mps")
    return names


# cpu:7: torch takes the name, then every tensor op on it fails (a checkpoint was called corrupt)
BAD_DEVICES = ["", "gpu", "CUDA", "meta", "cpu:7", *not_here()]


def test_the_device_commands_are_every_command_that_runs_a_model():
    assert DEVICE_COMMANDS == ["eval-bpb", "eval-quant", "evaluate", "score", "synthesize", "train"]


@pytest.mark.parametrize("device", BAD_DEVICES)
@pytest.mark.parametrize("command", DEVICE_COMMANDS)
def test_every_command_refuses_a_device_it_cannot_run_on(tmp_path, inputs, command, device):
    """A device torch does not know, one entroweight does not run on, or CUDA / MPS where there is
    none: exit 2, one line naming --device and the value, before anything is read or written (before:
    RuntimeError / AttributeError tracebacks; `evaluate` left items.jsonl and .lm-eval/ in --out)."""
    out = str(tmp_path / "out")
    before = snapshot(tmp_path)
    result = CliRunner().invoke(main, [*argv(command, "--device", inputs, out), "--device", device])
    line = refused_in_one_line(result)
    assert "device" in line and (repr(device) in line or f"{device} but" in line), line
    assert snapshot(tmp_path) == before, "a refused command wrote something"


@pytest.mark.parametrize("device", BAD_DEVICES)
def test_the_library_calls_check_the_device_before_anything_else(tmp_path, device):
    """What the workflow's steps call (eval_bpb, evaluate_checkpoint, train) refuses the same devices
    first: nothing read, no scratch directory made."""
    from entroweight.trainers import TrainConfig, TrainError, train
    from entroweight.trainers.accuracy import AccuracyError, evaluate_checkpoint
    from entroweight.trainers.bpb import eval_bpb

    with pytest.raises(ValueError, match="device"):
        eval_bpb(str(tmp_path / "no-checkpoint"), device=device)
    with pytest.raises(AccuracyError, match="device"):
        evaluate_checkpoint(tmp_path / "no-checkpoint", ["t"], tmp_path / "work", device=device)
    assert not (tmp_path / "work").exists()
    with pytest.raises(TrainError, match="device"):
        train(TrainConfig(data=str(tmp_path), out=str(tmp_path / "run"), device=device))
    assert not (tmp_path / "run").exists()


def test_auto_and_cpu_are_always_here():
    assert device_here("auto").type in ("cuda", "cpu") and device_here("cpu").type == "cpu"
    assert device_name("cpu", auto=False) == "cpu"
    with pytest.raises(ValueError, match="'auto' is not a torch device"):
        device_name("auto", auto=False)  # a scorer is told where it runs
