"""The Scorer interface: one float32 value per token, aligned so that value i is about token i.

Conventions every scorer keeps (docs/scoring.md):
- pads get 0;
- value i is about predicting token i from the tokens before it (model outputs shifted right by one);
- the first real token is predicted from a start token when the model has one (HF: BOS, else EOS;
  our checkpoints: the left padding they were trained on); with no context at all (a full row to a
  model without a start token) it gets the mean of the row's other real values, so it neither moves
  the row's min-max range nor its mean.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np


class ScorerError(ValueError):
    """A scorer that cannot run on this input or with these options; the message says what to do."""


class Scorer(ABC):
    """Subclass, set `name`, implement `config`, `setup` and `score_batch` (or override `score`)."""

    name: ClassVar[str] = "scorer"
    #: a scorer that reads text (cross_tokenizer) needs the data tokenizer file; one that reads ids may not
    needs_data_tokenizer: ClassVar[bool] = False
    #: what a value measures, written into the file metadata (docs/scoring.md, "Units"); only `nats`
    #: is a per-token entropy estimate that `--loss rescaled` can fit a loss to
    unit: ClassVar[str] = "nats"

    def __init__(self, batch_size: int = 16, device: str = "cpu", **options: Any):
        self.batch_size, self.device, self.options = batch_size, device, options

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """What changes the values (model sha256, dtype, aggregate...): hashed into the stage config
        and written into the file metadata. Cheap: no model load."""

    def check_data_tokenizer(self, sha256: str, data_tokenizer=None) -> None:  # noqa: B027 - optional
        """Raise ScorerError when ids of this tokenizer are not what the model reads (driver side)."""

    @abstractmethod
    def setup(self, data_tokenizer=None) -> None:
        """Load the model once per worker. `data_tokenizer` is a LoadedTokenizer or None."""

    def score_batch(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
        """(B, T) left-padded ids, left padding already cut to the batch's longest -> (B, T) float32."""
        raise NotImplementedError

    def score(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
        """(B, T) left-padded ids -> (B, T) float32 in the input order; pads 0."""
        input_ids, n_pad = np.asarray(input_ids), np.asarray(n_pad)
        B, T = input_ids.shape
        out = np.zeros((B, T), dtype=np.float32)
        lengths = T - n_pad
        for idx in length_buckets(lengths, self.batch_size):
            width = max(int(lengths[idx].max()), 1) if self.cut_padding else T
            values = self.score_batch(input_ids[idx, T - width :], n_pad[idx] - (T - width))
            out[idx, T - width :] = values
        out[np.arange(T)[None, :] < n_pad[:, None]] = 0.0
        return out

    #: cut left padding to the batch's longest row; a model that attends to pads must keep them
    cut_padding: bool = True
    #: loaded by setup(); never pickled (engines ship the scorer to workers, which call setup())
    _heavy: ClassVar[tuple[str, ...]] = ("_model", "_model_tok", "_data_tok")

    def __getstate__(self):
        state = self.__dict__.copy()
        for name in self._heavy:
            if name in state:
                state[name] = None
        return state

    def excluded(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray | None:
        """(B, T) bool: real positions this scorer gives no value (e.g. separators of packed documents);
        weighting treats them as pads (weight 0, outside the normalisation). None: every real token."""
        return None

    def metadata(self) -> dict[str, Any]:
        """What the file metadata records beyond config() (called after setup): the unit, and e.g. the
        start token a model read."""
        return {"unit": self.unit}

    def report(self) -> dict[str, Any]:
        """What the last `reset_report()`..now scored is worth recording in the manifest (e.g. alignment error)."""
        return {}

    def reset_report(self) -> None:  # noqa: B027 - optional hook
        """Start a new report (called per shard)."""


def length_buckets(lengths: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    """Row indices in batches of similar length (longest first); a stable sort keeps ties in order."""
    if batch_size < 1:
        raise ScorerError(f"--batch-size must be at least 1, not {batch_size}")
    order = np.argsort(-np.asarray(lengths), kind="stable")
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def fill_first_token(values: np.ndarray, n_pad: np.ndarray, has_context: np.ndarray) -> None:
    """In place: rows whose first real token had no prediction get the mean of their other real values."""
    B, T = values.shape
    for r in np.flatnonzero(~np.asarray(has_context)):
        first = int(n_pad[r])
        if first >= T:
            continue
        rest = values[r, first + 1 :]
        values[r, first] = float(rest.mean()) if rest.size else 0.0
