"""A workflow YAML file as pydantic models: what `entroweight run WORKFLOW.yaml` runs.

Every section refuses unknown keys, and a refusal names the key's path (`scores[1].scorer: ...`).
Input paths (sources, model configs, a given tokenizer) are read where they are; every output
lies under `run_dir`, and a step's `out` cannot leave it (no absolute paths, no `..`).
See docs/workflows.md for the reference.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import yaml
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from entroweight import storage
from entroweight.options import DeviceName, Options, Seed, refusal_lines, repeated
from entroweight.schemas.arrow import check_n_ctx
from entroweight.trainers import config as trainer_config
from entroweight.trainers.accuracy import OFFLINE_TASK
from entroweight.trainers.config import LossName, LossSettings
from entroweight.trainers.losses import LOSSES
from entroweight.transforms.agreement import WRITEUP
from entroweight.transforms.derive import OPS as VALUE_OPS
from entroweight.transforms.sources import check_text_column
from entroweight.transforms.train_tokenizer import MAX_VOCAB_SIZE
from entroweight.transforms.weigh import GLOBAL_SCALE, WeighOptions

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
TOKENS = "tokens"  # the data name of the tokenized (unweighted) dataset
SYNTHETIC = "synthetic"  # the data name of the corpus drawn from a teacher (`synthesize:`)
DATA = (TOKENS, SYNTHETIC)  # what a models or score step reads
# The report is one HTML file, named so: no record of a run (JSON, parquet, a checkpoint) ends in it,
# so a report can never be written over what it reads. The spec's `report.out` and `report --out`
# (workflows/report/html.py, which imports this: report -> report_data -> spec) both ask `is_report_name`.
REPORT_SUFFIX = ".html"
REPORT_FILE = f"report{REPORT_SUFFIX}"  # its name when none is given


def is_report_name(path: str | os.PathLike) -> bool:
    """Whether `path` (a file name, a path or a URL) is named as the report must be: its last name as
    written (a Path would hide a trailing `/`, `/.` or `/..`, which name directories) has REPORT_SUFFIX."""
    last = str(path).replace(os.sep, "/").rsplit("/", 1)[-1]
    return last not in ("", ".", "..") and PurePosixPath(last).suffix.lower() == REPORT_SUFFIX


class SpecError(ValueError):
    """The workflow file is refused; the message names the offending key."""


class _Strict(Options):
    model_config = ConfigDict(extra="forbid")


def _name(v: str) -> str:
    if not NAME.match(v):
        raise ValueError(f"{v!r} is not a step name (letters, digits, _ . -; at most 64)")
    return v


def _inside(v: str | None) -> str | None:
    """An output path relative to run_dir that stays inside it."""
    if v is None:
        return v
    if storage.is_url(v) or storage.url_slip(v):  # `s3://b/x` read as a path was run_dir/s3:/b/x
        raise ValueError(
            f"{v!r} names a store: a step's outputs are paths relative to run_dir, on this machine"
        )
    p = PurePosixPath(v.replace("\\", "/"))
    if p.is_absolute() or v.startswith("~") or re.match(r"^[A-Za-z]:", v):
        raise ValueError(f"{v!r} is absolute: outputs are paths relative to run_dir")
    if ".." in p.parts:
        raise ValueError(f"{v!r} leaves run_dir ('..'): outputs stay inside the run directory")
    if not p.parts or str(p) == ".":
        raise ValueError("an output path must name a directory below run_dir")
    return str(p)


class TrainTokenizer(_Strict):
    vocab_size: int = Field(8000, ge=16, le=MAX_VOCAB_SIZE)
    max_docs: int | None = Field(None, ge=1)
    algorithm: Literal["bpe", "lz78", "lz78-freqgated"] = "bpe"
    base: str | None = None  # tokenizer whose pre-tokenizer BPE reuses (default: bundled Llama 3)


def _local(v: str | None) -> str | None:
    """A path the run reads or writes on this machine (a file:// URL: its path, as storage.path reads
    it; a `..` after a directory that does not exist: the path it means, as a command's, `as_meant`);
    another URL is refused: the run's directory, its lock and these files are local."""
    if v is not None and str(v).startswith("file://"):
        v = str(storage.path(v))
    if v is not None and storage.is_url(v):
        raise ValueError(f"{v!r} is a URL; give a path on this machine (stage commands take URLs)")
    if v is not None and (why := storage.url_slip(v)):
        raise ValueError(why)
    return v if v is None else storage.as_meant(v)


def _model_kind(v: str) -> str:
    from entroweight.models import model_class

    model_class(v)  # an unknown kind: ValueError naming the kinds
    return v


def _model_fields(v: dict, info) -> dict:
    """A step's inline model `config`, checked as `train` checks it (models.config_of) where it is the
    whole config; beside a `model_config` file, which it overrides, its keys alone (the rest needs the
    file). So a misspelt field is refused with its key path, from the spec."""
    from entroweight.models import config_of, model_class

    kind = info.data.get("kind")
    if kind is None:  # refused by its own field
        return v
    if info.data.get("model_config_file") is None:
        config_of(kind, v)
        return v
    fields = {f.name for f in dataclasses.fields(model_class(kind).Config)}
    if unknown := sorted(set(v) - fields):
        raise ValueError(
            f"{', '.join(unknown)}: not a field of {kind} (its fields: {', '.join(sorted(fields))})"
        )
    return v


class TokenizerSpec(_Strict):
    """Either `path` (a tokenizer.json or its directory) or `train` (a new one on the sources)."""

    path: str | None = None
    train: TrainTokenizer | None = None
    out: str = "tokenizer"

    _out = field_validator("out")(_inside)
    _path = field_validator("path")(_local)

    @model_validator(mode="after")
    def _one(self):
        if (self.path is None) == (self.train is None):
            raise ValueError(
                "give exactly one of `path` (an existing tokenizer) or `train` (vocab_size, ...)"
            )
        return self


class TokenizeSpec(_Strict):
    n_ctx: int = 512
    pack: bool = False
    shard_docs: int | None = Field(None, ge=1)
    text_column: str = "text"
    reject_duplicates: bool = False
    overflow: Literal["split", "truncate"] = "split"  # a document over n_ctx: next rows, or cut
    out: str = "tokens"

    _out = field_validator("out")(_inside)
    _text_column = field_validator("text_column")(check_text_column)
    _n_ctx = field_validator("n_ctx")(lambda v: check_n_ctx(v, "n_ctx"))  # as `tokenize --n-ctx`


class TrainSettings(trainer_config.TrainSettings):
    """The trainer's knobs (trainers/config.py, entroweight train's options) shared by estimator and
    experiment runs, and the number of processes each run trains on."""

    nproc: int = Field(1, ge=1)  # >1: torchrun --nproc_per_node N (GPUs)


class ModelSpec(TrainSettings):
    """A model trained on the tokenized data before scoring (a causal scorer, an estimator)."""

    name: str
    kind: str = "llama"  # models.REGISTRY kind: llama, mixer, estimator, ...
    model_config_file: str | None = Field(None, alias="model_config")
    config: dict[str, Any] = Field(default_factory=dict)  # inline fields, over the file's
    loss: LossName = "ce"
    seed: Seed = 0
    data: Literal[DATA] = TOKENS  # type: ignore[valid-type]  # the tokens, or the synthetic corpus

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    _name = field_validator("name")(_name)
    _model_config_file = field_validator("model_config_file")(_local)
    _kind = field_validator("kind")(_model_kind)
    _config = field_validator("config")(_model_fields)


class Weighting(WeighOptions):
    """The weighting's options (transforms/weigh.py), and where a method on a global scale reads its
    reference quantiles: an earlier score step here, where the command line takes a directory."""

    quantiles_from: str | None = Field(
        None,
        validate_default=True,
        description="quantile, topk: an earlier score step (scored with minmax) whose values set the scale.",
    )

    @field_validator("quantiles_from")
    @classmethod
    def _q(cls, v, info: ValidationInfo):
        method = info.data.get("method")
        if method in GLOBAL_SCALE and not v:
            raise ValueError(f"{method} weighting needs it: a score step scored with minmax")
        if v and method not in (None, *GLOBAL_SCALE):
            raise ValueError(
                f"applies to methods {' and '.join(GLOBAL_SCALE)} only: drop it or change the method"
            )
        return v


class ScoreSpec(_Strict):
    name: str
    scorer: str | None = None  # causal_loss | cross_tokenizer | occlusion | a registered scorer
    checkpoint_from: str | None = None  # a `models` step: its checkpoint becomes options.checkpoint
    options: dict[str, Any] = Field(default_factory=dict)  # validated by the scorer's Options model
    weighting: Weighting = Field(default_factory=Weighting)
    with_entropy: bool = True
    data: Literal[DATA] = TOKENS  # type: ignore[valid-type]  # what it scores: the tokens, or the synthetic corpus
    limit_shards: int | None = Field(None, ge=1)  # score the first N shards only (slow scorers)
    limit_rows: int | None = Field(None, ge=1)  # and the first N rows of each (a sample: decomposition)
    # drop each document whose real tokens' mean weight is below this (`--min-mean-weight`): counted
    min_mean_weight: float | None = Field(None, ge=0.0, le=1.0)
    # instead of a scorer: an earlier score step whose stored values are weighed anew (the weigh
    # stage, as `entroweight weigh`: no second scoring), e.g. Rho-1's top-k of the excess loss; or two
    # earlier steps on the same tokens whose values `op` combines (derived values: Rho-1's excess as
    # causal_loss minus a reference model's stored losses)
    values_from: str | list[str] | None = None
    op: Literal[VALUE_OPS] | None = None  # type: ignore[valid-type]
    out: str | None = None  # default scores/<name>

    @field_validator("values_from")
    @classmethod
    def _sources(cls, v):
        if isinstance(v, list):
            if len(v) == 1:
                return v[0]
            if len(v) != 2 or v[0] == v[1]:
                raise ValueError("one score step, or two different ones combined by `op`")
        return v

    def sources(self) -> list[str]:
        """The score steps whose stored values this step reads (none: it scores)."""
        v = self.values_from
        return [] if v is None else [v] if isinstance(v, str) else list(v)

    _name = field_validator("name")(_name)
    _out = field_validator("out")(_inside)

    @field_validator("scorer")
    @classmethod
    def _known(cls, v):
        from entroweight.scorers import ScorerError, get_scorer_class

        if v is None:
            return v
        try:
            get_scorer_class(v)
        except ScorerError as e:
            raise ValueError(str(e)) from None
        return v

    @field_validator("options")
    @classmethod
    def _opts(cls, v):
        if "checkpoint" in v:
            raise ValueError("set checkpoint_from: <models step> (or options.model for a HF model)")
        return v

    def option_problems(self, at: str) -> list[str]:
        """The scorer's Options model on these options (checkpoint_from standing in for the checkpoint it
        will give), one `path: message` line per problem; nothing is loaded."""
        from entroweight.scorers import OptionsError, check_options, get_scorer_class

        if self.scorer is None:
            return []
        options, problems = dict(self.options), []
        takes = get_scorer_class(self.scorer).Options.model_fields.get("checkpoint")
        if self.checkpoint_from is not None and takes is None:
            problems.append(f"{at}.checkpoint_from: the {self.scorer} scorer reads no checkpoint (drop it)")
        elif self.checkpoint_from is not None or (takes is not None and takes.is_required()):
            if self.checkpoint_from is None:
                problems.append(
                    f"{at}.checkpoint_from: the {self.scorer} scorer needs one of our checkpoints: "
                    "set checkpoint_from: <models step>"
                )
            options["checkpoint"] = f"<checkpoint of {self.checkpoint_from}>"
        try:
            check_options(self.scorer, options)
        except OptionsError as e:
            problems += e.lines(lambda key: f"{at}.options.{key}")
        return problems


class AgreementPair(_Strict):
    """One row of the agreement table: the least-squares line of score step `y`'s values on `x`'s over
    the tokens both scored (the write-up's "y vs x"), and the write-up's row it reproduces, if any."""

    y: str
    x: str
    writeup: Literal[tuple(WRITEUP)] | None = None  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _two(self):
        if self.x == self.y:
            raise ValueError(f"x and y are both {self.x!r}: compare two score steps")
        return self


class AgreementSpec(_Strict):
    """The write-up's estimator-agreement table on this run's scores: slope, intercept and R² of each
    pair (transforms/agreement.py, as `entroweight compare`), written to `out` for the report."""

    pairs: list[AgreementPair] = Field(min_length=1)
    column: Literal["entropy", "weight"] = "entropy"
    out: str = "agreement.json"

    _out = field_validator("out")(_inside)

    @field_validator("pairs")
    @classmethod
    def _once(cls, v):
        twice = repeated(f"{p.y} vs {p.x}" for p in v)
        if twice:
            raise ValueError(f"the pair {', '.join(twice)} is given more than once")
        return v


class SynthesizeSpec(_Strict):
    """A corpus of known entropy (pipelines/synthesize.py): `sequences` rows drawn from a teacher, a
    `models` step trained on the tokens (`teacher`, a llama) or an HF causal LM (`model`), their values
    the exact entropy; and `heldout` rows more, drawn at `heldout_seed`, that no model trains on (the
    `excess:` evaluation reads them). Its data name is `synthetic`."""

    teacher: str | None = None
    model: str | None = None
    sequences: int = Field(ge=1)
    heldout: int = Field(0, ge=0)
    n_ctx: int | None = None  # default tokenize.n_ctx
    temperature: float = Field(1.0, gt=0)
    seed: Seed = 0
    heldout_seed: Seed = 1
    shard_docs: int = Field(256, ge=1)
    weighting: WeighOptions = Field(default_factory=WeighOptions)  # the oracle weights of `synthetic`
    device: DeviceName = "cpu"
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    batch_size: int = Field(64, ge=1)
    out: str = SYNTHETIC
    heldout_out: str = f"{SYNTHETIC}-heldout"

    _out = field_validator("out", "heldout_out")(_inside)
    _n_ctx = field_validator("n_ctx")(lambda v: v if v is None else check_n_ctx(v, "n_ctx"))

    @model_validator(mode="after")
    def _one(self):
        if (self.teacher is None) == (self.model is None):
            raise ValueError(
                "give exactly one teacher: `teacher` (a models step) or `model` (an HF causal LM)"
            )
        if self.heldout and self.heldout_seed == self.seed:
            raise ValueError("heldout_seed equals seed: the held-out rows would be the training rows")
        return self


class TruthSpec(_Strict):
    """The estimator benchmark: each score step's values on the synthetic corpus against the truth
    (its entropy and its surprisal): Pearson, Spearman and R², with intervals by a bootstrap over rows
    (transforms/agreement.py `truth_table`)."""

    scores: list[str] = Field(min_length=1)
    resamples: int = Field(1000, ge=10)
    seed: Seed = 0
    out: str = "truth.json"

    _out = field_validator("out")(_inside)

    @field_validator("scores")
    @classmethod
    def _once(cls, v):
        if twice := repeated(v):
            raise ValueError(f"{', '.join(twice)} is given more than once")
        return v


class ExcessSpec(_Strict):
    """The training benchmark's measure: every train run at every seed on the held-out synthetic rows,
    the exact per-token KL(teacher || student) and CE − H (scorers/teacher.py `excess`)."""

    batch_size: int = Field(32, ge=1)
    device: DeviceName = "cpu"
    out: str = "excess"

    _out = field_validator("out")(_inside)


class ExperimentRun(LossSettings):
    """One run of the experiment: its data and its loss (trainers/config.py's LossSettings)."""

    name: str
    data: str = TOKENS  # `tokens` or a score step's name
    # what the run is for, shown beside it in the report: a control (what a difference would mean
    # without the entropy signal) or an extension beyond the write-up; none: a run of the comparison
    role: Literal["control", "extension"] | None = None

    _name = field_validator("name")(_name)


class TrainSpec(TrainSettings):
    """The experiment: one model config, each run trained once per seed."""

    kind: str = "llama"
    model_config_file: str | None = Field(None, alias="model_config")
    config: dict[str, Any] = Field(default_factory=dict)
    seeds: list[Seed] = Field(default_factory=lambda: [0], min_length=1)
    runs: list[ExperimentRun] = Field(min_length=1)
    reference: str | None = None  # the run the others are compared to (default: the first `ce` run)
    out: str = "train"

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    _out = field_validator("out")(_inside)
    _model_config_file = field_validator("model_config_file")(_local)
    _kind = field_validator("kind")(_model_kind)
    _config = field_validator("config")(_model_fields)


class HoldoutSpec(_Strict):
    """The last `docs` documents of the sources are set aside before anything trains on them (the
    tokenizer included): an evaluation text from the training distribution that no model has seen."""

    docs: int = Field(100, ge=1)
    max_bytes: int | None = Field(None, ge=1)  # of the held-out text evaluated
    out: str = "holdout"

    _out = field_validator("out")(_inside)


class EvalSpec(_Strict):
    text: str | None = None  # default: the bundled WikiText-2 test set
    max_bytes: int | None = Field(None, ge=1)
    n_ctx: int | None = Field(None, ge=2)
    stride: int | None = Field(None, ge=1)
    batch_size: int = Field(16, ge=1)
    device: DeviceName = "auto"
    out: str = "eval"

    _out = field_validator("out")(_inside)

    @field_validator("text")
    @classmethod
    def _plain(cls, v: str | None) -> str | None:
        from entroweight.transforms.sources import not_plain_text

        if v is not None and (problem := not_plain_text(v)):
            raise ValueError(problem)
        return v


class AccuracySpec(_Strict):
    """Downstream accuracy through lm-eval: every run and seed on `tasks`; the offline task
    (`entroweight_heldout`) is built from the held-out documents (transforms/choice_items.py)."""

    tasks: list[str] = Field(default_factory=lambda: [OFFLINE_TASK], min_length=1)
    items: int | None = Field(None, ge=1)  # of the offline task, drawn from every cut point (None: all)
    prefix_tokens: int = Field(48, ge=1)
    continuation_tokens: int = Field(16, ge=1)
    choices: int = Field(4, ge=2)
    stride: int | None = Field(None, ge=1)  # least tokens between two cuts (None: prefix + continuation)
    seed: Seed = 0  # which cut points, which distractors, where the true one stands
    num_fewshot: int | None = Field(None, ge=0)  # lm-eval's tasks (None: each task's own default)
    limit: int | None = Field(None, ge=1)  # items per lm-eval task (a quick look, not a result)
    batch_size: int = Field(32, ge=1)
    device: DeviceName = "auto"
    # The endpoint that decides the accuracy comparisons, named before the runs: `margin` (each item's
    # log-likelihood margin of the true continuation over its distractors': more signal per item than
    # 0/1 at small scale) or an lm-eval metric (acc_mutual_info, acc, ...). A task without it is
    # decided on acc_mutual_info, else acc (said in the report).
    decides: str = "margin"
    out: str = "accuracy"

    _out = field_validator("out")(_inside)

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v):
        if repeated(v):
            raise ValueError("tasks repeat")
        return v

    @model_validator(mode="after")
    def _decides_what_the_offline_task_has(self):
        """A misspelt endpoint would decide on another one without a word: the offline task's are known."""
        if self.tasks == [OFFLINE_TASK] and self.decides not in OFFLINE_ENDPOINTS:
            raise ValueError(f"decides: {self.decides!r} is not one of {', '.join(OFFLINE_ENDPOINTS)}")
        return self


