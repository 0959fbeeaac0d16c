"""Beam and Ray are extras: the default path runs without them, and asking for a missing engine is a
clean refusal that names the extra to install (exit 2, one line, nothing written)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from entroweight.workflows.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "workflow-tiny.yaml"
ENGINE_MODULES = {"beam": "apache_beam", "ray": "ray"}


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_refused(res, engine):
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)  # no traceback
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and f"pip install 'entroweight[{engine}]'" in lines[0], res.output


def test_optional_engines_are_extras_and_dev_pulls_them():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert "apache-beam" not in core and "ray" not in core and "rich" not in core
    extras = project["optional-dependencies"]
    assert any(d.startswith("apache-beam") for d in extras["beam"])
    assert any(d.startswith("ray") for d in extras["ray"])
    # `make` installs .[dev]: the suite tests both engines (and the export libraries)
    dev_extras = next(d for d in extras["dev"] if d.startswith("entroweight["))
    assert {"beam", "ray"} <= set(dev_extras.removeprefix("entroweight[").rstrip("]").split(","))


@pytest.mark.parametrize("engine", sorted(ENGINE_MODULES))
def test_stage_command_refuses_a_missing_engine(engine, monkeypatch, tmp_path, c4_path, tokenizer_dir):
    monkeypatch.setitem(sys.modules, ENGINE_MODULES[engine], None)  # as if not installed
    out = tmp_path / "tokens"
    res = cli("tokenize", c4_path, "--tokenizer", tokenizer_dir, "--out", out, "--engine", engine)
    assert_refused(res, engine)
    assert not out.exists()


@pytest.mark.parametrize("engine", sorted(ENGINE_MODULES))
def test_workflow_refuses_a_missing_engine_before_the_first_step(engine, monkeypatch, tmp_path):
    spec = yaml.safe_load(TINY.read_text())
    spec["run_dir"] = str(tmp_path / "run")
    spec["sources"] = [str(ROOT / s) for s in spec["sources"]]
    wf = tmp_path / "wf.yaml"
    wf.write_text(yaml.safe_dump(spec))
    monkeypatch.setitem(sys.modules, ENGINE_MODULES[engine], None)
    assert_refused(cli("run", wf, "--engine", engine), engine)
    assert not (tmp_path / "run").exists()  # no tokenizer trained, no run dir
