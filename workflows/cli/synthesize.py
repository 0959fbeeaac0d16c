"""`entroweight synthesize`: a corpus of known entropy, drawn from a teacher causal LM."""

from __future__ import annotations

import click

from .common import (
    COUNT,
    DEVICE,
    SEED,
    Finite,
    GeneratedOptions,
    Location,
    _fail,
    engine_options,
    judge_stage_out,
    run_stage_cli,
    stage_options,
    weigh_config,
    weighting_options,
)


@click.command("synthesize", cls=GeneratedOptions, generated=[weighting_options, engine_options])
@click.option(
    "--checkpoint",
    default=None,
    type=Location(exists=True, file_okay=False),
    help="The teacher: one of our llama checkpoints (`entroweight train`).",
)
@click.option(
    "--model", default=None, help="The teacher: a Hugging Face causal LM (hub id, directory, or .gguf file)."
)
@click.option("--out", required=True, type=Location(file_okay=False))
@click.option(
    "--sequences", required=True, type=COUNT, help="How many sequences to draw (one row, one document each)."
)
@click.option(
    "--n-ctx",
    required=True,
    type=COUNT,
    help="Row width: one pad, the prefix, then n_ctx - 1 - prefix tokens drawn.",
)
@click.option(
    "--temperature",
    default=1.0,
    show_default=True,
    type=Finite(min=0, min_open=True),
    help="Sampling temperature: the values are the entropy of softmax(logits / temperature).",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=SEED,
    help="The run's seed; sequence i draws from (seed, i) alone.",
)
@click.option("--shard-docs", default=256, show_default=True, type=COUNT, help="Sequences per shard.")
@click.option(
    "--prefix-from",
    default=None,
    type=Location(exists=True),
    help="A tokenized directory (the teacher's tokenizer) whose documents the sequences continue, sequence i document i; their tokens are excluded.",
)
@click.option(
    "--prefix-tokens",
    default=None,
    type=COUNT,
    help="How many of each document's first tokens the sequence continues (with --prefix-from).",
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    type=DEVICE,
    help="Where the teacher runs (cpu, cuda, auto).",
)
@click.option(
    "--dtype",
    default="fp32",
    show_default=True,
    type=click.Choice(["fp32", "bf16", "fp16"]),
    help="The teacher's compute dtype.",
)
@click.option(
    "--batch-size",
    default=64,
    show_default=True,
    type=COUNT,
    help="Sequences drawn together (speed, not values).",
)
@click.option("--allow-pickle", is_flag=True, help="Load a teacher's pickle weights (they can run code).")
@click.option("--trust-remote-code", is_flag=True, help="Run an HF teacher's own modelling code.")
@stage_options
def synthesize_cmd(
    checkpoint,
    model,
    out,
    sequences,
    n_ctx,
    temperature,
    seed,
    shard_docs,
    prefix_from,
    prefix_tokens,
    device,
    dtype,
    batch_size,
    allow_pickle,
    trust_remote_code,
    **params,
):
    """Draw --sequences rows from a teacher into --out, each token scored with the exact entropy of
    the distribution it was drawn from (and its surprisal): `weigh` gives oracle weights, `compare`
    any estimator's agreement with the truth."""
    from entroweight.options import device_here
    from entroweight.pipelines.stage import StageError
    from entroweight.pipelines.synthesize import SynthesizeStage

    reads = [(f, p) for f, p in (("--checkpoint", checkpoint), ("--prefix-from", prefix_from)) if p]
    judged = judge_stage_out(out, reads, "synthesize", params)
    config = weigh_config(params, None, "nats")
    try:
        stage = SynthesizeStage(
            sequences,
            n_ctx,
            checkpoint=checkpoint,
            model=model,
            temperature=temperature,
            seed=seed,
            shard_docs=shard_docs,
            prefix_from=prefix_from,
            prefix_tokens=prefix_tokens or 0,
            weighting=config,
            device=str(device_here(device)),
            dtype=dtype,
            batch_size=batch_size,
            allow_pickle=allow_pickle,
            trust_remote_code=trust_remote_code,
        )
    except (StageError, ValueError) as e:
        _fail(str(e))
    run_stage_cli(stage, out, judged, **params)


COMMANDS = [synthesize_cmd]
