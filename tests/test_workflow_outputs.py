"""A workflow step whose output is, holds or lies inside another step's (or is the run directory's
record) is refused at validation, so `run --dry-run` refuses it too, exit 2, nothing written.

The cases are made from the spec itself: every pair of step outputs that `Workflow.step_outputs`
lists for tests/data/workflow-tiny.yaml, each step's `out` moved onto, into and over another's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from entroweight.workflows.cli.main import main
from entroweight.workflows.spec import parse_workflow

TINY = Path(__file__).parent / "data" / "workflow-tiny.yaml"
MOVABLE = {"tokenize.out": ("tokenize",), "train.out": ("train",), "eval.out": ("eval",)}


def base() -> dict:
    return yaml.safe_load(TINY.read_text())


def _set_out(spec: dict, field: str, value: str) -> None:
    if field.startswith("scores["):
        spec["scores"][int(field[7 : field.index("]")])]["out"] = value
    else:
        spec.setdefault(field.split(".")[0], {})["out"] = value


def _cases():
    outs = parse_workflow({**base(), "run_dir": "r"}).step_outputs()
    movable = [(f, p) for f, p in outs if f.endswith(".out") and f != "report.out"]
    for f, _ in movable:
        for g, q in outs:
            if f == g:
                continue
            for how, value in (("is", str(q)), ("lies inside", f"{q}/sub")):
                yield pytest.param(f, value, how, id=f"{f}-{how}-{g}")
    f, p = movable[0]
    yield pytest.param(f, "run.json", "run directory", id=f"{f}-is-run.json")


@pytest.mark.parametrize(("field", "value", "how"), list(_cases()))
def test_overlapping_step_outputs_are_refused_by_dry_run(tmp_path, field, value, how):
    spec = {**base(), "run_dir": str(tmp_path / "run")}
    _set_out(spec, field, value)
    wf = tmp_path / "wf.yaml"
    wf.write_text(yaml.safe_dump(spec))
    r = CliRunner().invoke(main, ["run", str(wf), "--dry-run"])
    assert r.exit_code == 2, r.output
    said = "run directory" if how == "run directory" else "give each step its own directory"
    assert field in r.output and said in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "run").exists()


def test_the_tiny_workflow_has_its_outputs_apart():
    assert len(parse_workflow({**base(), "run_dir": "r"}).step_outputs()) >= 8


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("run_dir", "", "run_dir: is empty"),
        ("run_dir", "   ", "run_dir: is empty"),
        ("sources", [""], "sources: a source is empty"),
    ],
    ids=["run_dir-empty", "run_dir-blank", "source-empty"],
)
def test_an_empty_path_in_a_workflow_is_refused(tmp_path, monkeypatch, key, value, says):
    """A path templated from an unset variable (`run_dir: "$RUN"`): refused by --dry-run and by run,
    nothing written (an empty run_dir was the working directory)."""
    wf = tmp_path / "wf.yaml"
    spec = {**base(), "run_dir": str(tmp_path / "run"), key: value}
    wf.write_text(yaml.safe_dump(spec))
    monkeypatch.chdir(tmp_path)
    for argv in (["run", str(wf), "--dry-run"], ["run", str(wf)]):
        r = CliRunner().invoke(main, argv)
        assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output
        assert sorted(p.name for p in tmp_path.iterdir()) == ["wf.yaml"]