# what the offline task's answers hold (trainers/accuracy.py summarize): the endpoints `decides` may name
OFFLINE_ENDPOINTS = ("margin", "acc_mutual_info", "acc", "acc_norm")

PRIMARY = "weighted-occlusion"  # the write-up's weighting: the comparison named before any run


class ReportSpec(_Strict):
    out: str = REPORT_FILE
    # The one comparison with the reference read without correction (workflows/report/stats.py); the
    # others are Holm-corrected. Given: it must name a run. Left out: weighted-occlusion where the
    # workflow has that run, else none (every comparison corrected; Workflow._resolve_primary).
    primary: str | None = PRIMARY
    # Runs compared with each other, not with the reference: [run, other] (a weighted run and its own
    # control), Δ = run − other, Holm-corrected over the contrasts of a table. Named before the runs.
    contrasts: list[tuple[str, str]] = Field(default_factory=list)
    samples: int = Field(3, ge=0, le=50)  # sample texts highlighted per scorer
    max_tokens: int = Field(2_000_000, ge=1000)  # tokens read per scorer for the histograms

    @field_validator("out")
    @classmethod
    def _o(cls, v):
        if not is_report_name(v):  # one HTML file, never one of the run's records
            raise ValueError(f"the report is one HTML file: name a file ending in {REPORT_SUFFIX}, not {v!r}")
        return _inside(v)


