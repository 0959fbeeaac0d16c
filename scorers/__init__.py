"""Scorers: one raw value per token (value i is about predicting token i); see docs/scoring.md."""

from .base import Batching, OptionsError, Scored, Scorer, ScorerError, ScorerOptions, length_buckets
from .registry import (
    ENTRY_POINT_GROUP,
    available,
    check_options,
    get_scorer_class,
    make_scorer,
    register,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Batching",
    "Scored",
    "OptionsError",
    "Scorer",
    "ScorerError",
    "ScorerOptions",
    "available",
    "check_options",
    "get_scorer_class",
    "length_buckets",
    "make_scorer",
    "register",
]
