"""Options are declared once (issue 25, items 4 and 7): the weighting's model (transforms/weigh.py
WeighOptions) makes the weighting flags of `score` and `weigh`, a workflow's `weighting:` keys and the
docs' tables; each scorer's Options model makes `score`'s scorer flags; each engine's OPTIONS make
the engine flags of every stage command and of `run`. One formatter words every refusal.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from entroweight.options import options_table
from entroweight.pipelines import ENGINES, engine_module
from entroweight.scorers.registry import BUILTIN, get_scorer_class
from entroweight.transforms.weigh import WeighConfig, WeighOptions
from entroweight.workflows.cli.common import weighting_flag
from entroweight.workflows.cli.main import main
from entroweight.workflows.spec import Weighting

ROOT = Path(__file__).resolve().parent.parent
C4 = ROOT / "tests" / "data" / "c4" / "c4-sample.00000-of-00001.json.gz"


def options(command: str) -> dict[str, click.Option]:
    """A command's options by flag, generated ones included."""
    cmd = main.commands[command]
    with click.Context(cmd) as ctx:
        return {o: p for p in cmd.get_params(ctx) if isinstance(p, click.Option) for o in p.opts}


def default(p: click.Option):
    """What the command receives when the flag is not given."""
    with click.Context(click.Command("c")) as ctx:
        return p.get_default(ctx)


def described(p: click.Option) -> tuple:
    return (p.type.name, getattr(p.type, "choices", None), default(p), p.nargs, p.is_flag, p.help)


def test_score_and_weigh_take_the_same_weighting_flags():
    """Before: `score --keep` existed and `weigh` needed `--option keep=0.6`; `--floor` defaulted to 0.0
    in one and None in the other."""
    score, weigh = options("score"), options("weigh")
    for field, info in WeighOptions.model_fields.items():
        flag = weighting_flag(field)
        assert flag in score and flag in weigh, flag
        assert described(score[flag]) == described(weigh[flag]), flag
        assert score[flag].help == info.description
        if not score[flag].is_flag:
            assert default(score[flag]) == info.default, flag
    assert "--option" not in weigh  # every weighting field has its flag


def test_every_builtin_scorer_option_is_a_score_flag():
    score = options("score")
    for name in BUILTIN:
        for key, field in get_scorer_class(name).Options.model_fields.items():
            flag = "--" + key.replace("_", "-")
            assert flag in score, f"{name}.{key} has no flag"
            assert field.description in score[flag].help
            assert default(score[flag]) in (None, False)  # not given: the scorer's own default


def test_the_workflow_weighting_is_the_weighting_and_the_runner_builds_it_whole():
    assert issubclass(Weighting, WeighOptions)
    assert set(Weighting.model_fields) - set(WeighOptions.model_fields) == {"quantiles_from"}
    w = Weighting(method="topk", keep=0.5, floor=0.1, dtype="uint8", quantiles_from="s")
    config = WeighConfig(**w.model_dump(exclude={"quantiles_from"}), quantiles=(0.0, 1.0))
    assert config.model_dump(exclude={"quantiles"}) == w.model_dump(exclude={"quantiles_from"})


def test_every_engine_option_is_a_keyword_of_its_run_and_a_flag_of_every_stage_command():
    flags = {c: options(c) for c in ("tokenize", "score", "weigh", "run")}
    for engine in ENGINES:
        module = engine_module(engine)
        takes = inspect.signature(module.run).parameters
        for key, option in module.OPTIONS.items():
            assert key in takes, f"{engine}.run takes no {key}"
            for command, found in flags.items():
                assert option.flag in found, f"{command} lacks {option.flag}"
    assert described(flags["run"]["--ray-wait-nodes"]) == described(flags["score"]["--ray-wait-nodes"])