class Workflow(_Strict):
    run_dir: str
    sources: list[str] = Field(min_length=1)
    tokenizer: TokenizerSpec
    tokenize: TokenizeSpec = Field(default_factory=TokenizeSpec)
    holdout: HoldoutSpec | None = None
    models: list[ModelSpec] = Field(default_factory=list)
    synthesize: SynthesizeSpec | None = None
    scores: list[ScoreSpec] = Field(default_factory=list)
    agreement: AgreementSpec | None = None
    truth: TruthSpec | None = None
    excess: ExcessSpec | None = None
    train: TrainSpec | None = None
    eval: EvalSpec | None = None
    accuracy: AccuracySpec | None = None
    report: ReportSpec | None = Field(default_factory=ReportSpec)

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, v):
        if storage.blank(v):
            raise ValueError("is empty: name the directory the run writes")
        return _local(v)

    @field_validator("sources")
    @classmethod
    def _sources(cls, v):
        if any(storage.blank(s) for s in v):
            raise ValueError("a source is empty: name files, directories, globs or hf: ids")
        for source in v:
            if why := storage.url_slip(source):
                raise ValueError(why)
        return v

    @model_validator(mode="after")
    def _references(self):
        def unique(items, what):
            seen = set()
            for i, it in enumerate(items):
                if it.name in seen:
                    raise _At(f"{what}[{i}].name", f"duplicate name {it.name!r}")
                seen.add(it.name)
            return seen

        model_names = unique(self.models, "models")
        score_names = unique(self.scores, "scores")
        for data in DATA:
            if data in score_names:
                raise _At("scores", f"{data!r} names a dataset; give the score step another name")
        self._synthetic(model_names)
        problems: list[str] = []  # every score step's option problems at once
        for i, s in enumerate(self.scores):
            if s.checkpoint_from is not None and s.checkpoint_from not in model_names:
                raise _At(
                    f"scores[{i}].checkpoint_from",
                    f"{s.checkpoint_from!r} is not a models step ({', '.join(sorted(model_names)) or 'none'})",
                )
            problems += s.option_problems(f"scores[{i}]")
            if s.checkpoint_from is not None and s.scorer is not None:  # before the model trains
                from entroweight.scorers import get_scorer_class

                kind = next(m.kind for m in self.models if m.name == s.checkpoint_from)
                if problem := get_scorer_class(s.scorer).kind_problem(kind):
                    problems.append(f"scores[{i}].checkpoint_from: {s.checkpoint_from!r} is {problem}")
            q = s.weighting.quantiles_from
            if q is not None and q not in {x.name for x in self.scores[:i]}:
                raise _At(f"scores[{i}].weighting.quantiles_from", f"{q!r} is not an earlier score step")
            if q is not None:  # the same unit check as the run's (and the CLI's), from the spec alone
                from .quantiles import check_units

                try:
                    check_units(step_unit(self.scores, q), step_unit(self.scores, s.name), "step", q)
                except ValueError as e:
                    raise _At(f"scores[{i}].weighting.quantiles_from", str(e)) from None
            v = s.values_from
            if (v is None) == (s.scorer is None):
                raise _At(f"scores[{i}]", "give either scorer (score the tokens) or values_from (weigh anew)")
            if v is not None and (
                s.checkpoint_from or s.options or s.limit_shards or s.limit_rows or s.data != TOKENS
            ):
                raise _At(
                    f"scores[{i}].values_from",
                    "weighs stored values: checkpoint_from, options, data and limit_shards/limit_rows "
                    "belong to its scorer's step",
                )
            earlier = {x.name for x in self.scores[:i]}
            for src in s.sources():
                if src not in earlier:
                    raise _At(f"scores[{i}].values_from", f"{src!r} is not an earlier score step")
            if len(s.sources()) == 2 and s.op is None:
                raise _At(
                    f"scores[{i}].op", f"two score steps need an op to combine them ({', '.join(VALUE_OPS)})"
                )
            if s.op is not None and len(s.sources()) != 2:
                raise _At(f"scores[{i}].op", "combines two score steps: give values_from: [A, B]")
            if s.op is not None:
                self._combinable(i, s)
                for src in s.sources():
                    if _aggregate(scored_step(self.scores, src)) == "mean":
                        raise _At(
                            f"scores[{i}].values_from",
                            f"{src!r} maps its model's losses with aggregate: mean (each small token gets "
                            f"its model token's whole loss): the {s.op} needs losses that add up to the "
                            "model's nats; score it with aggregate: sum",
                        )
            if s.weighting.method == "raw":  # the same check as the commands', from the spec alone
                from .quantiles import check_raw

                try:
                    check_raw("raw", step_unit(self.scores, s.name), "method: raw")
                except ValueError as e:
                    raise _At(f"scores[{i}].weighting.method", str(e)) from None
        if problems:
            raise _At(None, "\n".join(problems))
        for i, pair in enumerate(self.agreement.pairs if self.agreement else ()):
            for side in ("y", "x"):
                if getattr(pair, side) not in score_names:
                    raise _At(
                        f"agreement.pairs[{i}].{side}",
                        f"{getattr(pair, side)!r} is not a score step ({', '.join(sorted(score_names)) or 'none'})",
                    )
        if self.train is not None:
            unique(self.train.runs, "train.runs")
            for i, r in enumerate(self.train.runs):
                if r.data not in DATA and r.data not in score_names:
                    raise _At(
                        f"train.runs[{i}].data",
                        f"{r.data!r} is neither {TOKENS!r}, {SYNTHETIC!r} nor a score step "
                        f"({', '.join(sorted(score_names))})",
                    )
                if r.data == SYNTHETIC and self.synthesize is None:
                    raise _At(f"train.runs[{i}].data", "no synthesize section makes the synthetic corpus")
                if LOSSES[r.loss].columns and r.data == TOKENS:
                    column = " and ".join(LOSSES[r.loss].columns)
                    raise _At(
                        f"train.runs[{i}].loss",
                        f"{r.loss} needs weights (the {column} column): data must be a score step",
                    )
                step = next((x for x in self.scores if x.name == r.data), None)
                if (
                    step is not None
                    and step.weighting.shuffle is not None
                    and "entropy" in LOSSES[r.loss].columns
                ):
                    raise _At(
                        f"train.runs[{i}].loss",
                        f"{r.data!r} shuffles the weights only; {r.loss} reads the entropy column, which is "
                        "not shuffled: the control would train on the real values",
                    )
                scorer = sample_step(self.scores, r.data)
                if scorer is not None:
                    raise _At(
                        f"train.runs[{i}].data",
                        f"{r.data!r} holds a sample of the tokens ({scorer.name!r}: limit_shards "
                        f"{scorer.limit_shards}, limit_rows {scorer.limit_rows}): a run on it would train on "
                        "those rows alone, beside runs on every token; drop the limits from that score step",
                    )
            names = [r.name for r in self.train.runs]
            if self.train.reference is not None and self.train.reference not in names:
                raise _At("train.reference", f"{self.train.reference!r} is not a run ({', '.join(names)})")
            if len(set(self.train.seeds)) != len(self.train.seeds):
                raise _At("train.seeds", "seeds repeat")
        self._values_kept()
        self._truth_and_excess(score_names)
        if self.report is not None:
            self._resolve_primary()
            self._check_contrasts()
        if self.eval is not None and self.train is None:
            raise _At("eval", "evaluation needs a train section (the models it evaluates)")
        if self.accuracy is not None:
            self._accuracy_fits()
        self._outputs_apart()
        return self

    def _synthetic(self, model_names: set[str]) -> None:
        """The synthetic corpus: made by a synthesize section from a teacher trained on the tokens; read
        only where that section is."""
        readers = [(f"models[{i}].data", m.data) for i, m in enumerate(self.models)]
        readers += [(f"scores[{i}].data", s.data) for i, s in enumerate(self.scores)]
        for where, data in readers:
            if data == SYNTHETIC and self.synthesize is None:
                raise _At(where, "no synthesize section makes the synthetic corpus")
        y = self.synthesize
        if y is None or y.teacher is None:
            return
        if y.teacher not in model_names:
            raise _At(
                "synthesize.teacher",
                f"{y.teacher!r} is not a models step ({', '.join(sorted(model_names)) or 'none'})",
            )
        m = next(m for m in self.models if m.name == y.teacher)
        if m.kind != "llama":
            raise _At("synthesize.teacher", f"{y.teacher!r} is a {m.kind}: the teacher samples from a llama")
        if m.data != TOKENS:
            raise _At("synthesize.teacher", f"{y.teacher!r} trains on the synthetic corpus it would draw")

    def _truth_and_excess(self, score_names: set[str]) -> None:
        if self.truth is not None:
            if self.synthesize is None:
                raise _At(
                    "truth", "compares scores with the synthetic corpus' truth: add a synthesize section"
                )
            for i, name in enumerate(self.truth.scores):
                if name not in score_names:
                    raise _At(
                        f"truth.scores[{i}]",
                        f"{name!r} is not a score step ({', '.join(sorted(score_names)) or 'none'})",
                    )
                if scored_step(self.scores, name).data != SYNTHETIC:
                    raise _At(
                        f"truth.scores[{i}]",
                        f"{name!r} does not score the synthetic corpus (data: synthetic)",
                    )
        if self.excess is not None:
            if self.synthesize is None or not self.synthesize.heldout:
                raise _At("excess", "reads held-out synthetic rows: give synthesize.heldout")
            if self.train is None:
                raise _At("excess", "evaluates the train runs: add a train section")

    def _accuracy_fits(self) -> None:
        a = self.accuracy
        if self.train is None:
            raise _At("accuracy", "accuracy needs a train section (the models it evaluates)")
        if OFFLINE_TASK in a.tasks:
            if self.holdout is None:
                raise _At(
                    "accuracy.tasks",
                    f"{OFFLINE_TASK} is built from the held-out documents: add a holdout section",
                )
            if self.holdout.docs < a.choices:
                raise _At(
                    "accuracy.choices",
                    f"each item's {a.choices} choices come from {a.choices} different held-out documents, "
                    f"but holdout.docs is {self.holdout.docs}",
                )
            width = a.prefix_tokens + a.continuation_tokens
            if width > self.tokenize.n_ctx:
                raise _At(
                    "accuracy.prefix_tokens",
                    f"prefix_tokens + continuation_tokens = {width} exceed tokenize.n_ctx "
                    f"{self.tokenize.n_ctx}, the context the models are trained on",
                )

    def _values_kept(self) -> None:
        """A score step written without its values (`with_entropy: false`) is read for them by none:
        a step that weighs them anew (values_from) or takes their quantiles, the agreement table, a
        run whose loss reads them. Refused from the spec, before any step rewrites its output."""
        dropped = {s.name for s in self.scores if not s.with_entropy}
        readers = [(f"scores[{i}].values_from", v) for i, s in enumerate(self.scores) for v in s.sources()]
        readers += [
            (f"scores[{i}].weighting.quantiles_from", s.weighting.quantiles_from)
            for i, s in enumerate(self.scores)
        ]
        for i, pair in enumerate(self.agreement.pairs if self.agreement else ()):
            readers += [(f"agreement.pairs[{i}].y", pair.y), (f"agreement.pairs[{i}].x", pair.x)]
        readers += [(f"truth.scores[{i}]", n) for i, n in enumerate(self.truth.scores if self.truth else ())]
        for i, r in enumerate(self.train.runs if self.train else ()):
            if "entropy" in LOSSES[r.loss].columns:
                readers.append((f"train.runs[{i}].data", r.data))
        for where, name in readers:
            if name in dropped:
                raise _At(
                    where,
                    f"{name!r} is written without its values (with_entropy: false), which this reads: "
                    f"keep them (with_entropy: true on {name!r})",
                )

    def _combinable(self, i: int, s: ScoreSpec) -> None:
        """What the run refuses of `op` over two steps, refused from the spec (so `--dry-run` does):
        values of two units, or of two different samples of rows."""
        from entroweight.transforms.derive import DeriveError, derived_unit

        a, b = s.sources()
        try:
            derived_unit(s.op, step_unit(self.scores, a), step_unit(self.scores, b))
        except DeriveError as e:
            raise _At(f"scores[{i}].values_from", str(e)) from None
        scored = {src: scored_step(self.scores, src) for src in (a, b)}  # both earlier steps: validated
        steps = {x.name: x for x in self.scores}
        rows = {src: (x.limit_shards, x.limit_rows, steps[src].min_mean_weight) for src, x in scored.items()}
        if rows[a] != rows[b]:
            raise _At(
                f"scores[{i}].values_from",
                f"{a!r} and {b!r} hold different rows (limit_shards, limit_rows, min_mean_weight: {rows[a]} "
                f"vs {rows[b]}): "
                f"the {s.op} needs the values of the same tokens",
            )

    def _resolve_primary(self) -> None:
        """report.primary given: a run compared with the reference, or refused. Left out: PRIMARY where
        the workflow has that run, else None, written back so run.json records the one in force."""
        names = [r.name for r in self.train.runs] if self.train is not None else []
        given = self.report.primary
        if "primary" not in self.report.model_fields_set:
            self.report.primary = given if given in names and given != self.reference_run() else None
            return
        if given is None:
            return
        if given not in names:
            raise _At(
                "report.primary", f"{given!r} is not a run of train.runs ({', '.join(names) or 'none'})"
            )
        if given == self.reference_run():
            raise _At("report.primary", f"{given!r} is the reference: name a run compared with it")

    def _check_contrasts(self) -> None:
        """report.contrasts: pairs of two different runs of train.runs, each pair once."""
        names = [r.name for r in self.train.runs] if self.train is not None else []
        for i, pair in enumerate(self.report.contrasts):
            where = f"report.contrasts[{i}]"
            for name in pair:
                if name not in names:
                    raise _At(where, f"{name!r} is not a run of train.runs ({', '.join(names) or 'none'})")
            if pair[0] == pair[1]:
                raise _At(where, f"compares {pair[0]!r} with itself: name two runs")
        if twice := repeated(f"{a} vs {b}" for a, b in self.report.contrasts):
            raise _At("report.contrasts", f"{', '.join(twice)} is given more than once")

    def step_outputs(self) -> list[tuple[str, PurePosixPath]]:
        """(field, path under run_dir) of every step's output, as the runner writes them."""
        outs = [] if self.tokenizer.path else [("tokenizer.out", self.tokenizer.out)]
        outs.append(("tokenize.out", self.tokenize.out))
        if self.holdout is not None:
            outs.append(("holdout.out", self.holdout.out))
        outs += [(f"models[{i}] (models/{m.name})", f"models/{m.name}") for i, m in enumerate(self.models)]
        if self.synthesize is not None:
            outs.append(("synthesize.out", self.synthesize.out))
            if self.synthesize.heldout:
                outs.append(("synthesize.heldout_out", self.synthesize.heldout_out))
        outs += [(f"scores[{i}].out", s.out or f"scores/{s.name}") for i, s in enumerate(self.scores)]
        sections = (
            ("agreement", self.agreement),
            ("truth", self.truth),
            ("excess", self.excess),
            ("train", self.train),
            ("eval", self.eval),
            ("accuracy", self.accuracy),
            ("report", self.report),
        )
        for name, section in sections:
            if section is not None:
                outs.append((f"{name}.out", section.out))
        return [(f, PurePosixPath(os.path.normpath(p))) for f, p in outs]

    def _outputs_apart(self) -> None:
        """The path rule between steps: no step's output is, holds or lies inside another's, nor is the
        run directory itself or its records (run.json, the lock): one would break the other."""
        outs = self.step_outputs()
        for field, p in outs:
            if str(p) == "." or p.parts[0] in ("run.json", ".lock"):  # a record, or a path below one
                raise _At(field, f"{str(p)!r} is the run directory or its record; name a directory inside it")
        for i, (fa, a) in enumerate(outs):
            for fb, b in outs[i + 1 :]:
                how = (
                    "is" if a == b else "lies inside" if b in a.parents else "holds" if a in b.parents else ""
                )
                if how:
                    raise _At(
                        fa,
                        f"{str(a)!r} {how} the output {str(b)!r} of {fb}: give each step its own directory",
                    )

    # -- where things go
    @property
    def root(self) -> Path:
        return Path(self.run_dir)

    def tokenizer_dir(self) -> Path:
        return Path(self.tokenizer.path) if self.tokenizer.path else self.root / self.tokenizer.out

    def tokens_dir(self) -> Path:
        return self.root / self.tokenize.out

    def model_dir(self, name: str) -> Path:
        return self.root / "models" / name

    def score_dir(self, name: str) -> Path:
        s = next(s for s in self.scores if s.name == name)
        return self.root / (s.out or f"scores/{name}")

    def synthetic_dir(self, heldout: bool = False) -> Path:
        y = self.synthesize
        return self.root / (y.heldout_out if heldout else y.out)

    def data_dir(self, data: str) -> Path:
        if data == SYNTHETIC:
            return self.synthetic_dir()
        return self.tokens_dir() if data == TOKENS else self.score_dir(data)

    def excess_file(self, run: str, seed: int) -> Path:
        return self.root / self.excess.out / run / f"seed-{seed}.json"

    def run_ckpt(self, run: str, seed: int) -> Path:
        return self.root / self.train.out / run / f"seed-{seed}"

    def eval_file(self, run: str, seed: int, text: str = "main") -> Path:
        """`main`: eval.text (WikiText-2 by default); `heldout`: the held-out source documents."""
        suffix = "" if text == "main" else f".{text}"
        return self.root / self.eval.out / run / f"seed-{seed}{suffix}.json"

    def accuracy_dir(self) -> Path:
        return self.root / self.accuracy.out

    def accuracy_items_dir(self) -> Path:
        """The offline task's items (a dot name: no run's directory can be it)."""
        return self.accuracy_dir() / ".items"

    def accuracy_file(self, run: str, seed: int) -> Path:
        """A run's lm-eval results at one seed, per-item answers included."""
        return self.accuracy_dir() / run / f"seed-{seed}.json"

    def eval_texts(self) -> list[str]:
        return ["main", "heldout"] if self.holdout is not None else ["main"]

    def holdout_dir(self) -> Path:
        return self.root / self.holdout.out

    def train_sources(self) -> list[str]:
        """What the tokenizer and the tokenized data are built from: the sources less the held-out docs."""
        if self.holdout is None:
            return list(self.sources)
        return [str(self.holdout_dir() / "train.jsonl.gz")]

    def reference_run(self) -> str | None:
        if self.train is None:
            return None
        if self.train.reference:
            return self.train.reference
        return next((r.name for r in self.train.runs if r.loss == "ce"), None)

    def primary_run(self) -> str | None:
        """The run whose comparison with the reference is primary (ReportSpec.primary); None: none."""
        return self.report.primary if self.report is not None else None


