"""`entroweight score`: tokenized shards -> weighted shards (entropy + weight per token)."""

from __future__ import annotations

import click

from .common import (
    WEIGHTING,
    GeneratedOptions,
    Location,
    _click_type,
    _fail,
    document_step_options,
    engine_options,
    judge_stage_out,
    run_stage_cli,
    stage_options,
    take,
    weigh_config,
    weighting_options,
)

SCORER = "scorer_option_"  # the prefix of the scorer flags' parameter names
# scorer options that name one of our checkpoints: checked for existence as the flag is read
PATHS = {"checkpoint", "checkpoint_short"}


def scorer_flags() -> list[click.Option]:
    """--scorer, and one flag per option of the built-in scorers (the union of their Options models):
    each is an alias of `--option KEY=VALUE`, and the chosen scorer's model refuses one it does not take."""
    from entroweight.scorers.base import flag
    from entroweight.scorers.registry import BUILTIN, get_scorer_class

    takers: dict[str, list] = {}  # option -> (scorer, field) of each built-in that takes it
    for scorer in BUILTIN:
        for key, field in get_scorer_class(scorer).Options.model_fields.items():
            takers.setdefault(key, []).append((scorer, field))
    params = [
        click.Option(
            ["--scorer"],
            required=True,
            help=" | ".join(BUILTIN)
            + ", or a scorer registered under the `entroweight.scorers` entry points.",
        )
    ]
    for key, fields in takers.items():
        kw = _click_type(fields[0][1].annotation)
        if key in PATHS:
            kw["type"] = Location(exists=True)
        kw["default"] = False if kw.get("is_flag") else None  # not given: the scorer's own default
        params.append(click.Option([flag(key), SCORER + key], help=_help(fields, len(BUILTIN)), **kw))
    return params


def _help(fields: list, n_scorers: int) -> str:
    """A flag's help from each scorer's field: its description and default, and which scorers take it."""
    texts: dict[str, list[str]] = {}
    for scorer, f in fields:
        shown = f.default is not None and f.default is not False  # a flag's "off" says nothing
        default = " (required)" if f.is_required() else f" [default: {f.default}]" * shown
        texts.setdefault(f"{f.description}{default}", []).append(scorer)
    if len(texts) == 1:
        ((text, scorers),) = texts.items()
        return f"{text} Scorers: {'all' if len(scorers) == n_scorers else ', '.join(scorers)}."
    return " ".join(f"{', '.join(scorers)}: {text}" for text, scorers in texts.items())


def scorer_options(flags: dict, generic: tuple[str, ...]) -> tuple[dict, set[str]]:
    """The options the user gave (dedicated flags that were set, then each `--option KEY=VALUE`) and
    which keys came from dedicated flags. A key given twice is refused."""
    options = {k: v for k, v in flags.items() if v is not None and v is not False}
    dedicated = set(options)
    for item in generic:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            _fail(f"--option takes KEY=VALUE, not {item!r}")
        if key in options:
            given = "--" + key.replace("_", "-") if key in dedicated else f"--option {key}"
            _fail(f"--option {key}: already given as {given}")
        options[key] = value
    return options, dedicated


@click.command(cls=GeneratedOptions, generated=[scorer_flags, weighting_options, engine_options])
@click.argument("data_dir", type=Location(exists=True, file_okay=False))
@click.option(
    "--tokenizer",
    default=None,
    help="The data's tokenizer.json (needed by cross_tokenizer; checked against the data's sha256).",
)
@click.option(
    "--quantiles-from",
    default=None,
    type=Location(exists=True),
    help="--weighting quantile/topk: a scored directory whose entropy quantiles set the global scale.",
)
@click.option("--drop-entropy", is_flag=True, help="Do not store the raw `entropy` column.")
@click.option("--out", required=True, type=Location(file_okay=False))
@click.option(
    "--batch-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Token budget per forward pass (rows × width, rows sorted by length over the whole shard; "
    "packed rows: whole sequences as wide as the data's rows, at least one); instead of --batch-size. "
    "Speed and memory; values alike to float rounding (~1e-6: a row's sums run in another order).",
)
@click.option(
    "--cpus-per-worker",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="CPUs each worker asks the engine for (its reading, tokenizing and writing beside the model).",
)
@click.option(
    "--option",
    "generic_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Any option of the scorer (repeatable), e.g. --option dtype=fp32: those of your own scorer "
    "(docs/scoring.md lists the built-ins'). The scorer flags are aliases.",
)
@document_step_options
@stage_options
def score(
    data_dir,
    scorer,
    tokenizer,
    quantiles_from,
    drop_entropy,
    out,
    generic_options,
    batch_tokens,
    cpus_per_worker,
    **params,
):
    """Score every token of DATA_DIR's shards, weigh it, write weighted parquet shards to --out."""
    from entroweight.models.checkpoint import CheckpointError
    from entroweight.pipelines.score import ScoreStage, check_device
    from entroweight.pipelines.stage import StageError
    from entroweight.scorers import OptionsError, ScorerError, check_options
    from entroweight.scorers.base import flag
    from entroweight.scorers.hf import ModelLoadError
    from entroweight.transforms.select import document_steps
    from entroweight.transforms.tokenizer import TokenizerError
    from entroweight.transforms.weigh import GLOBAL_SCALE

    options, dedicated = scorer_options(take(params, SCORER), generic_options)
    if batch_tokens is not None and options.get("batch_size") is not None:  # one of them sizes a forward
        _fail("--batch-tokens sizes each forward instead of --batch-size: give one of them")
    reads = [("--tokenizer", tokenizer), ("--quantiles-from", quantiles_from)] + [
        (flag(k), v) for k, v in options.items() if _names_a_location(v)
    ]
    judged = judge_stage_out(out, [("DATA_DIR", data_dir), *reads], "score", params)
    try:
        # every refusal that needs no model comes first: nothing is loaded, nothing written
        validated = check_options(scorer, options)
    except OptionsError as e:
        _fail(e.render(lambda k: flag(k) if k in dedicated else f"--option {k}", flag))
    except ScorerError as e:
        _fail(str(e))
    method = params[WEIGHTING + "method"]
    if method in GLOBAL_SCALE and not quantiles_from:
        _fail(f"--weighting {method} needs --quantiles-from SCORED_DIR (a run scored with minmax)")
    from ..quantiles import scorer_unit

    weigh = weigh_config(params, quantiles_from, scorer_unit(scorer, options))
    try:
        if params["engine"] == "local":  # the workers are this process: a missing GPU is known now
            check_device(validated.device)
        stage = ScoreStage(
            data_dir,
            scorer,
            options,
            weigh,
            not drop_entropy,
            tokenizer,
            batch_tokens,
            cpus_per_worker,
            steps=document_steps(params.pop("min_mean_weight", None)),
        )
        stage.row_progress = params["engine"] == "local"
    except (ScorerError, StageError, ModelLoadError, CheckpointError, TokenizerError, ValueError) as e:
        _fail(str(e))
    run_stage_cli(stage, out, judged, **params)


def _names_a_location(value) -> bool:
    """Whether a scorer option's value names a file or directory it reads (a checkpoint, a model)."""
    import os

    from entroweight import storage

    return isinstance(value, str) and (storage.is_url(value) or os.path.exists(value))


COMMANDS = [score]
