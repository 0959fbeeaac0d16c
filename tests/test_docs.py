"""The docs a user reads are kept true by tests where a rule can say what true is: every code fence
closed (one left open turned most of docs/design.md into a code block, its sections with it), every
relative link and anchor leading somewhere, and the workflow reference naming the spec's keys."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(path: Path) -> list[str]:
    """The lines outside code fences."""
    out, inside = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            out.append(line)
    return out


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a file's headings: lower case, punctuation but - and _ dropped, spaces -."""
    heads = [line.lstrip("#").strip() for line in _prose(path) if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_code_fence_is_closed(doc):
    fences = [i for i, line in enumerate(doc.read_text().splitlines(), 1) if FENCE.match(line)]
    assert len(fences) % 2 == 0, f"{doc.name}: an unclosed code fence; fences on lines {fences}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_leads_somewhere(doc):
    broken = []
    for line in _prose(doc):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(target)
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(target)
    assert not broken, f"{doc.name}: links that lead nowhere: {broken}"


def _keys(model: type) -> set[str]:
    """A spec model's YAML keys (a field's alias where it has one: `model_config`)."""
    return {f.alias or name for name, f in model.model_fields.items()}


def test_the_workflow_reference_names_every_key_of_the_spec():
    """docs/workflows.md's annotated YAML is the reference a user writes a workflow from: each section
    it gives whole holds exactly the spec's keys, and no section names a key the spec refuses (it
    lacked `tokenize.overflow`, which `workflows/default.yaml` sets)."""
    import re

    import yaml

    from entroweight.workflows import spec

    text = (ROOT / "docs" / "workflows.md").read_text()
    block = yaml.safe_load(re.search(r"```yaml\n(run_dir:.*?)```", text, re.S).group(1))
    scores = block["scores"]
    whole = {  # a section given whole in the reference -> the model of its keys
        "the workflow": (block, spec.Workflow),
        "tokenizer": (block["tokenizer"], spec.TokenizerSpec),
        "tokenizer.train": (block["tokenizer"]["train"], spec.TrainTokenizer),
        "tokenize": (block["tokenize"], spec.TokenizeSpec),
        "holdout": (block["holdout"], spec.HoldoutSpec),
        "scores (all entries)": ({k: None for s in scores for k in s} | {"out": None}, spec.ScoreSpec),
        "agreement": (block["agreement"], spec.AgreementSpec),
        "agreement.pairs": (block["agreement"]["pairs"][0], spec.AgreementPair),
        "synthesize": (block["synthesize"], spec.SynthesizeSpec),
        "truth": (block["truth"], spec.TruthSpec),
        "excess": (block["excess"], spec.ExcessSpec),
        "eval": (block["eval"], spec.EvalSpec),
        "accuracy": (block["accuracy"], spec.AccuracySpec),
        "report": (block["report"], spec.ReportSpec),
    }
    for where, (section, model) in whole.items():
        assert set(section) == _keys(model), (where, set(section) ^ _keys(model))
    partial = {  # given in part (the trainer settings are TrainConfig's, listed in a comment)
        "models": (block["models"][0], spec.ModelSpec),
        "scores[].weighting": (scores[0]["weighting"], spec.Weighting),
        "train": (block["train"], spec.TrainSpec),
        "train.runs": ({k: None for r in block["train"]["runs"] for k in r}, spec.ExperimentRun),
    }
    for where, (section, model) in partial.items():
        assert set(section) <= _keys(model), (where, set(section) - _keys(model))