def test_starting_the_cli_imports_no_model_or_engine_library():
    """The generated flags come from modules that import torch and pyarrow: made when a command runs."""
    code = (
        "import sys, entroweight.workflows.cli.main; print(sorted({'torch', 'pyarrow'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- refusals name the key the caller's way


def test_a_bad_weighting_flag_value_is_refused_naming_the_flag(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    for command, extra in (("score", ["--scorer", "causal_loss", "--model", "m"]), ("weigh", [])):
        r = CliRunner().invoke(main, [command, str(data), "--out", str(out), *extra, "--floor", "2"])
        assert r.exit_code == 2, r.output
        assert "--floor: Input should be less than or equal to 1 (got 2.0)" in r.output
        assert "Traceback" not in r.output and not out.exists()


def test_a_typo_in_a_workflows_weighting_is_refused_naming_its_path(tmp_path):
    wf = tmp_path / "wf.yaml"
    wf.write_text(
        f"run_dir: {tmp_path / 'run'}\nsources: [{C4}]\ntokenizer: {{train: {{vocab_size: 512}}}}\n"
        "scores:\n  - name: s\n    scorer: causal_loss\n    options: {model: m}\n"
        "    weighting: {flor: 0.1, keep: 0.5}\n"
    )
    r = CliRunner().invoke(main, ["run", str(wf), "--dry-run"])
    assert r.exit_code == 2, r.output
    assert "scores[0].weighting.flor: unknown key" in r.output
    assert "scores[0].weighting.keep: applies to topk weighting only, not minmax" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "run").exists()


# -- the docs' tables are generated


@pytest.mark.parametrize(
    "doc, table",
    [
        ("scoring.md", options_table(WeighOptions, key=lambda n: f"`{weighting_flag(n)}`", head="flag")),
        ("workflows.md", options_table(Weighting, head="`weighting:` key")),
    ],
    ids=["scoring-flags", "workflow-keys"],
)
def test_the_docs_carry_the_weighting_tables_the_model_generates(doc, table):
    assert table in (ROOT / "docs" / doc).read_text(), (
        f"docs/{doc}: the weighting table is stale; now:\n{table}"
    )


def _options_models() -> list[type]:
    """Every options model: each subclass of entroweight.options.Options, the built-in scorers' too."""
    import entroweight.trainers.config  # noqa: F401 - the trainer's and the workflow's models
    import entroweight.workflows.spec  # noqa: F401
    from entroweight.options import Options

    for name in BUILTIN:
        get_scorer_class(name)
    seen, todo = [], [Options]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


def _swaps():
    """(model, key, value) for every number field given a bool and every switch given a number."""
    import typing

    for model in _options_models():
        for name, field in model.model_fields.items():
            kinds = set(typing.get_args(field.annotation)) or {field.annotation}
            key = field.alias or name
            if kinds & {int, float} and bool not in kinds:
                yield pytest.param(model, key, True, id=f"{model.__qualname__}.{key}=true")
            elif kinds - {type(None)} == {bool}:
                yield pytest.param(model, key, 1, id=f"{model.__qualname__}.{key}=1")


SWAPS = list(_swaps())


def test_the_swaps_cover_every_front_end():
    """The models of the scorers, the weighting, the trainer and the workflow file all have cases."""
    covered = {p.values[0].__module__.rsplit(".", 1)[-1] for p in SWAPS}
    assert {"base", "weigh", "config", "spec", "occlusion"} <= covered, covered


@pytest.mark.parametrize(("model", "key", "value"), SWAPS)
def test_a_bool_is_never_a_number_nor_a_number_a_switch(model, key, value):
    """YAML's `yes`/`true` where a number goes (`stride: yes` would be stride 1), or 1 where a switch
    goes: refused, naming the key, on every options model."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        model.model_validate({key: value})
    said = str(value).lower()
    # at the key, or in the whole model's message that names each key (TrainConfig's)
    mine = [err["msg"] for err in e.value.errors() if err["loc"][:1] == (key,)] or [
        m for err in e.value.errors() if not err["loc"] for m in err["msg"].split("; ") if f"{key}: " in m
    ]
    assert mine and (f"not {said}" in mine[0] or "not true/false" in mine[0]), e.value.errors()