def scored_step(scores: list[ScoreSpec], name: str) -> ScoreSpec | None:
    """The step that made the values step `name` holds: itself, or the step its `values_from` chain
    of re-weighings starts at (a combination of two is its own); None for a name that is no step."""
    steps = {x.name: x for x in scores}
    step, seen = steps.get(name), set()
    while step is not None and isinstance(step.values_from, str) and step.name not in seen:
        seen.add(step.name)
        step = steps.get(step.values_from)
    return step


def step_unit(scores: list, name: str, _seen: frozenset = frozenset()) -> str | None:
    """The unit of the values a workflow's score step `name` writes, from the spec alone (its scorer
    and options, the step whose values it weighs anew, or the two it combines): what validation and
    `--dry-run` compare before any step has run; None when it cannot be told."""
    from entroweight.transforms.derive import DeriveError, derived_unit

    from .quantiles import scorer_unit

    step = scored_step(scores, name)
    if step is None or step.name in _seen:
        return None
    if step.scorer:
        return scorer_unit(step.scorer, dict(step.options))
    units = [step_unit(scores, src, _seen | {step.name}) for src in step.sources()]
    try:  # the unit the run records for a derived step (refusals of the pair are made elsewhere)
        return derived_unit(step.op, *units) if len(units) == 2 else None
    except DeriveError:
        return None


