# ruff: noqa: F811 - pytest fixtures imported from test_weigh_stage
"""Quantiles of another unit are refused by every front end that reads them (workflows/quantiles.py):
L1-occlusion quantiles applied to values in nats put every weight at 0 with exit 0 before.

Real parquet scored by a tiny HF Llama (causal_loss, nats); the other unit is the same directory with
its metadata's `unit` set to another scorer's (l1 occlusion)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_weigh_stage import model, scored, tokens  # noqa: F401 - fixtures

from entroweight.schemas.arrow import METADATA_KEY
from entroweight.workflows.cli.main import main
from entroweight.workflows.quantiles import reference_quantiles, values_unit

OTHER = "occlusion_l1"


@pytest.fixture(scope="module")
def other_unit(scored, tmp_path_factory):  # noqa: F811
    from stagecopy import stage_subset

    def relabel(t):
        meta = json.loads(t.schema.metadata[METADATA_KEY])
        return t.replace_schema_metadata({METADATA_KEY: json.dumps({**meta, "unit": OTHER})})

    return stage_subset(scored, tmp_path_factory.mktemp("other-unit"), edit=relabel)


def front_ends(scored, tokens, model):  # noqa: F811
    """Each command that takes --quantiles-from, as argv without it."""
    return {
        "weigh": ["weigh", str(scored), "--weighting", "quantile"],
        "score": [
            "score",
            str(tokens),
            "--scorer",
            "causal_loss",
            "--model",
            str(model),
            "--dtype",
            "fp32",
            "--weighting",
            "quantile",
        ],
    }


@pytest.mark.parametrize("command", ["weigh", "score"])
def test_quantiles_of_another_unit_are_refused(command, scored, tokens, model, other_unit, tmp_path):  # noqa: F811
    assert values_unit(scored) == "nats" and values_unit(other_unit) == OTHER
    out = tmp_path / "out"
    argv = [
        *front_ends(scored, tokens, model)[command],
        "--quantiles-from",
        str(other_unit),
        "--out",
        str(out),
    ]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2, (r.output, r.exception)
    line = r.output.strip()
    assert "\n" not in line and "Traceback" not in line
    assert f"--quantiles-from {other_unit}" in line and repr(OTHER) in line and "'nats'" in line, line
    assert not os.path.exists(out)


@pytest.mark.parametrize("command", ["weigh", "score"])
def test_quantiles_from_a_file_that_is_not_parquet_are_refused_naming_it(
    command, scored, tokens, model, tmp_path
):
    """A documents file given as --quantiles-from: one line naming the flag and the file (it said
    "Parquet magic bytes not found in footer" alone), exit 2, nothing written."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "hello"}\n')
    out = tmp_path / "out"
    argv = [*front_ends(scored, tokens, model)[command], "--quantiles-from", str(docs), "--out", str(out)]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2, (r.output, r.exception)
    line = r.output.strip()
    assert "\n" not in line and f"--quantiles-from {docs} is not scored parquet data" in line, line
    assert not os.path.exists(out)


def test_quantiles_of_the_same_unit_are_taken(scored, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    argv = [
        "weigh",
        str(scored),
        "--weighting",
        "quantile",
        "--quantiles-from",
        str(scored),
        "--out",
        str(out),
    ]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    # the same --out under another setting: the refusal names it by its dotted key, long values cut
    # (the 100 reference quantiles it printed whole made it one 3-KB line)
    r = CliRunner().invoke(main, [*argv, "--floor", "0.25"])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and len(line) < 400 and "weighting.floor: 0.0 -> 0.25" in line, line


def test_the_workflow_field_is_named(other_unit):
    """The runner's `quantiles_from:` goes through the same function, naming its field."""
    with pytest.raises(ValueError, match=f"quantiles_from .* unit '{OTHER}', but .* 'nats'"):
        reference_quantiles(other_unit, "nats", "quantiles_from")


def test_a_workflow_of_mixed_units_is_refused_by_its_dry_run(tmp_path):
    """`quantiles_from:` a step of another unit is refused at validation, so `--dry-run` of a fresh
    workflow (no step has run, no values to read a unit from) exits 2 naming the key and both units,
    before anything is written: the units come from the steps' scorers (workflows/quantiles.py)."""
    import yaml

    from entroweight.workflows.spec import SpecError, parse_workflow

    wf = yaml.safe_load((Path(__file__).parent / "data" / "workflow-tiny.yaml").read_text())
    wf["run_dir"] = str(tmp_path / "run")
    wf["scores"].append(
        {
            "name": "by_occlusion_scale",
            "scorer": "causal_loss",
            "checkpoint_from": "causal",
            "options": {"dtype": "fp32"},
            "weighting": {"method": "quantile", "quantiles_from": "occlusion"},
        }
    )
    f = tmp_path / "wf.yaml"
    f.write_text(yaml.safe_dump(wf))
    r = CliRunner().invoke(main, ["run", str(f), "--dry-run"])
    assert r.exit_code == 2, r.output
    assert (
        "scores[2].weighting.quantiles_from" in r.output
        and "'l1_minmax'" in r.output
        and "'nats'" in r.output
    )
    assert "Traceback" not in r.output and not (tmp_path / "run").exists()
    with pytest.raises(SpecError, match="quantiles_from"):
        parse_workflow(wf)
    wf["scores"][2]["weighting"]["quantiles_from"] = "causal_loss"  # nats for nats: taken
    parse_workflow(wf)
