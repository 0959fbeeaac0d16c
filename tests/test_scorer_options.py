"""Scorer options have one source of truth: each scorer's pydantic `Options` model (issue 15 item 6,
issue 19). make_scorer, `score --option KEY=VALUE` / the dedicated flags, a workflow's `options:` and
entry-point scorers all validate through it; unknown keys and names are refused with the key's path
and the valid keys; a workflow YAML with a key given twice is refused with its lines.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from entroweight.options import options_table
from entroweight.scorers import (
    OptionsError,
    Scorer,
    ScorerError,
    ScorerOptions,
    available,
    check_options,
    get_scorer_class,
    make_scorer,
)
from entroweight.scorers.registry import BUILTIN
from entroweight.workflows.cli.main import main
from entroweight.workflows.spec import SpecError, load_workflow

ROOT = Path(__file__).resolve().parent.parent
C4 = ROOT / "tests" / "data" / "c4" / "c4-sample.00000-of-00001.json.gz"
LLAMA3 = ROOT / "tests" / "data" / "tokenizers" / "llama3"


# -- the models themselves


# keywords a constructor takes only to refuse them with advice (Options refuses them first)
REFUSED_KEYWORDS = {("cross_tokenizer", "checkpoint")}


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_constructor_keyword_is_a_declared_option_with_the_same_default(name):
    """A keyword a scorer's constructor takes but its Options lacks could never be set from the CLI or a
    workflow (and would be refused as unknown): adding an option is one line in Options."""
    cls = get_scorer_class(name)
    fields = cls.Options.model_fields
    assert issubclass(cls.Options, ScorerOptions) and cls.Options.model_config["extra"] == "forbid"
    for klass in cls.__mro__[: cls.__mro__.index(Scorer)]:
        if "__init__" not in vars(klass):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            if (name, p.name) in REFUSED_KEYWORDS:
                continue
            assert p.name in fields, f"{klass.__name__}({p.name}=...) is not in {name}'s Options"
            f = fields[p.name]
            if p.default is not p.empty and not f.is_required():
                assert f.default == p.default, f"{name}.{p.name}: Options {f.default!r} != {p.default!r}"


def test_unknown_keys_and_bad_values_name_the_key_and_the_valid_ones():
    with pytest.raises(OptionsError) as e:
        check_options("causal_loss", {"model": "x", "dtyp": "fp32", "batch_size": 0, "device": "banana"})
    msg = str(e.value)
    assert "--dtyp: does not apply to the causal_loss scorer" in msg and "--dtype" in msg  # the valid keys
    assert "--batch-size: Input should be greater than or equal to 1" in msg
    assert "'banana' is not a torch device" in msg
    with pytest.raises(ScorerError, match="unknown scorer 'causal_los'; available: causal_loss"):
        check_options("causal_los", {})
    with pytest.raises(OptionsError, match="--metric: unknown metric 'l2'; input should be 'l1' or 'cosine'"):
        check_options("occlusion", {"checkpoint": "c", "metric": "l2"})
    with pytest.raises(OptionsError, match="--metric: does not apply to the causal_loss"):
        check_options("causal_loss", {"model": "x", "metric": "l1"})
    with pytest.raises(OptionsError, match="--checkpoint-short: required, not given"):
        check_options("two_model", {"checkpoint": "c"})
    with pytest.raises(OptionsError, match="exactly one of --model"):
        check_options("excess_loss", {"reference": "r"})


def test_cuda_is_a_valid_device_string_without_a_gpu():
    """The driver of a cluster may have no GPU while its workers do: only the syntax is checked here."""
    for device in ("cuda", "cuda:1", "cpu", "mps"):
        assert check_options("causal_loss", {"model": "x", "device": device}).device == device


def test_option_strings_are_read_as_their_types():
    """`--option KEY=VALUE` gives strings: the model reads them as its fields' types."""
    opts = check_options(
        "cross_tokenizer", {"context": "512", "stride": "128", "allow_pickle": "true", "dtype": "fp32"}
    )
    assert (opts.context, opts.stride, opts.allow_pickle, opts.dtype) == (512, 128, True, "fp32")
    with pytest.raises(OptionsError, match="--context: Input should be a valid integer"):
        check_options("cross_tokenizer", {"context": "lots"})


