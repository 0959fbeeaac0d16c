"""What every command module shares: exit codes, error printing, engine options, running a stage.

Exit codes (for cron and orchestrators): 0 done (or nothing to do), 1 some shards failed (completed
shards stay valid; rerun to retry), 2 bad usage or input refused before any work, 3 another run holds
the lock on the output directory.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading

import click

from entroweight.options import SEED_LIMIT

EXIT_FAILED_SHARDS = 1
EXIT_REFUSED = 2
EXIT_LOCKED = 3


def _fail(message: str, code: int = EXIT_REFUSED):
    click.secho(f"error: {message}", fg="red", err=True)
    sys.exit(code)


INTERRUPTED = 130  # a command stopped by Ctrl-C (SIGINT), as a shell reports it
TERMINATED = 143  # ... or by SIGTERM (a scheduler cancelling it, a node preempted), 128 + 15


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is: its `finally` blocks run as they do on Ctrl-C (temp files
    and staging copies removed, locks released), where Python's default handler stopped it dead."""


# the stopping signals a command received: one that a library swallowed where it arrived (pyarrow calls
# back into Python while it writes, and turns a KeyboardInterrupt there into a failed write) still
# stops the command as Ctrl-C or SIGTERM does, not as a failed shard (exit 1)
_received: list[int] = []


def _stop(signum, frame):
    _received.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


class Commands(click.Group):
    """The `entroweight` group. A value a flag's type refuses (a count of 0, a device that is not here,
    a path that does not exist) is a refusal like every other: one line, exit 2, where click printed
    its usage screen around it. A missing argument keeps the usage, which says what to give."""

    def invoke(self, ctx):
        # (a handler set by whoever runs the command is theirs, and an ignored SIGINT stays ignored: a
        # shell's background job; signals reach the main thread only)
        main = threading.current_thread() is threading.main_thread()
        defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
        caught = [s for s, d in defaults.items() if main and signal.getsignal(s) is d]
        for s in caught:
            signal.signal(s, _stop)
        _received.clear()
        try:
            try:
                return super().invoke(ctx)
            except (Exception, SystemExit) as e:
                if not _received or isinstance(e, click.exceptions.Exit):
                    raise
                # a stop swallowed below (and said as a failure): the command stops as it was asked
                raise Terminated() if signal.SIGTERM in _received else KeyboardInterrupt() from e
        except click.BadParameter as e:
            if isinstance(e, click.MissingParameter):
                raise
            _fail(e.format_message())
        except KeyboardInterrupt as e:  # Ctrl-C: the shell's 128 + SIGINT, where click said "Aborted!", 1
            how = "terminated" if isinstance(e, Terminated) else "interrupted"
            again = "with --resume" if ctx.invoked_subcommand == "train" else "as it was"
            click.echo(
                f"{how}: what was committed stays (finished shards, saved checkpoints); run the "
                f"command again {again} to go on",
                err=True,
            )
            ctx.exit(TERMINATED if isinstance(e, Terminated) else INTERRUPTED)
        except Exception as e:  # a store that cannot be reached from anywhere it is read: one line
            if (said := unreachable(e)) is None:
                raise
            _fail(said)
        finally:
            for s in caught:
                signal.signal(s, defaults[s])


# the clients of object stores (S3's botocore, GCS's google-auth, their aiohttp): an error of theirs
# that reaches the command is a store that cannot be reached (credentials, endpoint, bucket)
STORE_CLIENTS = ("botocore", "aiobotocore", "aiohttp", "google")


def unreachable(e: BaseException) -> str | None:
    """The one line a store's client error is said in ("cannot reach object storage: ..."), or a
    location refused by the storage layer (`StorageError`: its message says why, e.g. a URL with a
    slash missing, wherever a command meets it), or None for any other error. The cause chain is
    walked: a reader may have wrapped it."""
    from entroweight.storage import StorageError

    seen = e
    while seen is not None:
        if isinstance(seen, StorageError):
            return str(seen)
        if type(seen).__module__.split(".")[0] in STORE_CLIENTS:
            return (
                f"cannot reach object storage: {type(seen).__name__}: {' '.join(str(seen).split())} "
                "(credentials and endpoint come from the standard variables, e.g. AWS_ACCESS_KEY_ID, "
                "AWS_ENDPOINT_URL)"
            )
        seen = seen.__cause__ or seen.__context__
    return None


