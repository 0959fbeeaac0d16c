"""Scorers by name: the built-ins, plus any package's entry points in the `entroweight.scorers` group.

A third-party package registers its Scorer subclass in its pyproject.toml:

    [project.entry-points."entroweight.scorers"]
    my_scorer = "my_package.scoring:MyScorer"

Every scorer, built-in or not, declares the options it takes as a pydantic model (`Options`, a
`ScorerOptions` subclass); `make_scorer` validates through it, so an unknown or mistyped key is
refused with the scorer's valid keys instead of being ignored.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from .base import Scorer, ScorerError, ScorerOptions, validate_options

ENTRY_POINT_GROUP = "entroweight.scorers"

BUILTIN = {
    "causal_loss": "entroweight.scorers.causal_loss:CausalLossScorer",
    "cross_tokenizer": "entroweight.scorers.cross_tokenizer:CrossTokenizerScorer",
    "occlusion": "entroweight.scorers.occlusion:OcclusionScorer",
    "decomposition": "entroweight.scorers.decomposition:DecompositionScorer",
    "two_model": "entroweight.scorers.two_model:TwoModelScorer",
    "grad_input": "entroweight.scorers.grad_input:GradInputScorer",
    "excess_loss": "entroweight.scorers.excess_loss:ExcessLossScorer",
}
_registered: dict[str, type[Scorer]] = {}


def register(cls: type[Scorer], name: str | None = None) -> type[Scorer]:
    """Register a Scorer class in this process (also usable as a class decorator)."""
    _registered[name or cls.name] = cls
    return cls


def available() -> list[str]:
    names = set(BUILTIN) | set(_registered)
    names |= {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def get_scorer_class(name: str) -> type[Scorer]:
    if name in _registered:
        return _registered[name]
    if name in BUILTIN:
        module, attr = BUILTIN[name].split(":")
        return getattr(importlib.import_module(module), attr)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            try:
                cls = ep.load()
            except Exception as e:  # a broken third-party package: say which, not a traceback
                raise ScorerError(f"entry point {ep.value} ({name}) cannot be loaded: {e}") from e
            if not (isinstance(cls, type) and issubclass(cls, Scorer)):
                raise ScorerError(f"entry point {ep.value} ({name}) is not a Scorer subclass")
            return cls
    raise ScorerError(f"unknown scorer {name!r}; available: {', '.join(available())}")


def check_options(name: str, options: dict) -> ScorerOptions:
    """The options `name` would be built with, validated (no model load): ScorerError / OptionsError."""
    return validate_options(get_scorer_class(name), options)


def make_scorer(name: str, **options) -> Scorer:
    """A scorer built from validated options (every field of its Options model, defaults filled in)."""
    cls = get_scorer_class(name)
    return cls(**validate_options(cls, options).model_dump())
