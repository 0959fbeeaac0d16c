"""`entroweight score`: tokenized shards -> weighted shards (entropy + weight per token)."""

from __future__ import annotations

import click

from .cli_common import Location, _fail, engine_options, run_stage_cli

# the dedicated flags that are scorer options: aliases of `--option KEY=VALUE`, validated by the scorer
SCORER_FLAGS = (
    "model",
    "checkpoint",
    "dtype",
    "batch_size",
    "device",
    "aggregate",
    "context",
    "stride",
    "metric",
    "baseline",
    "checkpoint_short",
    "reference",
    "cross_tokenizer",
    "allow_pickle",
    "trust_remote_code",
)


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
            given = f"--{key.replace('_', '-')}" if key in dedicated else f"--option {key}"
            _fail(f"--option {key}: already given as {given}")
        options[key] = value
    return options, dedicated


@click.command()
@click.argument("data_dir", type=Location(exists=True, file_okay=False))
@click.option(
    "--scorer",
    required=True,
    help="causal_loss | cross_tokenizer | occlusion | decomposition | two_model | grad_input | excess_loss, "
    "or a scorer registered under the `entroweight.scorers` entry points.",
)
@click.option(
    "--model",
    default=None,
    help="HF causal LM: hub id (meta-llama/Llama-3.2-1B), directory, or .gguf file.",
)
@click.option("--checkpoint", default=None, type=Location(exists=True), help="One of our checkpoints.")
@click.option(
    "--tokenizer",
    default=None,
    help="The data's tokenizer.json (needed by cross_tokenizer; checked against the data's sha256).",
)
@click.option(
    "--aggregate",
    type=click.Choice(["mean", "sum"]),
    default=None,
    help="cross_tokenizer: model-token CE onto data tokens (default mean).",
)
@click.option(
    "--weighting",
    type=click.Choice(["minmax", "quantile", "raw", "topk"]),
    default="minmax",
    show_default=True,
    help="raw: w = 1 - value clipped to [0, 1] (the write-up's cosine weight); topk: w = 1 on the top "
    "--keep fraction of the dataset's tokens by value, 0 elsewhere (Rho-1).",
)
@click.option(
    "--quantiles-from",
    default=None,
    type=Location(exists=True),
    help="--weighting quantile/topk: a scored directory whose entropy quantiles set the global scale.",
)
@click.option("--keep", type=float, default=None, help="--weighting topk: the fraction of tokens kept (0.6).")
@click.option("--clip", nargs=2, type=float, default=None, help="Clip normalised entropy to [LO, HI].")
@click.option("--floor", type=float, default=0.0, show_default=True, help="Minimum weight of a real token.")
@click.option("--invert", is_flag=True, help="w = e instead of 1 - e (Rho-1: keep the high-excess tokens).")
@click.option("--weight-dtype", type=click.Choice(["float16", "uint8"]), default="float16", show_default=True)
@click.option("--drop-entropy", is_flag=True, help="Do not store the raw `entropy` column.")
@click.option("--out", required=True, type=Location(file_okay=False))
@click.option("--batch-size", type=int, default=None, help="Rows per forward pass (default: the scorer's).")
@click.option(
    "--batch-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Token budget per forward pass (rows × width, rows sorted by length over the whole shard); "
    "instead of --batch-size. Speed and memory, not values.",
)
@click.option(
    "--cpus-per-worker",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="CPUs each worker asks the engine for (its reading, tokenizing and writing beside the model).",
)
@click.option("--device", default=None, help="cpu | cuda | cuda:N (default cpu).")
@click.option(
    "--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None, help="Default: bf16 where native."
)
@click.option("--context", type=int, default=None, help="cross_tokenizer: model tokens per window (2048).")
@click.option("--stride", type=int, default=None, help="cross_tokenizer: new tokens per later window.")
@click.option(
    "--metric",
    type=click.Choice(["l1", "cosine"]),
    default=None,
    help="occlusion: L1 of the logit difference (min-max per row; default) or 1 - cosine.",
)
@click.option(
    "--baseline",
    type=click.Choice(["empty", "remove"]),
    default=None,
    help="occlusion: compare with an empty row's embedding in its place (default) or with it removed "
    "(the write-up's literal occlusion; see docs/scoring.md).",
)
@click.option(
    "--option",
    "generic_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Any option of the scorer (repeatable), e.g. --option dtype=fp32; docs/scoring.md lists each "
    "scorer's. The dedicated flags above are aliases.",
)
@click.option(
    "--checkpoint-short",
    default=None,
    type=Location(exists=True),
    help="two_model: the checkpoint of context N-1 (--checkpoint is the one of context N).",
)
@click.option(
    "--reference",
    default=None,
    help="excess_loss: the reference model (our checkpoint directory, or an HF id/directory/.gguf).",
)
@click.option(
    "--cross-tokenizer",
    "cross_tokenizer",
    is_flag=True,
    help="excess_loss: the --reference is an HF model on another tokenizer (byte-level transfer, sum).",
)
@click.option(
    "--allow-pickle",
    is_flag=True,
    help="Load .pt/.bin/.pth weights (torch.load weights_only=True) where no safetensors exist. "
    "Pickles can run code: only for files you trust.",
)
@click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Let an HF model repository run its own modelling code (off: only transformers' built-in models).",
)
@engine_options
def score(
    data_dir,
    scorer,
    tokenizer,
    weighting,
    quantiles_from,
    keep,
    clip,
    floor,
    invert,
    weight_dtype,
    drop_entropy,
    out,
    generic_options,
    batch_tokens,
    cpus_per_worker,
    **eng,
):
    """Score every token of DATA_DIR's shards, weigh it, write weighted parquet shards to --out."""
    from entroweight.models.checkpoint import CheckpointError
    from entroweight.pipelines.score import ScoreStage, check_device
    from entroweight.pipelines.stage import StageError
    from entroweight.scorers import OptionsError, ScorerError, check_options
    from entroweight.scorers.base import flag
    from entroweight.scorers.hf import ModelLoadError
    from entroweight.transforms.tokenizer import TokenizerError
    from entroweight.transforms.weigh import WeighConfig, entropy_quantiles

    # what remains in `eng` after the scorer's flags are taken out: the engine options
    options, dedicated = scorer_options({k: eng.pop(k) for k in SCORER_FLAGS}, generic_options)
    try:
        # every refusal that needs no model comes first: nothing is loaded, nothing written
        validated = check_options(scorer, options)
    except OptionsError as e:
        _fail(e.render(lambda k: flag(k) if k in dedicated else f"--option {k}", flag))
    except ScorerError as e:
        _fail(str(e))
    global_scale = weighting in ("quantile", "topk")  # the dataset's quantiles, not each row's range
    if quantiles_from and not global_scale:
        _fail("--quantiles-from applies to --weighting quantile or topk only: drop it or change --weighting")
    if global_scale and not quantiles_from:
        _fail(f"--weighting {weighting} needs --quantiles-from SCORED_DIR (a run scored with minmax)")
    if (keep is not None) != (weighting == "topk"):
        _fail("--keep (the fraction of tokens kept) goes with --weighting topk, and only with it")
    try:
        if eng["engine"] == "local":  # the workers are this process: a missing GPU is known now
            check_device(validated.device)
        quantiles = entropy_quantiles(quantiles_from) if quantiles_from else None
        weigh = WeighConfig(
            method=weighting,
            quantiles=quantiles,
            keep=keep,
            clip=tuple(clip) if clip else None,
            floor=floor,
            invert=invert,
            dtype=weight_dtype,
        )
        stage = ScoreStage(
            data_dir, scorer, options, weigh, not drop_entropy, tokenizer, batch_tokens, cpus_per_worker
        )
        stage.row_progress = eng["engine"] == "local"
    except (ScorerError, StageError, ModelLoadError, CheckpointError, TokenizerError, ValueError) as e:
        _fail(str(e))
    run_stage_cli(stage, out, **eng)


COMMANDS = [score]