class Location(click.ParamType):
    """A local path (checked as click.Path checks it) or a URL (s3://, gs://, hf://, memory://) reached
    through entroweight.storage; `exists=True` checks that the object or prefix is there. A file://
    URL is its local path, as storage.path reads it, for every path a command takes. `local`: the
    command reads it from this machine only (a workflow file, a run directory): other URLs are refused."""

    name = "path"

    def __init__(
        self, exists: bool = False, file_okay: bool = True, dir_okay: bool = True, local: bool = False
    ):
        self.exists, self.local_only = exists, local
        self.local = click.Path(exists=exists, file_okay=file_okay, dir_okay=dir_okay)

    def convert(self, value, param, ctx):
        from entroweight import storage

        if str(value).startswith("file://"):
            value = str(storage.path(value))
        if why := storage.url_slip(value):
            self.fail(why, param, ctx)
        if not storage.is_url(value):
            meant = storage.as_meant(str(value))
            if self.exists and storage.has_glob_chars(meant) and not os.path.lexists(meant):
                self.fail(storage.glob_not_expanded(value), param, ctx)
            return self.local.convert(meant, param, ctx)
        if self.local_only:
            self.fail(f"{value} is a URL; give a path on this machine", param, ctx)
        if self.exists:
            try:
                found = storage.path(value).exists()
            except Exception as e:  # no driver, no credentials, no bucket: say which
                self.fail(f"cannot reach {value}: {type(e).__name__}: {e}", param, ctx)
            if not found:
                self.fail(f"{value} does not exist.", param, ctx)
        return value


# The rules of every number and device a command takes on its own (those of an options model, the
# trainer's, a scorer's, the weighting, are the model's: entroweight.options); a test runs each flag of
# the whole CLI against them (tests/test_option_rules.py).
COUNT = click.IntRange(min=1)  # how many of something: 0 or fewer would do nothing, or do it wrongly
SEED = click.IntRange(0, SEED_LIMIT - 1)  # what numpy and torch both take (entroweight.options.Seed)


