"""`entroweight weigh`: re-weigh a scored directory from its stored entropies, without re-scoring."""

from __future__ import annotations

import click

from .cli_common import Location, _fail, engine_options, run_stage_cli


def _option(text: str) -> tuple[str, object]:
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        _fail(f"--option takes KEY=VALUE (a field of the weighting), not {text!r}")
    try:
        return key.strip().replace("-", "_"), yaml.safe_load(value)
    except yaml.YAMLError:
        _fail(f"--option {text}: the value is not a YAML scalar or list")


@click.command("weigh")
@click.argument("scored_dir", type=Location(exists=True, file_okay=False))
@click.option("--out", required=True, type=Location(file_okay=False))
@click.option(
    "--weighting",
    default="minmax",
    show_default=True,
    help="How entropies become weights: minmax | quantile | ... (any method of the weighting; docs/scoring.md).",
)
@click.option(
    "--quantiles-from",
    default=None,
    type=Location(exists=True),
    help="Weightings on one global scale (quantile, ...): the scored directory whose entropy quantiles "
    "set it. Default: SCORED_DIR itself.",
)
@click.option("--clip", nargs=2, type=float, default=None, help="Clip normalised entropy to [LO, HI].")
@click.option("--floor", type=float, default=None, help="Minimum weight of a real token (default 0).")
@click.option("--invert", is_flag=True, help="w = e instead of 1 - e (Rho-1: keep the high-excess tokens).")
@click.option(
    "--weight-dtype",
    type=click.Choice(["float16", "uint8"]),
    default=None,
    help="Storage of the weights (default: SCORED_DIR's).",
)
@click.option(
    "--option",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Any other field of the weighting, e.g. keep=0.6 (repeatable; values read as YAML scalars).",
)
@click.option("--drop-entropy", is_flag=True, help="Do not store the raw `entropy` column in --out.")
@engine_options
def weigh_cmd(
    scored_dir,
    out,
    weighting,
    quantiles_from,
    clip,
    floor,
    invert,
    weight_dtype,
    options,
    drop_entropy,
    **eng,
):
    """Re-weigh SCORED_DIR's stored entropies into --out (same rows, new weights); no model is run."""
    from entroweight.pipelines.stage import StageError
    from entroweight.pipelines.weigh import WeighStage
    from entroweight.schemas.datadir import DataDir

    named = {
        "method": weighting,
        "invert": invert or None,
        "floor": floor,
        "clip": tuple(clip) if clip else None,
    }
    fields = dict(_option(o) for o in options) | {k: v for k, v in named.items() if v is not None}
    try:
        if weight_dtype is None:  # keep the input's encoding, read from its stored type (schemas/weighted.py)
            weight_dtype = DataDir(scored_dir).weight_dtype or "float16"
        fields.setdefault("dtype", weight_dtype)
        config = _weigh_config(fields, scored_dir, quantiles_from)
        stage = WeighStage(scored_dir, config, with_entropy=not drop_entropy)
    except (StageError, ValueError) as e:
        _fail(str(e))
    run_stage_cli(stage, out, **eng)


def _weigh_config(fields: dict, scored_dir: str, quantiles_from: str | None):
    """The WeighConfig of these fields; reference quantiles are read only for a method that needs them
    (it refuses to be built without), from --quantiles-from or else the scored directory itself."""
    from pydantic import ValidationError

    from entroweight.transforms.weigh import WeighConfig, entropy_quantiles

    try:
        config = WeighConfig(**fields)
    except ValidationError as e:
        if "quantiles" in fields or "quantiles" not in str(e):
            raise ValueError(_one_line(e)) from None
        try:
            return WeighConfig(**fields, quantiles=entropy_quantiles(quantiles_from or scored_dir))
        except ValidationError as e2:
            raise ValueError(_one_line(e2)) from None
    if quantiles_from is not None:
        raise ValueError(
            f"--quantiles-from does not apply to --weighting {fields['method']}: it reads no quantiles"
        )
    return config


def _one_line(e) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'weighting'}: {err['msg']}" for err in e.errors())


COMMANDS = [weigh_cmd]
