"""Options are pydantic models; this turns their refusals into lines for users, and writes their
reference tables for the docs.

Below every layer (it imports none of ours): the scorers' options, the weighting, the trainer's config,
the workflow file and the command line all refuse a value through `refusal_lines`, each naming the
key its own way (`--floor` on the command line, `scores[0].weighting.floor` in a workflow).
"""

from __future__ import annotations

import typing
from collections.abc import Callable

from pydantic import BaseModel, ValidationError, ValidationInfo, field_validator


class Options(BaseModel):
    """The base of every options model (a scorer's, the weighting, the trainer's, the workflow file's).
    A value keeps the kind it was written as where a bool and a number meet: YAML reads `yes`, `on`
    and `true` as true, which pydantic would take as the number 1 (`stride: yes` would score with
    stride 1), and it would take 1 or 0 for a switch. A quoted number is still read as the number."""

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


def type_name(annotation) -> str:
    """`int`, `bf16` / `fp16`, `float float` (a pair), `str or none`."""
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