class Finite(click.FloatRange):
    """A float that is a number: NaN passes every range's comparison and inf means no limit, neither
    of which a command means (a FloatRange alone took `--wait nan`)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


SECONDS = Finite(min=0)  # a wait


class Device(click.ParamType):
    """--device of a command that runs its work here: a torch device on this machine, or auto. Refused
    while the arguments are parsed, before anything is read or written (entroweight.options)."""

    name = "device"

    def convert(self, value, param, ctx):
        from entroweight.options import device_here

        try:
            device_here(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value


DEVICE = Device()


class GeneratedOptions(click.Command):
    """A command some of whose options are generated from models that import heavy libraries (the
    scorers torch, the engines pyarrow): `generated`, functions returning click Options, are called
    when the command parses its arguments or shows its help, not each time `entroweight` starts."""

    def __init__(self, *args, generated=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.generated = list(generated)

    def get_params(self, ctx):
        while self.generated:
            self.params += self.generated.pop(0)()
        return super().get_params(ctx)


def model_options(model, skip=(), flags=None, prefix="", **overrides) -> list[click.Option]:
    """One click option per field of a pydantic `model` (its name, type, choices, help and default),
    so that a command's flags are derived from the config it fills in; the model's own fields come
    first, then those it inherits. `given_options` tells what the user typed from the defaults.
    `flags`: a field's flag where it is not the field's name (`method` -> `--weighting`); `prefix`: of
    the parameter names, keeping the model's fields apart from the command's other parameters.
    `overrides`: extra click arguments per field (a param type, required=True); fields marked
    `json_schema_extra={"cli": False}` and those in `skip` get no option."""
    own = [n for n in model.model_fields if n in model.__annotations__]
    options = []
    for name in own + [n for n in model.model_fields if n not in own]:
        field = model.model_fields[name]
        if name in skip or (field.json_schema_extra or {}).get("cli") is False:
            continue
        flag = "--" + (flags or {}).get(name, (field.alias or name).replace("_", "-"))
        kw = {"help": field.description, **_click_type(field.annotation)}
        if kw.get("is_flag") and field.default is True:  # on unless turned off
            flag += f"/--no-{flag[2:]}"
        if not field.is_required() and field.default_factory is None:
            kw |= {
                "default": field.default,
                "show_default": field.default is not None and not kw.get("is_flag"),
            }
        kw.update(overrides.get(name, {}))
        options.append(click.Option([flag, prefix + name], **kw))
    return options


def config_options(model, skip=(), **overrides):
    """`model_options` as a decorator (for a model light enough to import when `entroweight` starts)."""

    def decorate(f):
        f.__click_params__ = (
            getattr(f, "__click_params__", []) + model_options(model, skip, **overrides)[::-1]
        )
        return f

    return decorate


def _click_type(annotation) -> dict:
    """The click arguments of a field's type: a flag for bool, a Literal's choices, two values for a
    pair, else int, float or str; `X | None` is X."""
    import types
    import typing

    from entroweight.options import bare

    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    annotation = bare(annotation)  # a Seed's flag is an int's
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is bool:
        return {"is_flag": True}
    if origin is typing.Literal:
        return {"type": click.Choice(args)}
    if origin is tuple and Ellipsis not in args:
        return {"type": args[0], "nargs": len(args)}
    return {"type": annotation if annotation in (int, float) else str}


def given_options(ctx: click.Context, values: dict) -> dict:
    """The options the user gave on the command line (or through the environment), not defaults."""
    from click.core import ParameterSource

    return {k: v for k, v in values.items() if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT}


# -- the weighting's flags (score and weigh): transforms/weigh.py's WeighOptions, two fields renamed
WEIGHTING_FLAGS = {"method": "weighting", "dtype": "weight-dtype"}
WEIGHTING = "weighting_"  # the prefix of their parameter names


def weighting_flag(field: str) -> str:
    return "--" + WEIGHTING_FLAGS.get(field, field.replace("_", "-"))


def weighting_options() -> list[click.Option]:
    from entroweight.transforms.weigh import WeighOptions

    return model_options(WeighOptions, flags=WEIGHTING_FLAGS, prefix=WEIGHTING)


def weigh_config(params: dict, quantiles_from: str | None, unit: str | None = None):
    """The WeighConfig of the weighting flags in `params` (taken out of it), with the reference
    quantiles of `quantiles_from` for a method on a global scale, which must be in `unit`, that of
    the values to weigh (workflows/quantiles.py: and `raw` takes no unbounded unit); a
    refusal names the flags."""
    from pydantic import ValidationError

    from entroweight.options import refusal_lines
    from entroweight.transforms.weigh import GLOBAL_SCALE, WeighConfig

    from ..quantiles import check_raw, reference_quantiles

    fields = take(params, WEIGHTING)
    if fields["clip"] is not None:
        fields["clip"] = tuple(fields["clip"])
    try:
        check_raw(fields["method"], unit)
    except ValueError as e:
        _fail(str(e))
    if quantiles_from and fields["method"] not in GLOBAL_SCALE:
        _fail(
            f"--quantiles-from applies to --weighting {' or '.join(GLOBAL_SCALE)} only, not "
            f"{fields['method']}: drop it or change --weighting"
        )
    try:
        quantiles = reference_quantiles(quantiles_from, unit) if quantiles_from else None
        return WeighConfig(**fields, quantiles=quantiles)
    except ValidationError as e:
        _fail("; ".join(refusal_lines(e, lambda loc: weighting_flag(loc[0]))))
    except ValueError as e:  # no entropies to read
        _fail(str(e))


def take(params: dict, prefix: str) -> dict:
    """The parameters named with `prefix`, taken out of `params`, under their own names."""
    return {k.removeprefix(prefix): params.pop(k) for k in [k for k in params if k.startswith(prefix)]}


# -- the engines' flags: each engine's OPTIONS (pipelines/<engine>.py); one flag two engines share is one
ENGINE = "engine_"  # the prefix of their parameter names


def engine_options() -> list[click.Option]:
    """--engine and the knobs of every engine."""
    from entroweight.pipelines import ENGINES, engine_module

    shared: dict[str, list] = {}  # flag -> (engine, keyword, EngineOption) of each engine taking it
    for engine in ENGINES:
        for key, option in engine_module(engine).OPTIONS.items():
            shared.setdefault(option.flag, []).append((engine, key, option))
    params = [
        click.Option(["--engine"], type=click.Choice(list(ENGINES)), default="local", show_default=True)
    ]
    for flag, takers in shared.items():
        _, key, option = takers[0]
        assert all((k, o.type) == (key, option.type) for _, k, o in takers), f"{flag}: engines disagree"
        text = option.help if len(takers) == 1 else " ".join(f"{e}: {o.help}" for e, _, o in takers)
        if option.type is dict:
            kw = {"multiple": True, "metavar": "KEY=VALUE", "callback": _key_values}
        else:
            kw = {"type": ENGINE_TYPES.get(option.type, option.type), "default": option.default}
        params.append(click.Option([flag, ENGINE + key], help=text, **kw))
    return params


# an engine's knob of each type (pipelines/<engine>.py OPTIONS): its ints are counts (--workers), its
# floats waits in seconds (--ray-wait-nodes)
ENGINE_TYPES = {int: COUNT, float: SECONDS}


def _key_values(ctx, param, values) -> dict:
    pairs = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"takes KEY=VALUE, not {item!r}")
        pairs[key.strip().lstrip("-")] = value
    return pairs


def engine_kwargs(params: dict) -> dict:
    """--engine and the options of that engine, taken out of a command's `params` (the other engines'
    are dropped): what run_stage and the workflow runner take."""
    from entroweight.pipelines import engine_module, require_engine
    from entroweight.pipelines.stage import StageError

    engine, knobs = params.pop("engine"), take(params, ENGINE)
    try:
        require_engine(engine)
    except StageError as e:
        _fail(str(e))
    return {"engine": engine, **{k: knobs[k] for k in engine_module(engine).OPTIONS}}


#: --wait of every command that holds the lock on its --out (a stage's, train's, ...): queue behind a run
wait_option = click.option(
    "--wait", type=SECONDS, default=0, help="Seconds to wait for another run's lock on --out."
)


def stage_options(f):
    """What a stage command takes beside the engine: shared by every stage command."""
    f = click.option(
        "--overwrite",
        is_flag=True,
        help="Delete shards of another config in --out instead of refusing; with the same config, redo the shards whose files changed since their manifest (each shard read once).",
    )(f)
    return wait_option(f)


def document_step_options(f):
    """The document steps of the stages that write weighted data (score, weigh): one flag each."""
    return click.option(
        "--min-mean-weight",
        type=Finite(0.0, 1.0),
        default=None,
        help="Drop documents whose mean weight is below this (all their rows), counted as rejects "
        "(reason low_weight). Not on packed rows.",
    )(f)


def say_listing(sources) -> None:
    """List SOURCES (refusing a missing one: SourceError) and say on stderr what the listing left out
    or read once, before anything is read or written."""
    from entroweight.transforms.sources import expand_sources

    notes: list[str] = []
    expand_sources(list(sources), notes)
    for note in notes:
        click.echo(f"note: {note}", err=True)


def _takes(param: str) -> bool:
    """Whether the command being run has `param` (outside a command: taken as having it)."""
    ctx = click.get_current_context(silent=True)
    return ctx is None or any(p.name == param for p in ctx.command.params)


def _reads_apart(out, reads, command: str, flag: str) -> None:
    """A glob read (SOURCES, --documents) may match what the run writes: refused (exit 2)."""
    from entroweight import storage
    from entroweight.transforms.sources import check_globs_apart

    try:
        check_globs_apart(out, reads, command, flag)
    except storage.OutputRefused as e:
        _fail(str(e))


def judge_stage_out(out, reads, command: str, params: dict):
    """The path rule for a stage command's --out (`pipelines.stage.judge_out`), asked before the stage
    is built (a model named, a tokenizer loaded): exit 2, or 3 while a run writes there. Its verdict
    goes to `run_stage_cli`, which the planner takes instead of asking again."""
    from entroweight.pipelines.stage import LockHeld, StageError, judge_out

    try:
        return judge_out(command, out, reads, params["overwrite"], params["wait"], apart=True)
    except LockHeld as e:
        _fail(str(e), EXIT_LOCKED)
    except StageError as e:
        _fail(str(e))


def of_checkpoint(ckpt_dir, options: dict, inputs: dict) -> dict:
    """The made_of of an output made from a checkpoint (export-hf's, evaluate's): its weights (of
    another checkpoint, or of this one trained again since, is refused unless --overwrite), the
    options a user chose, and the inputs' fingerprints."""
    from entroweight.models.checkpoint import made_from

    ckpt = made_from(ckpt_dir)
    return {
        "options": {"checkpoint": ckpt["weights_sha256"] or ckpt["checkpoint"], **options},
        "inputs": inputs,
    }


