"""`entroweight score`: tokenized shards -> weighted shards (entropy + weight per token)."""

from __future__ import annotations

import click

from .cli_common import _fail, engine_options, run_stage_cli

# scorers that take no --aggregate (cross_tokenizer's regrouping)
ESTIMATOR_SCORERS = ("occlusion", "decomposition", "two_model", "grad_input", "excess_loss")


@click.command()
@click.argument("data_dir", type=click.Path(exists=True, file_okay=False))
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
@click.option("--checkpoint", default=None, type=click.Path(exists=True), help="One of our checkpoints.")
@click.option(
    "--tokenizer",
    default=None,
    help="The data's tokenizer.json (needed by cross_tokenizer; checked against the data's sha256).",
)
@click.option("--aggregate", type=click.Choice(["mean", "sum"]), default="mean", show_default=True)
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
    type=click.Path(exists=True),
    help="--weighting quantile/topk: a scored directory whose entropy quantiles set the global scale.",
)
@click.option("--keep", type=float, default=None, help="--weighting topk: the fraction of tokens kept (0.6).")
@click.option("--clip", nargs=2, type=float, default=None, help="Clip normalised entropy to [LO, HI].")
@click.option("--floor", type=float, default=0.0, show_default=True, help="Minimum weight of a real token.")
@click.option("--invert", is_flag=True, help="w = e instead of 1 - e (Rho-1: keep the high-excess tokens).")
@click.option("--weight-dtype", type=click.Choice(["float16", "uint8"]), default="float16", show_default=True)
@click.option("--drop-entropy", is_flag=True, help="Do not store the raw `entropy` column.")
@click.option("--out", required=True, type=click.Path(file_okay=False))
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda | cuda:N")
@click.option(
    "--dtype", type=click.Choice(["bf16", "fp32"]), default=None, help="Default: bf16 where native."
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
    "--checkpoint-short",
    default=None,
    type=click.Path(exists=True),
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
    model,
    checkpoint,
    tokenizer,
    aggregate,
    weighting,
    quantiles_from,
    keep,
    clip,
    floor,
    invert,
    weight_dtype,
    drop_entropy,
    out,
    batch_size,
    device,
    dtype,
    context,
    stride,
    metric,
    checkpoint_short,
    reference,
    cross_tokenizer,
    allow_pickle,
    trust_remote_code,
    **eng,
):
    """Score every token of DATA_DIR's shards, weigh it, write weighted parquet shards to --out."""
    from entroweight.models.checkpoint import CheckpointError
    from entroweight.pipelines.score import ScoreStage
    from entroweight.pipelines.stage import StageError
    from entroweight.scorers import ScorerError
    from entroweight.scorers.hf import ModelLoadError
    from entroweight.transforms.tokenizer import TokenizerError
    from entroweight.transforms.weigh import WeighConfig, entropy_quantiles

    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            _fail("--device cuda but no CUDA device is visible here; use --device cpu")
    options = {"model": model, "checkpoint": checkpoint, "dtype": dtype, "batch_size": batch_size}
    options |= {"device": device, "aggregate": aggregate, "context": context, "stride": stride}
    options |= {"metric": metric, "checkpoint_short": checkpoint_short, "reference": reference}
    options |= {"cross_tokenizer": cross_tokenizer or None}
    # the safety switches travel only when asked for: default scorer options stay as they were
    options |= {"allow_pickle": allow_pickle or None, "trust_remote_code": trust_remote_code or None}
    options = {k: v for k, v in options.items() if v is not None}
    if scorer in ("causal_loss", *ESTIMATOR_SCORERS):
        options.pop("aggregate")
    try:
        quantiles = None
        if weighting in ("quantile", "topk"):
            if not quantiles_from:
                _fail(f"--weighting {weighting} needs --quantiles-from SCORED_DIR (a run scored with minmax)")
            quantiles = entropy_quantiles(quantiles_from)
        weigh = WeighConfig(
            method=weighting,
            quantiles=quantiles,
            keep=keep,
            clip=tuple(clip) if clip else None,
            floor=floor,
            invert=invert,
            dtype=weight_dtype,
        )
        stage = ScoreStage(data_dir, scorer, options, weigh, not drop_entropy, tokenizer)
    except (ScorerError, StageError, ModelLoadError, CheckpointError, TokenizerError, ValueError) as e:
        _fail(str(e))
    run_stage_cli(stage, out, **eng)


COMMANDS = [score]
