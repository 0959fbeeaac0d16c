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

import bisect
import copy
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import ConfigDict, Field, ValidationError, field_validator

from entroweight.options import Options, device_name, refusal_lines
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


class ScorerOptions(Options):
    """What every scorer takes. A scorer declares its own as a subclass named `Options` (one field per
    option, one line each); unknown keys are refused, so a typo never runs with a default."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(
        16,
        ge=1,
        description="Rows per forward pass: speed and memory (values alike to float rounding, ~1e-6).",
    )
    device: str = Field("cpu", description="A torch device: cpu, cuda, cuda:N, mps.")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        # the name only (no `auto`: a scorer is told where it runs): whether the device is there is a
        # worker's question (a cluster's driver may have none), pipelines/score.py's check_device
        return device_name(v, auto=False)


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


@dataclass(frozen=True)
class Batching:
    """How the rows handed to `Scorer.score` are cut into forwards: speed and memory, never values.
    `batch_size` rows per forward (None: the scorer's own), or a token budget (rows × width) when
    `batch_tokens` is set; `on_rows(n)` is called after each forward (a progress bar)."""

    batch_size: int | None = None
    batch_tokens: int | None = None
    on_rows: Callable[[int], Any] | None = None


@dataclass(frozen=True)
class Scored:
    """What `Scorer.score` returns for its rows: `values` (B, T) float32, 0 on pads and excluded
    positions; `excluded` (B, T) bool or None, the real positions given no value (weighing treats them
    as pads; the data stores them); `computed` the positions the forwards computed, pads included
    (the stage reports the pad fraction); `stats` per-call counters that add up (e.g. the alignment of
    cross_tokenizer: objects with `add` and `as_dict`)."""

    values: np.ndarray
    excluded: np.ndarray | None = None
    computed: int = 0
    real: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Later:
    """What `score_batch` may return when its values are still being computed on a device: `finish()`
    waits for them and returns what `score_batch` would have (an array or a Scored). `score_rows` queues
    the next batch before it calls `finish()` on this one, so a device never waits on the host's
    placing of values, nor the host on the device's last kernel before it starts the next batch."""

    finish: Callable[[], Any]


class Scorer(ABC):
    """Subclass, set `name`, declare `Options`, implement `config`, `setup` and `score_batch` (or
    override `score`). The constructor receives the validated options as keywords and does no I/O
    beyond what `config` needs; after `setup` a scorer holds no per-run state: `score` is a function
    of its arguments, and what a run counts comes back in `Scored`."""

    name: ClassVar[str] = "scorer"
    #: the options this scorer takes (a ScorerOptions subclass): CLI, workflow and entry points validate here
    Options: ClassVar[type[ScorerOptions]] = ScorerOptions
    #: a scorer that reads text (cross_tokenizer) needs the data tokenizer file; one that reads ids may not
    needs_data_tokenizer: ClassVar[bool] = False
    #: what a value measures, written into the file metadata (docs/scoring.md, "Units"); only `nats`
    #: is a per-token entropy estimate that `--loss rescaled` can fit a loss to
    unit: ClassVar[str] = "nats"
    #: cut left padding to the batch's longest row; a model that attends to pads must keep them
    cut_padding: bool = True
    #: lay rows out without computing pads where the model allows (scorers/packing.py: several rows
    #: in one sequence, or rows after a shared pad prefix); False: one row per batch row, padding
    #: included, the path the equality tests compare the packed one with. Values, not speed, agree.
    pack: bool = True

    #: `score` reads a split document's rows as one text: the score stage hands every row of a
    #: document in one call where it can (else after the row before it, as left context) and passes
    #: `continues`; a scorer of rows on their own leaves it False
    reads_documents: ClassVar[bool] = False
    #: loaded by setup(); never pickled (engines ship the scorer to workers, which call setup())
    _heavy: ClassVar[tuple[str, ...]] = ("_model", "_model_tok", "_data_tok")

    def __init__(self, batch_size: int = 16, device: str = "cpu", **options: Any):
        self.batch_size, self.device, self.options = batch_size, device, options

    # -- driver side (cheap: no model load)
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

    def max_row_tokens(self) -> int | None:
        """The widest row the model reads (its context), found cheaply on the driver; None when it
        reads rows of any width (windows that slide) or cannot tell. The score stage refuses wider
        data up front."""
        return None

    @classmethod
    def kind_problem(cls, kind: str) -> str | None:
        """Why one of our checkpoints of model `kind` cannot be this scorer's `checkpoint` (the end of a
        refusal naming it), else None: told without reading a checkpoint, so a workflow refuses a
        `checkpoint_from` of the wrong kind before any step trains it."""
        return None

    @classmethod
    def unit_of(cls, options: dict[str, Any]) -> str | None:
        """The unit of the values this scorer writes with `options`, told without constructing it (no
        checkpoint read: a workflow's validation asks before any step ran); None when it cannot tell.
        A scorer whose unit depends on its options overrides this, and its `unit` calls it."""
        return cls.unit if isinstance(cls.__dict__.get("unit", getattr(cls, "unit", None)), str) else None

    # -- worker side
    @abstractmethod
    def setup(self, data_tokenizer=None) -> None:
        """Load the model once per worker. `data_tokenizer` is a LoadedTokenizer or None."""

    def metadata(self) -> dict[str, Any]:
        """What the file metadata records beyond config() (called after setup): the unit, and e.g. the
        start token a model read."""
        return {"unit": self.unit}

    def score_batch(self, input_ids: np.ndarray, n_pad: np.ndarray) -> np.ndarray | Scored | Later:
        """(B, T) left-padded ids, left padding already cut to the batch's longest -> (B, T) float32,
        or a Scored of them that says how many positions its forwards computed (packed rows), or a
        `Later` giving either once the device has them (the next batch is queued first)."""
        raise NotImplementedError

    def batch_width(self, longest: int, T: int) -> int:
        """Positions a forward computes per row for a batch whose longest real row is `longest` (of
        width T): that row's length when padding is cut, else the whole row (a model may widen it)."""
        return max(longest, 1) if self.cut_padding else T

    def packs_rows(self) -> bool:
        """Whether `score_batch` packs several rows into one sequence (after setup): a token budget
        then counts the batch's real tokens, not rows × width."""
        return False

    def attention_skips_fill(self) -> bool:
        """Whether the model's attention over packed rows skips what lies outside each row (after
        setup): FlexAttention's block mask, a varlen kernel. `packs_shard_wide` asks it."""
        return False

    def batch_columns(self, width: int, T: int) -> int:
        """Columns of the input rows a batch of `width` is handed (the last ones): as many as it
        computes, or more (a scorer that reads its rows after a shared pad prefix needs their width)."""
        return min(width, T)

    def score(
        self,
        input_ids: np.ndarray,
        n_pad: np.ndarray,
        batching: Batching = Batching(),
        continues: np.ndarray | None = None,
    ) -> Scored:
        """(B, T) left-padded ids -> Scored, values in the input order; pads 0. The rows are batched
        by `plan_batches` (sorted by real length; a token budget when `batching.batch_tokens` is set),
        each batch cut to its widest real row where the model allows it (`cut_padding`).
        `continues` (bool per row: the row goes on with the document of the row before it) is for a
        scorer that `reads_documents`; a scorer of rows on their own ignores it."""
        return score_rows(self, input_ids, n_pad, batching)

    def __getstate__(self):
        state = self.__dict__.copy()
        for name in self._heavy:
            if name in state:
                state[name] = None
        return state


def score_rows(
    scorer: Scorer, input_ids: np.ndarray, n_pad: np.ndarray, batching: Batching, score_batch=None
) -> Scored:
    """`scorer.score_batch` (or `score_batch`) over the batches `plan_batches` makes of the rows
    (gathered on a background thread while the model runs the previous batch; a batch that returns
    `Later` is placed after the next one is queued); values put back in row order, pads 0."""
    score_batch = score_batch or scorer.score_batch
    input_ids, n_pad = np.asarray(input_ids), np.asarray(n_pad)
    B, T = input_ids.shape
    out = np.zeros((B, T), dtype=np.float32)
    lengths = T - n_pad
    batch_size = batching.batch_size or scorer.batch_size
    # packed over the whole shard in sequences as wide as the data's rows, or cut batches (each batch's
    # rows packed by the scorer where two fit one sequence)
    packed = scorer.packs_rows() and packs_shard_wide(scorer)
    plan = plan_batches(
        lengths,
        lambda n: scorer.batch_width(n, T),
        batch_size,
        batching.batch_tokens,
        packed,
        T if packed else None,
    )

    def batches():
        for idx, width in plan:
            cut = scorer.batch_columns(width, T)  # columns of the input this batch reads
            yield idx, width, cut, np.ascontiguousarray(input_ids[idx, T - cut :]), n_pad[idx] - (T - cut)

    computed = 0

    def place(idx, width, cut, values) -> None:
        nonlocal computed
        if isinstance(values, Later):
            values = values.finish()
        if isinstance(values, Scored):  # a batch that says what it computed (packed rows)
            computed += values.computed
            values = values.values
        else:
            computed += len(idx) * width
        out[idx, T - cut :] = values
        if batching.on_rows is not None:
            batching.on_rows(len(idx))

    queued(
        prefetch(batches()),
        lambda b: score_batch(b[3], b[4]),
        lambda b, values: place(*b[:3], values),
    )
    out[np.arange(T)[None, :] < n_pad[:, None]] = 0.0
    return Scored(out, None, computed, int(lengths.sum()))


def queued(batches: Iterable, launch: Callable, place: Callable) -> None:
    """`launch(batch)` for each batch, and `place(batch, launched)` for the one before it once this one
    is launched: a device runs batch k + 1 while the host places batch k's values (see `Later`)."""
    pending = None
    for batch in batches:
        launched = launch(batch)
        if pending is not None:
            place(*pending)
        pending = (batch, launched)
    if pending is not None:
        place(*pending)


def add_stats(total: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """Per-call counters added up (each value has `add`); `total` is updated and returned."""
    for k, v in more.items():
        if k in total:
            total[k].add(v)
        else:
            total[k] = copy.deepcopy(v)
    return total


def length_buckets(lengths: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    """Row indices in batches of similar length (longest first); a stable sort keeps ties in order."""
    if batch_size < 1:
        raise ScorerError(f"--batch-size must be at least 1, not {batch_size}")
    order = np.argsort(-np.asarray(lengths), kind="stable")
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def plan_batches(
    lengths: np.ndarray,
    width_of,
    batch_size: int,
    batch_tokens: int | None = None,
    packed: bool = False,
    capacity: int | None = None,
) -> list[tuple[np.ndarray, int]]:
    """(row indices, width) per forward: rows sorted by real length, longest first (a stable sort keeps
    ties in order), so each batch is as wide as its first row (`width_of(its length)`). With
    `batch_tokens`, a batch holds at most rows × width positions (at least one row), split where it
    would compute too much padding (`cut_batches`), or, `packed` (rows packed into sequences), the
    sequences of as many whole `pack_groups` as fit in it, each sequence `capacity` wide (default:
    the widest row's width; short rows fill beside long ones: a batch of rows of one length would
    leave the rest of every sequence empty); without, `batch_size` rows. A row of no tokens (an empty
    document: pads alone) is in no batch: a forward has nothing to score there, and its values are 0."""
    lengths = np.asarray(lengths)
    live = np.flatnonzero(lengths > 0)
    if len(live) < len(lengths):
        plan = plan_batches(lengths[live], width_of, batch_size, batch_tokens, packed, capacity)
        return [(live[idx], width) for idx, width in plan]
    if batch_tokens is None:
        return [(idx, width_of(int(lengths[idx[0]]))) for idx in length_buckets(lengths, batch_size)]
    if batch_tokens < 1:
        raise ScorerError(f"--batch-tokens must be at least 1, not {batch_tokens}")
    widths = np.array([width_of(int(x)) for x in lengths], dtype=np.int64)  # each row's alone
    if packed:
        width = capacity or max(int(widths.max(initial=1)), 1)
        groups = pack_groups(widths, width)
        per = max(1, batch_tokens // width)
        return [
            (np.fromiter(itertools.chain.from_iterable(groups[k : k + per]), dtype=np.int64), width)
            for k in range(0, len(groups), per)
        ]
    return cut_batches(lengths, widths, batch_tokens)


def packs_shard_wide(scorer: Scorer) -> bool:
    """Where a model reads packed rows, whether the planner packs them over the whole shard
    (`pack_groups`: sequences as wide as the data's rows, 0.2-0.5 % fill) or cuts length-sorted rows
    into batches as wide as their longest (`cut_batches`: 3-4 % fill at 64k tokens a forward on the
    H200 bench's shard, 0.5 % at 4k on a CPU; the scorer still packs a batch's rows where two fit
    one sequence, and a batch of one row a sequence takes plain causal attention). Shard-wide where
    the attention skips what lies outside each row (`Scorer.attention_skips_fill`: our models'
    FlexAttention on CUDA), cut where it computes each
    sequence's whole causal square under a block mask (SDPA: every device off CUDA, and transformers'
    models, loaded with SDPA, on CUDA too). Measured (docs/scaling.md, docs/scoring.md): on an H200
    in bf16, our `mask_pads` llama ran at 0.85 of its limit shard-wide against 0.81 cut, an HF llama
    at 0.84 against 0.86 and cross_tokenizer at 0.57 against 0.64 (its attention 0.41 against 0.13 s);
    on 2 CPU cores, cut took 0.89-0.97x the time of shard-wide."""
    return scorer.attention_skips_fill()


# what a batch costs beyond its positions, as a share of the budget: a batch is split where that saves
# more than budget / 64 positions of padding (on the bench's C4 shard at 4k tokens a forward, 12.5 %
# of the positions were padding when each batch took rows until the budget was full, 2.8 % so)
BATCH_COST = 1 / 64


def cut_batches(lengths: np.ndarray, widths: np.ndarray, batch_tokens: int) -> list[tuple[np.ndarray, int]]:
    """Rows sorted by length, longest first, in consecutive batches of at most `batch_tokens`
    positions (rows × the first row's width, `widths` per row; a row wider than that alone): the
    split that computes the fewest positions, each batch counted as `BATCH_COST` of the budget more
    (dynamic programming from the shortest rows up). Greedy filling would let a batch of long rows
    take short ones."""
    order = np.argsort(-lengths, kind="stable")
    n = len(order)
    widths = np.maximum(widths[order], 1)
    cost = np.zeros(n + 1)  # cost[i]: the least cost of rows i.. (in sorted order)
    end = np.zeros(n, dtype=np.int64)  # where the batch starting at row i ends
    per_batch = batch_tokens * BATCH_COST
    for i in range(n - 1, -1, -1):
        most = min(max(1, batch_tokens // int(widths[i])), n - i)
        c = np.arange(1, most + 1) * widths[i] + cost[i + 1 : i + most + 1]
        k = int(np.argmin(c))
        cost[i], end[i] = c[k] + per_batch, i + k + 1
    plan, i = [], 0
    while i < n:
        plan.append((order[i : end[i]], int(widths[i])))
        i = int(end[i])
    return plan


def pack_groups(sizes, capacity: int) -> list[list[int]]:
    """Indices of `sizes` (none over `capacity`) in groups that each fit one sequence of `capacity`
    slots, by best-fit decreasing: each row, longest first, goes where it leaves the least room.
    Over a C4 shard at n_ctx 512 it leaves 0.2-0.4 % of the slots empty (the bound is 0.1-0.2 %);
    batches of rows sorted by length, each packed as wide as its longest row, left 2-7 %."""
    sizes = np.asarray(sizes, dtype=np.int64)
    free: list[tuple[int, int]] = []  # (room left, group), sorted
    groups: list[list[int]] = []
    for r in np.argsort(-sizes, kind="stable").tolist():
        m = int(sizes[r])
        k = bisect.bisect_left(free, (m, -1))
        if k < len(free):
            room, g = free.pop(k)
        else:
            room, g = capacity, len(groups)
            groups.append([])
        groups[g].append(r)
        bisect.insort(free, (room - m, g))
    return groups


def fill_first_token(values: np.ndarray, n_pad: np.ndarray, has_context: np.ndarray) -> None:
    """In place: rows whose first real token had no prediction get the mean of their other real values."""
    B, T = values.shape
    for r in np.flatnonzero(~np.asarray(has_context)):
        first = int(n_pad[r])
        if first >= T:
            continue
        rest = values[r, first + 1 :]
        values[r, first] = float(rest.mean()) if rest.size else 0.0