def test_docs_list_every_builtin_scorers_options():
    """docs/scoring.md carries each built-in's table as `options_table` writes it (the table to paste is
    in the failure's message)."""
    docs = (ROOT / "docs" / "scoring.md").read_text()
    for name in sorted(BUILTIN):
        table = options_table(get_scorer_class(name).Options)
        assert table in docs, f"docs/scoring.md: the options table of {name} is stale; it is now:\n{table}"


# -- entry-point scorers validate the same way


SCORER_MODULE = '''
import numpy as np
from pydantic import Field
from entroweight.scorers import Scorer, ScorerOptions


class LengthScorer(Scorer):
    """Value = position in the row (a toy third-party scorer)."""

    name = "by_length"

    class Options(ScorerOptions):
        scale: float = Field(1.0, gt=0, description="Multiplies the positions.")

    def __init__(self, scale=1.0, **kw):
        super().__init__(**kw)
        self.scale = scale

    def config(self):
        return {"scorer": self.name, "scale": self.scale}

    def setup(self, data_tokenizer=None):
        pass

    def score_batch(self, input_ids, n_pad):
        return np.tile(np.arange(input_ids.shape[1], dtype=np.float32) * self.scale, (len(input_ids), 1))
'''


@pytest.fixture
def entry_point_scorer(tmp_path, monkeypatch):
    """An installed distribution (a dist-info on sys.path) registering `by_length` under entroweight.scorers."""
    (tmp_path / "third_party_scorers.py").write_text(SCORER_MODULE)
    info = tmp_path / "third_party_scorers-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: third-party-scorers\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[entroweight.scorers]\nby_length = third_party_scorers:LengthScorer\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "by_length"
    sys.modules.pop("third_party_scorers", None)


def test_entry_point_scorer_options_are_validated(entry_point_scorer, tmp_path):
    assert entry_point_scorer in available()
    assert make_scorer("by_length", scale="2.5", batch_size=4).scale == 2.5
    with pytest.raises(OptionsError, match=r"--scal: does not apply to the by_length scorer \(its options: "):
        make_scorer("by_length", scal=2)
    with pytest.raises(OptionsError, match="--scale: Input should be greater than 0"):
        make_scorer("by_length", scale=0)
    # and in a workflow
    with pytest.raises(SpecError, match=r"scores\[0\]\.options\.scal: does not apply"):
        load_workflow(workflow(tmp_path, "scorer: by_length\n    options: {scal: 2}"))
    assert load_workflow(workflow(tmp_path, "scorer: by_length\n    options: {scale: 2}")).scores[0].options


# -- workflows


def workflow(tmp_path, score_step: str, extra: str = "") -> Path:
    """A workflow with one `models` step and a score step `s` (`score_step`: its keys, 4-space indented)."""
    path = tmp_path / "wf.yaml"
    path.write_text(
        f"run_dir: {tmp_path / 'run'}\n"
        f"sources: [{C4}]\n"
        f"tokenizer: {{path: {LLAMA3}}}\n"
        "models:\n"
        "  - name: causal\n"
        "    steps: 5\n"
        "scores:\n"
        "  - name: s\n"
        f"    {score_step}\n" + extra
    )
    return path


def test_a_typo_in_a_workflows_scorer_options_is_refused_with_its_path(tmp_path):
    """Before: `dtyp: fp32` was ignored and the run scored in bf16."""
    with pytest.raises(SpecError) as e:
        load_workflow(
            workflow(tmp_path, "scorer: causal_loss\n    checkpoint_from: causal\n    options: {dtyp: fp32}")
        )
    assert "scores[0].options.dtyp: does not apply to the causal_loss scorer" in str(e.value)
    assert "dtype" in str(e.value).split("its options:")[1]  # the valid keys


