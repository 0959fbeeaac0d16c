"""`entroweight weigh`: re-weigh a scored directory from its stored entropies, without re-scoring."""

from __future__ import annotations

import click

from .common import (
    WEIGHTING,
    GeneratedOptions,
    Location,
    _fail,
    document_step_options,
    engine_options,
    judge_stage_out,
    run_stage_cli,
    stage_options,
    weigh_config,
    weighting_options,
)


@click.command("weigh", cls=GeneratedOptions, generated=[weighting_options, engine_options])
@click.argument("scored_dir", type=Location(exists=True, file_okay=False))
@click.option("--out", required=True, type=Location(file_okay=False))
@click.option(
    "--quantiles-from",
    default=None,
    type=Location(exists=True),
    help="--weighting quantile/topk: a scored directory whose entropy quantiles set the global scale. "
    "Default: SCORED_DIR itself.",
)
@click.option("--drop-entropy", is_flag=True, help="Do not store the raw `entropy` column in --out.")
@document_step_options
@stage_options
def weigh_cmd(scored_dir, out, quantiles_from, drop_entropy, **params):
    """Re-weigh SCORED_DIR's stored entropies into --out (same rows, new weights); no model is run."""
    from entroweight.pipelines.stage import StageError
    from entroweight.pipelines.weigh import WeighStage
    from entroweight.transforms.select import document_steps
    from entroweight.transforms.weigh import GLOBAL_SCALE

    reads = [("--quantiles-from", quantiles_from)]
    judged = judge_stage_out(out, [("SCORED_DIR", scored_dir), *reads], "weigh", params)
    if params[WEIGHTING + "method"] in GLOBAL_SCALE:
        quantiles_from = quantiles_from or scored_dir
    from ..quantiles import values_unit

    config = weigh_config(params, quantiles_from, values_unit(scored_dir))
    try:
        stage = WeighStage(
            scored_dir,
            config,
            with_entropy=not drop_entropy,
            steps=document_steps(params.pop("min_mean_weight", None)),
        )
    except (StageError, ValueError) as e:
        _fail(str(e))
    run_stage_cli(stage, out, judged, **params)


COMMANDS = [weigh_cmd]