@contextlib.contextmanager
def writing_out(declared, out, reads, made_of, overwrite, wait: float = 0, what=None, check=None):
    """`entroweight.output.writing` for a command run by hand: every rule of its output in order, its
    refusals said in one line (exit 2; exit 3 while another run holds `out`), the refusal advising
    --overwrite and --wait where the command has them. Yields the `Writing`."""
    from entroweight import output, storage

    _reads_apart(out, reads, declared.command, "--out")
    if not _takes("overwrite"):
        overwrite = None
    with contextlib.ExitStack() as stack:
        try:
            w = stack.enter_context(
                output.writing(
                    declared, out, reads, made_of, overwrite=overwrite, wait=wait, what=what,
                    advise_wait=_takes("wait"), check=check,
                )
            )  # fmt: skip
        except storage.OutputHeld as e:
            _fail(str(e), EXIT_LOCKED)
        except (storage.OutputRefused, storage.StorageError) as e:
            _fail(str(e))
        yield w


def run_stage_cli(stage, out, judged, overwrite, wait, **params):
    """Run `stage` into `out` on the engine of `params` (the command's engine flags); exit codes above.
    `judged`: the path rule's verdict on `out` (`judge_stage_out`)."""
    from entroweight.pipelines import LockHeld, StageError, StageFailed, run_stage

    try:
        summary = run_stage(
            stage, out, overwrite=overwrite, wait=wait, judged=judged, **engine_kwargs(params)
        )
    except LockHeld as e:
        _fail(str(e), EXIT_LOCKED)
    except StageError as e:
        _fail(str(e))
    except StageFailed as e:
        _fail(str(e), EXIT_FAILED_SHARDS)
    click.echo(summary.line())
    return summary
