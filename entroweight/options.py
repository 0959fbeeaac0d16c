"""Options are pydantic models; this turns their refusals into lines for users, and writes their
reference tables for the docs.

Below every layer (it imports none of ours): the scorers' options, the weighting, the trainer's config,
the workflow file and the command line all refuse a value through `refusal_lines`, each naming the
key its own way (`--floor` on the command line, `scores[0].weighting.floor` in a workflow).

The rules every option of every front end follows are here too, once: a float is finite (`Options`),
a seed is one numpy and torch both take (`Seed`, `SEED_LIMIT`), a device is one torch knows and
entroweight runs on (`DeviceName`), and is on this machine where the work is about to run
(`device_here`). The command line's own flags take them through workflows/cli/common.py.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

# a seed goes to torch.manual_seed (a signed 64-bit integer at most) and to numpy's generators (no
# negative number): 0 <= seed < 2**63 is what both take. Outside, a run failed at its first draw, late.
SEED_LIMIT = 2**63
Seed = typing.Annotated[int, Field(ge=0, lt=SEED_LIMIT)]

# the device types the code runs on; torch knows more names (meta, xpu, ...), none of which it supports
DEVICE_TYPES = ("cpu", "cuda", "mps")
AUTO = "auto"  # where a command picks: CUDA where there is one, else the CPU


class Options(BaseModel):
    """The base of every options model (a scorer's, the weighting, the trainer's, the workflow file's).
    A value keeps the kind it was written as where a bool and a number meet: YAML reads `yes`, `on`
    and `true` as true, which pydantic would take as the number 1 (`stride: yes` would score with
    stride 1), and it would take 1 or 0 for a switch. A quoted number is still read as the number.
    No float is NaN or infinite (`lr: inf` passed `gt=0` and trained to NaN at step 2); subclasses'
    own `model_config` is merged with this one, so the rule holds for every model."""

    model_config = ConfigDict(allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _bool_and_number_apart(cls, value, info: ValidationInfo):
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        kinds = set(typing.get_args(field.annotation)) or {field.annotation}
        kinds.discard(type(None))
        if isinstance(value, bool) and kinds & {int, float} and bool not in kinds:
            raise ValueError(f"takes a number, not {str(value).lower()}")
        if kinds == {bool} and isinstance(value, int | float) and not isinstance(value, bool):
            raise ValueError(f"takes true or false, not {value!r}")
        return value


def device_name(value: str, auto: bool = True) -> str:
    """`value` if it names a device entroweight runs on: cpu, cuda, cuda:N, mps, and `auto` where the
    caller resolves it (`auto=True`). Any other name is refused (ValueError, the value named). The
    name only: whether the device is on this machine is `device_here`'s question, asked where the work
    runs (a cluster's driver may have no GPU its workers have)."""
    if auto and value == AUTO:
        return value
    import torch  # here, not at the top: the CLI starts without torch

    choices = ("auto, " if auto else "") + "cpu, cuda, cuda:N, mps"
    try:
        kind = torch.device(value).type
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{value!r} is not a torch device ({choices})") from None
    if kind not in DEVICE_TYPES:
        raise ValueError(f"{value!r} is a torch device entroweight does not run on ({choices})")
    if kind != "cuda" and torch.device(value).index is not None:  # cpu:7: torch takes it, tensors fail
        raise ValueError(f"{value!r} names a {kind} index; {kind} has none: use {kind} ({choices})")
    return value


def device_here(value: str, auto: bool = True):
    """The torch.device `value` names on this machine (`auto`: CUDA where there is one, else the CPU),
    refused (ValueError) unless `device_name` takes it and the device is here: CUDA or MPS asked for
    where torch sees none, or a CUDA index past the last, failed deep in torch with a traceback."""
    import torch

    device_name(value, auto)
    if value == AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(value)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{value} but no CUDA device is visible here; use cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"{value} but this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{value} but no MPS device is available here; use cpu")
    return device


# a device field of an options model: the name checked wherever the model is validated
DeviceName = typing.Annotated[str, AfterValidator(device_name)]


def key_path(loc: tuple) -> str:
    """A pydantic location as a workflow file spells it: `scores[0].weighting.floor`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def refusal_lines(
    e: ValidationError, where: Callable[[tuple], str] = key_path, unknown: str = "unknown key"
) -> list[str]:
    """One line per problem, `KEY: what is wrong`. `where(loc)` names the key the caller's way;
    a problem of the model as a whole is its message alone (the message says which keys). `unknown`
    is what a key the model does not have is told (the valid keys, where to look them up)."""
    lines = []
    for err in e.errors():
        # pydantic names its validator steps in the location ("function-after[...]"): not a key
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        kind, given = err["type"], err.get("input")
        if kind == "extra_forbidden":
            msg = unknown
        elif kind == "missing":
            msg = "required, not given"
        elif kind == "literal_error":
            msg = f"unknown {loc[-1] if loc else 'value'} {given!r}; {err['msg'].lower()}"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if kind != "value_error" and not isinstance(given, dict):  # our own messages name the value
                msg += f" (got {_short(given)})"
        name = where(loc) if loc else ""
        lines.append(f"{name}: {msg}" if name else msg)
    return lines


def repeated(values) -> list:
    """The values given more than once (sorted): a list that names a thing twice is refused, whichever
    front end it came through (a workflow's `accuracy.tasks` and agreement pairs, `evaluate --tasks`)."""
    values = list(values)
    return sorted({v for v in values if values.count(v) > 1})


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def options_table(
    model: type[BaseModel], key: Callable[[str], str] = lambda name: f"`{name}`", head: str = "option"
) -> str:
    """A model's fields as a markdown table (name, type, default, description), in declaration order,
    inherited fields first; `key` names a field the docs' way (`--weighting`). The docs carry these
    tables verbatim and a test compares them, so they cannot drift from the code."""
    rows = [f"| {head} | type | default | |", "|---|---|---|---|"]
    for name, f in model.model_fields.items():
        default = "required" if f.is_required() else f"`{f.default}`"
        rows.append(f"| {key(name)} | {type_name(f.annotation)} | {default} | {f.description or ''} |")
    return "\n".join(rows)


def bare(annotation):
    """A type without its constraints: `int` of `Seed` (an Annotated int), so that a field's flag and
    its docs row are those of the type it constrains."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def type_name(annotation) -> str:
    """`int`, `bf16` / `fp16`, `float float` (a pair), `str or none`."""
    annotation = bare(annotation)
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " / ".join(f"`{a}`" for a in args)
    if origin is tuple:
        return (
            "("
            + ", ".join(type_name(a) for a in args if a is not Ellipsis)
            + (", ...)" if Ellipsis in args else ")")
        )
    if args:  # a union: X | None
        return " or ".join(type_name(a) for a in args)
    return "none" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def setting_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """`key: old -> new` of each setting that differs, nested settings by their dotted key
    (`weighting.quantiles`), a long value cut short: the refusal stays one readable line (a weighting's
    100 reference quantiles made it 3 KB)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += setting_changes(a, b, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}: {_short(a)} -> {_short(b)}")
    return out


def _short(value, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"