@pytest.mark.parametrize(
    "step, expected",
    [
        ("scorer: causal_los", r"scores\[0\]\.scorer: unknown scorer 'causal_los'; available: "),
        (
            "scorer: occlusion",
            r"scores\[0\]\.checkpoint_from: the occlusion scorer needs one of our checkpoints",
        ),
        (
            "scorer: cross_tokenizer\n    checkpoint_from: causal",
            r"scores\[0\]\.checkpoint_from: the cross_tokenizer scorer reads no checkpoint",
        ),
        (
            "scorer: occlusion\n    checkpoint_from: causal\n    options: {metric: l2, batch_size: 0}",
            r"scores\[0\]\.options\.batch_size: Input should be greater than or equal to 1 \(got 0\)\n"
            r"scores\[0\]\.options\.metric: unknown metric 'l2'; input should be 'l1' or 'cosine'",
        ),
        (
            "scorer: causal_loss\n    checkpoint_from: causal\n    weighting: {quantiles_from: s}",
            r"scores\[0\]\.weighting\.quantiles_from: applies to methods quantile and topk only",
        ),
        ("scorer: causal_loss\n    options: {device: banana, model: m}", r"'banana' is not a torch device"),
    ],
)
def test_workflow_score_steps_are_refused_at_validation(tmp_path, step, expected):
    with pytest.raises(SpecError, match=expected):
        load_workflow(workflow(tmp_path, step))


def test_dry_run_refuses_an_unknown_scorer_before_anything_exists(tmp_path):
    """Before: `--dry-run` said the step would run; the real run failed after the tokenizer, the tokens
    and the models were built."""
    res = CliRunner().invoke(main, ["run", str(workflow(tmp_path, "scorer: causal_los")), "--dry-run"])
    assert res.exit_code == 2, res.output
    assert "scores[0].scorer: unknown scorer 'causal_los'" in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)  # no traceback
    assert not (tmp_path / "run").exists()


def test_duplicate_yaml_keys_are_refused_with_their_lines(tmp_path):
    """Before: the last one won silently (here the run would have scored in bf16)."""
    path = workflow(
        tmp_path,
        "scorer: causal_loss\n    checkpoint_from: causal\n    options:\n      dtype: fp32\n      dtype: bf16",
    )
    with pytest.raises(SpecError, match=r"duplicate key 'dtype' \(line 13; first given on line 12\)"):
        load_workflow(path)
    top = tmp_path / "top.yaml"
    top.write_text(path.read_text().replace("scores:\n", "scores: []\nscores:\n", 1))
    with pytest.raises(SpecError, match=r"duplicate key 'scores' \(line \d+; first given on line \d+\)"):
        load_workflow(top)


def test_yaml_safety_kept_merge_keys_still_override(tmp_path):
    """The loader is still the safe one (no object tags); a YAML merge key may be overridden on purpose."""
    tagged = tmp_path / "tag.yaml"
    tagged.write_text(
        f"run_dir: !!python/object/apply:os.getcwd []\nsources: [{C4}]\ntokenizer: {{path: x}}\n"
    )
    with pytest.raises(SpecError, match="could not determine a constructor"):
        load_workflow(tagged)
    second = "  - name: t\n    scorer: causal_loss\n    checkpoint_from: causal\n    options: {<<: *o, dtype: fp32}\n"
    path = workflow(
        tmp_path,
        "scorer: causal_loss\n    checkpoint_from: causal\n    options: &o {dtype: bf16, batch_size: 4}",
        second,
    )
    wf = load_workflow(path)
    assert wf.scores[1].options == {"dtype": "fp32", "batch_size": 4}
