"""What every command module shares: exit codes, error printing, engine options, running a stage.

Exit codes (for cron and orchestrators): 0 done (or nothing to do), 1 some shards failed (completed
shards stay valid; rerun to retry), 2 bad usage or input refused before any work, 3 another run holds
the lock on the output directory.
"""

from __future__ import annotations

import sys

import click

EXIT_FAILED_SHARDS = 1
EXIT_REFUSED = 2
EXIT_LOCKED = 3


def _fail(message: str, code: int = EXIT_REFUSED):
    click.secho(f"error: {message}", fg="red", err=True)
    sys.exit(code)


class Location(click.ParamType):
    """A local path (checked as click.Path checks it) or a URL (s3://, gs://, hf://, memory://) reached
    through entroweight.storage; `exists=True` checks that the object or prefix is there."""

    name = "path"

    def __init__(self, exists: bool = False, file_okay: bool = True, dir_okay: bool = True):
        self.exists = exists
        self.local = click.Path(exists=exists, file_okay=file_okay, dir_okay=dir_okay)

    def convert(self, value, param, ctx):
        from entroweight import storage

        if not storage.is_url(value):
            return self.local.convert(value, param, ctx)
        if self.exists:
            try:
                found = storage.path(value).exists()
            except Exception as e:  # no driver, no credentials, no bucket: say which
                self.fail(f"cannot reach {value}: {type(e).__name__}: {e}", param, ctx)
            if not found:
                self.fail(f"{value} does not exist.", param, ctx)
        return value


def config_options(model, skip=(), **overrides):
    """One click option per field of a pydantic `model` (its name, type, choices, help and default),
    so that a command's flags are derived from the config it fills in; the model's own fields come
    first, then those it inherits. `given_options` tells what the user typed from the defaults.
    `overrides`: extra click arguments per field (a param type, required=True); fields marked
    `json_schema_extra={"cli": False}` and those in `skip` get no option."""
    own = [n for n in model.model_fields if n in model.__annotations__]
    names = own + [n for n in model.model_fields if n not in own]

    def decorate(f):
        for name in reversed(names):
            field = model.model_fields[name]
            if name in skip or (field.json_schema_extra or {}).get("cli") is False:
                continue
            kind = _cli_type(field.annotation)
            kw = {"help": field.description}
            if kind is bool:
                kw["is_flag"] = True
            else:
                kw["type"] = click.Choice(kind) if isinstance(kind, tuple) else kind
                if not field.is_required() and field.default is not None:
                    kw |= {"default": field.default, "show_default": True}
            kw.update(overrides.get(name, {}))
            f = click.option(f"--{(field.alias or name).replace('_', '-')}", name, **kw)(f)
        return f

    return decorate


def _cli_type(annotation):
    """The click type of a field's annotation: bool, int, float, str, or a Literal's choices (a tuple);
    `X | None` is X."""
    import types
    import typing

    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return annotation if annotation in (bool, int, float) else str


def given_options(ctx: click.Context, values: dict) -> dict:
    """The options the user gave on the command line (or through the environment), not defaults."""
    from click.core import ParameterSource

    return {k: v for k, v in values.items() if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT}


def engine_options(f):
    """--engine and the options each engine takes; shared by every stage command."""
    f = click.option(
        "--engine", type=click.Choice(["local", "beam", "ray"]), default="local", show_default=True
    )(f)
    f = click.option(
        "--beam-option",
        "beam_options",
        multiple=True,
        metavar="KEY=VALUE",
        help="Beam pipeline option, e.g. runner=DataflowRunner (repeatable). Default: in-process FnApiRunner.",
    )(f)
    f = click.option(
        "--ray-address", default=None, help="Ray cluster address (default: a local Ray in process)."
    )(f)
    f = click.option(
        "--ray-wait-nodes",
        type=float,
        default=0,
        metavar="SECONDS",
        help="Ray: wait up to this long for nodes with what a worker needs (GPU nodes still starting) "
        "before refusing; the pool also grows as nodes join.",
    )(f)
    f = click.option(
        "--workers",
        type=int,
        default=None,
        help="Parallel workers (beam: direct_num_workers; ray: concurrency).",
    )(f)
    f = click.option(
        "--overwrite", is_flag=True, help="Delete shards of another config in --out instead of refusing."
    )(f)
    f = click.option(
        "--wait", type=float, default=0, help="Seconds to wait for another run's lock on --out."
    )(f)
    return f


def _engine_kwargs(engine, beam_options, ray_address, workers, ray_wait_nodes: float = 0) -> dict:
    if engine == "beam":
        return {"options": dict(_kv(o) for o in beam_options), "workers": workers}
    if engine == "ray":
        return {"address": ray_address, "workers": workers, "wait_nodes": ray_wait_nodes}
    return {}


def _kv(option: str) -> tuple[str, str]:
    if "=" not in option:
        _fail(f"--beam-option takes KEY=VALUE, not {option!r}")
    k, v = option.split("=", 1)
    return k.strip().lstrip("-"), v


def run_stage_cli(stage, out, engine, beam_options, ray_address, workers, overwrite, wait, ray_wait_nodes=0):
    from entroweight.pipelines import LockHeld, StageError, StageFailed, run_stage

    try:
        summary = run_stage(
            stage,
            out,
            engine=engine,
            overwrite=overwrite,
            wait=wait,
            **_engine_kwargs(engine, beam_options, ray_address, workers, ray_wait_nodes),
        )
    except LockHeld as e:
        _fail(str(e), EXIT_LOCKED)
    except StageError as e:
        _fail(str(e))
    except StageFailed as e:
        _fail(str(e), EXIT_FAILED_SHARDS)
    click.echo(summary.line())
    return summary
