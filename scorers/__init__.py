"""Scorers: one raw value per token (value i is about predicting token i); see docs/scoring.md."""

from .base import Scorer, ScorerError, length_buckets
from .registry import ENTRY_POINT_GROUP, available, get_scorer_class, make_scorer, register

__all__ = [
    "ENTRY_POINT_GROUP",
    "Scorer",
    "ScorerError",
    "available",
    "get_scorer_class",
    "length_buckets",
    "make_scorer",
    "register",
]