def sample_step(scores: list[ScoreSpec], name: str) -> ScoreSpec | None:
    """The score step whose limits (limit_shards, limit_rows) make the values step `name` holds a
    sample of the tokens, if one does: itself, the step it re-weighs, or one of two it combines."""
    step = scored_step(scores, name)
    if step is None or step.limit_shards or step.limit_rows:
        return step
    return next((x for src in step.sources() if (x := sample_step(scores, src)) is not None), None)


def _aggregate(step: ScoreSpec) -> str | None:
    """The `aggregate` option a score step's scorer will use (its default filled in), if it has one."""
    from entroweight.scorers import check_options

    if step.scorer is None:
        return None
    try:
        return getattr(check_options(step.scorer, dict(step.options)), "aggregate", None)
    except Exception:  # refused with the step's option problems
        return None


class _At(ValueError):
    """A cross-reference error raised from the top-level validator, carrying its key path."""

    def __init__(self, path: str | None, message: str):
        super().__init__(f"{path}: {message}" if path else message)


def format_errors(e: ValidationError) -> str:
    return "\n".join(
        refusal_lines(e, unknown="unknown key (check its spelling; docs/workflows.md lists the keys)")
    )


def parse_workflow(data: Any, origin: str = "workflow") -> Workflow:
    if not isinstance(data, dict):
        raise SpecError(f"{origin}: a workflow is a mapping (run_dir: ..., sources: [...], ...)")
    try:
        return Workflow.model_validate(data)
    except ValidationError as e:
        lines = format_errors(e)  # one problem on the refusal's line; several, one a line below it
        raise SpecError(f"{origin} is refused:{chr(10) if chr(10) in lines else ' '}{lines}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader (no tags that build objects) that refuses a key given twice in one mapping:
    PyYAML would keep the last silently, so a setting edited in one place and repeated lower down would
    quietly win or lose. Merge keys (`<<: *base`) still override as YAML defines."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (line {line}; first given on line {seen[key]}): "
                        "give each key once",
                        key_node.start_mark,
                    )
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: Path) -> Any:
    """A YAML file as the workflow files are read: safe tags only, no duplicate keys."""
    with open(path, encoding="utf-8") as f:  # a stream: errors name the file and line
        loader = _UniqueKeyLoader(f)  # what yaml.safe_load does, with our SafeLoader subclass
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()


def load_workflow(path: str | Path) -> Workflow:
    """Read and validate a workflow YAML file (safe loader only, duplicate keys refused)."""
    path = Path(path)
    try:
        data = load_yaml(path)
    except OSError as e:
        raise SpecError(f"cannot read {path}: {e}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path} is not valid YAML: {e}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path} is not a text file (UTF-8): a workflow is YAML") from None
    return parse_workflow(data, str(path))
