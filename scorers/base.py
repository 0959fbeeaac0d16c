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
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from entroweight.options import refusal_lines
from entroweight.transforms.prefetch import prefetch


class ScorerError(ValueError):
    """A scorer that cannot run on this input or with these options; the message says what to do."""


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


class OptionsError(ScorerError):
    """Options a scorer's `Options` model refuses. `lines(where)` names each key the caller's way
    (`--dtype`, `scores[0].options.dtype`); str() names them as CLI flags."""

    def __init__(self, scorer: str, error: ValidationError, valid: list[str]):
        self.scorer, self.error, self.valid = scorer, error, valid
        super().__init__(self.render(flag))

    def lines(self, where: Callable[[str], str], name: Callable[[str], str] | None = None) -> list[str]:
        """One per problem; `where(key)` names a key given by the caller, `name(key)` a valid key."""
        valid = ", ".join(map(name or where, self.valid))
        unknown = f"does not apply to the {self.scorer} scorer (its options: {valid})"
        return refusal_lines(self.error, lambda loc: where(str(loc[0])), unknown)

    def render(self, where: Callable[[str], str], name: Callable[[str], str] | None = None) -> str:
        return f"the {self.scorer} scorer's options are refused: " + "; ".join(self.lines(where, name))


class ScorerOptions(BaseModel):
    """What every scorer takes. A scorer declares its own as a subclass named `Options` (one field per
    option, one line each); unknown keys are refused, so a typo never runs with a default."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(16, ge=1, description="Rows per forward pass (speed and memory, not values).")
    device: str = Field("cpu", description="A torch device: cpu, cuda, cuda:N, mps.")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        # the syntax only: whether CUDA is there is a worker's question (a cluster's driver may have none)
        import torch

        try:
            torch.device(v)
        except (RuntimeError, ValueError):
            raise ValueError(f"{v!r} is not a torch device (cpu, cuda, cuda:N, mps)") from None
        return v


class ModelOptions(ScorerOptions):
    """A scorer that runs a torch model."""

    dtype: Literal["bf16", "fp16", "fp32"] | None = Field(
        None, description="Compute dtype (default: bf16 where native)."
    )
    allow_pickle: bool = Field(
        False, description="Load pickle weights (.pt/.bin) where no safetensors exist."
    )


class HFModelOptions(ModelOptions):
    """A scorer that may load a Hugging Face model."""

    trust_remote_code: bool = Field(False, description="Let an HF repository run its own modelling code.")


def validate_options(cls: type[Scorer], options: dict[str, Any]) -> ScorerOptions:
    """`options` through the scorer's Options model; OptionsError names every bad key and the valid ones."""
    try:
        return cls.Options.model_validate(options)
    except ValidationError as e:
        raise OptionsError(cls.name, e, list(cls.Options.model_fields)) from None


class Scorer(ABC):
    """Subclass, set `name`, declare `Options`, implement `config`, `setup` and `score_batch` (or
    override `score`). The constructor receives the validated options as keywords."""

    name: ClassVar[str] = "scorer"
    #: the options this scorer takes (a ScorerOptions subclass): CLI, workflow and entry points validate here
    Options: ClassVar[type[ScorerOptions]] = ScorerOptions
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

    def vocab_size(self) -> int | None:
        """How many ids the model reads (ids from 0 to this − 1), found cheaply on the driver; None
        when it reads text or cannot tell. The score stage refuses data with larger ids up front."""
        return None

    @abstractmethod
    def setup(self, data_tokenizer=None) -> None:
        """Load the model once per worker. `data_tokenizer` is a LoadedTokenizer or None."""

    def score_batch(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
        """(B, T) left-padded ids, left padding already cut to the batch's longest -> (B, T) float32."""
        raise NotImplementedError

    def score(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
        """(B, T) left-padded ids -> (B, T) float32 in the input order; pads 0. The rows are batched
        by `plan_batches` (sorted by real length; a token budget when `batch_tokens` is set), each
        batch cut to its widest real row where the model allows it (`cut_padding`)."""
        input_ids, n_pad = np.asarray(input_ids), np.asarray(n_pad)
        B, T = input_ids.shape
        out = np.zeros((B, T), dtype=np.float32)
        lengths = T - n_pad
        plan = plan_batches(lengths, lambda n: self.batch_width(n, T), self.batch_size, self.batch_tokens)

        def batches():  # gathered on a background thread while the model runs the previous batch
            for idx, width in plan:
                cut = min(width, T)  # columns of the input this batch reads (a model may widen it)
                yield idx, width, cut, np.ascontiguousarray(input_ids[idx, T - cut :]), n_pad[idx] - (T - cut)

        for idx, width, cut, ids, pads in prefetch(batches()):
            out[idx, T - cut :] = self.score_batch(ids, pads)
            self.computed_tokens += len(idx) * width
            self.real_tokens += int(lengths[idx].sum())
            if self.on_rows is not None:
                self.on_rows(len(idx))
        out[np.arange(T)[None, :] < n_pad[:, None]] = 0.0
        return out

    def batch_width(self, longest: int, T: int) -> int:
        """Positions a forward computes per row for a batch whose longest real row is `longest` (of
        width T): that row's length when padding is cut, else the whole row (a model may widen it)."""
        return max(longest, 1) if self.cut_padding else T

    #: a token budget per forward (rows × width), set by the stage (`score --batch-tokens`); None:
    #: `batch_size` rows per forward. Either way batches change speed, not values.
    batch_tokens: int | None = None
    #: positions computed / real tokens scored since `reset_report` (the stage reports the pad fraction)
    computed_tokens: int = 0
    real_tokens: int = 0
    #: called with the number of rows after each batch (a progress bar)
    on_rows = None

    def set_batching(self, batch_tokens: int | None, on_rows=None) -> None:
        """The token budget and progress hook, for this scorer and the scorers it is made of
        (excess_loss scores with two)."""
        self.batch_tokens, self.on_rows = batch_tokens, on_rows
        for part in self.parts():
            part.set_batching(batch_tokens, None)

    def parts(self) -> list[Scorer]:
        """The scorers this one delegates to (found among its attributes)."""
        return [v for v in vars(self).values() if isinstance(v, Scorer)]

    def padding_counts(self) -> tuple[int, int]:
        """(positions computed, real tokens scored), this scorer's and its parts'."""
        computed, real = self.computed_tokens, self.real_tokens
        for part in self.parts():
            c, r = part.padding_counts()
            computed, real = computed + c, real + r
        return computed, real

    def reset_padding_counts(self) -> None:
        self.computed_tokens = self.real_tokens = 0
        for part in self.parts():
            part.reset_padding_counts()

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


def plan_batches(
    lengths: np.ndarray, width_of, batch_size: int, batch_tokens: int | None = None
) -> list[tuple[np.ndarray, int]]:
    """(row indices, width) per forward: rows sorted by real length, longest first (a stable sort keeps
    ties in order), so each batch is as wide as its first row (`width_of(its length)`). With
    `batch_tokens`, a batch takes rows while rows × width stays within it (at least one row);
    without, `batch_size` rows."""
    lengths = np.asarray(lengths)
    if batch_tokens is None:
        return [(idx, width_of(int(lengths[idx[0]]))) for idx in length_buckets(lengths, batch_size)]
    if batch_tokens < 1:
        raise ScorerError(f"--batch-tokens must be at least 1, not {batch_tokens}")
    order = np.argsort(-lengths, kind="stable")
    plan, start = [], 0
    while start < len(order):
        width = width_of(int(lengths[order[start]]))
        n = max(1, batch_tokens // max(width, 1))
        plan.append((order[start : start + n], width))
        start += n
    return plan


def fill_first_token(values: np.ndarray, n_pad: np.ndarray, has_context: np.ndarray) -> None:
    """In place: rows whose first real token had no prediction get the mean of their other real values."""
    B, T = values.shape
    for r in np.flatnonzero(~np.asarray(has_context)):
        first = int(n_pad[r])
        if first >= T:
            continue
        rest = values[r, first + 1 :]
        values[r, first] = float(rest.mean()) if rest.size else 0.0
