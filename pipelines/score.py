"""The score stage: a tokenized directory's shards -> weighted shards (ids + entropy + weight).

Its input may also be weighted data (the output of score or weigh): its sequences are scored anew, its
stored values, weights and the previous scorer's metadata are left behind, so the output is the same
bytes as scoring the tokens they came from.

Each `part-NNNNN.parquet` of sequences becomes a `part-NNNNN.parquet` of weighted sequences (the
same name) in the output directory, with its manifest. The file metadata is the input's plus the
scorer, its model id / checkpoint sha256 and the weighting. Input whose tokenizer is not the one the
scorer reads is refused before any work.

One shard loop: the shard streams in segments of about SEGMENT_TOKENS positions (memory stays
bounded whatever the shard's size); each segment is handed to the scorer at once, which sorts its
rows by length into token-budget batches (`scorers.base.plan_batches`), and the writer thread weighs
and writes one segment while the next is scored (`pipelines.weighted.WeightedShardWriter`).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from entroweight import __version__, storage
from entroweight.allocator import keep_freed_memory
from entroweight.options import device_here
from entroweight.schemas import ROW_IN_DOC, FileMetadata, ShardManifest, document_starts
from entroweight.schemas.arrow import WEIGHTED_COLUMNS
from entroweight.schemas.datadir import DataDir, DataDirError
from entroweight.schemas.manifest import ShardInput
from entroweight.schemas.weighted import matrix
from entroweight.scorers import Batching, Scorer, ScorerError, make_scorer
from entroweight.scorers.base import add_stats
from entroweight.transforms.select import DocumentStep
from entroweight.transforms.tokenizer import (
    TokenizerError,
    carry_tokenizer,
    data_tokenizer,
    load_tokenizer,
    tokenizer_from_bytes,
)
from entroweight.transforms.weigh import WeighConfig

from .stage import ShardTask, Stage, StageError
from .weighted import (
    WeightedShardWriter,
    check_steps,
    part_inputs,
    part_lineages,
    part_locations,
    read_input,
    weighing_metadata,
)

# positions (rows × n_ctx) scored together: the rows of a segment are sorted by length into batches
# (fuller batches the more rows there are), and two segments are in memory at a time
SEGMENT_TOKENS = 8 * 2**20
MIN_SEGMENT_ROWS = 64


def check_device(device: str) -> None:
    """Where the scorer runs (a worker, or the local engine's driver): is its device here? The one
    check of every command (entroweight.options.device_here), worded as the stage's refusal."""
    try:
        device_here(device, auto=False)
    except ValueError as e:
        raise StageError(f"--device {e}") from None


def open_parquet(path: str) -> pq.ParquetFile:
    return pq.ParquetFile(storage.open_input(path))


def max_id(files: list[str]) -> tuple[int, str | None]:
    """The largest token id in the shards, and the first file holding it (one read of input_ids)."""
    top, where = -1, None
    for f in files:
        for batch in open_parquet(f).iter_batches(batch_size=4096, columns=["input_ids"]):
            m = pc.max(pc.list_flatten(batch.column("input_ids"))).as_py()
            if m is not None and m > top:
                top, where = m, f
    return top, where


def tokens_of(data_dir) -> DataDir:
    """The directory a score stage reads, refused unless it is one stage's complete output holding
    tokens: tokenized data, or weighted data (score's or weigh's output), whose ids are the same
    sequences (its values and weights are not read)."""
    try:
        d = DataDir(data_dir).require(hint="tokenize first (`entroweight tokenize`)")
        if d.kind not in ("sequences", "weighted"):
            raise DataDirError(f"{d.location} holds the output of `{d.stage}`, not tokens to score")
        return d.require_documents().require_one_config()
    except DataDirError as e:
        raise StageError(str(e)) from None


class ScoreStage(Stage):
    """Constructed from its options alone (no I/O): the driver's checks run in `prepare()`, the first
    thing planning does; the tokenizer and the model load in `setup()`, on the worker."""

    name = "score"
    _heavy = ("_tok",)
    #: a progress bar of rows per shard (the local engine, whose workers share the terminal)
    row_progress: bool = False

    def __init__(
        self,
        data_dir: str | Path,
        scorer: str | Scorer,
        scorer_options: dict[str, Any] | None = None,
        weighting: WeighConfig | None = None,
        with_entropy: bool = True,
        tokenizer: str | None = None,
        batch_tokens: int | None = None,
        cpus_per_worker: int = 1,
        steps: list[DocumentStep] | None = None,
        limit: int | None = None,
        rows: int | None = None,
    ):
        if cpus_per_worker < 1:
            raise StageError(f"--cpus-per-worker must be at least 1, not {cpus_per_worker}")
        if batch_tokens is not None and batch_tokens < 1:
            raise StageError(f"--batch-tokens must be at least 1, not {batch_tokens}")
        #: CPUs each worker asks for (its tokenizing/aligning/writing threads beside the model)
        self.cpus_per_worker = cpus_per_worker
        #: token budget per forward (rows × width); None: the scorer's batch_size rows. Speed, not values
        self.batch_tokens = batch_tokens
        self.data_dir = str(data_dir)
        self.weighting = weighting or WeighConfig()
        self.with_entropy = with_entropy
        self.steps = list(steps or [])
        self.tokenizer_option = tokenizer
        #: score the first `limit` input shards only (a workflow's limit_shards); raising it later
        #: scores the rest incrementally: not part of the config
        self.limit = limit
        if rows is not None and rows < 1:
            raise StageError(f"rows must be at least 1, not {rows}")
        #: score the first `rows` rows of each shard only (a sample for an expensive scorer: each
        #: shard's input is that row range, so verify checks the rows against it); changes the output
        self.rows = rows
        self._scorer_spec = (scorer, scorer_options or {})

    # -- driver side
    @cached_property
    def data(self) -> DataDir:
        return tokens_of(self.data_dir)

    @cached_property
    def input_meta(self) -> dict[str, Any]:
        return self.data.metadata

    @cached_property
    def scorer(self) -> Scorer:
        scorer, options = self._scorer_spec
        return scorer if isinstance(scorer, Scorer) else make_scorer(scorer, **options)

    def _prepare(self) -> None:
        meta = self.input_meta
        if meta.get("padding_side", "left") != "left":
            raise StageError(
                f"{self.data.files[0]} is {meta['padding_side']}-padded; the scorers read left padding"
            )
        sha = meta["tokenizer_sha256"]
        try:  # --tokenizer, else the copy the data carries; either checked against the data's sha256
            path = data_tokenizer(self.data_dir, sha, self.tokenizer_option)
        except TokenizerError as e:
            raise StageError(str(e)) from None
        self.tokenizer_path = storage.key(path) if path else None  # carried forward into --out
        # its bytes travel with the stage: workers may share no disk with the driver
        self.tokenizer_json = path.read_bytes() if path else None
        needs_tok = self.scorer.needs_data_tokenizer
        self._tok = load_tokenizer(path) if path and (self.tokenizer_option or needs_tok) else None
        if needs_tok and self._tok is None:
            raise StageError(
                f"the {self.scorer.name} scorer reads the data's text and {self.data_dir} carries no tokenizer "
                "(it was made before data carried one): pass --tokenizer (the tokenizer.json that tokenized it)"
            )
        try:
            self.scorer.check_data_tokenizer(sha, self._tok)
        except ScorerError:
            if self._tok is not None or path is None:
                raise
            # the model's tokenizer is another file: compare the vocabularies with the tokenizer the
            # data carries, as with --tokenizer (the refusal asked for --tokenizer the data had)
            self._tok = load_tokenizer(path)
            self.scorer.check_data_tokenizer(sha, self._tok)
        self._check_vocab()
        self._check_context()
        check_steps(self.steps, meta)

    def _check_vocab(self) -> None:
        """A model must have a row for every id of the data: refused here, not as an IndexError per shard.
        The data's ids are below its tokenizer's size, so the scan runs only when the model is smaller."""
        model_vocab = self.scorer.vocab_size()
        if model_vocab is None or model_vocab >= int(self.input_meta["vocab_size"]):
            return
        top, where = max_id(self.data.files)
        if top >= model_vocab:
            raise StageError(
                f"{where} holds token id {top}, but the {self.scorer.name} scorer's model reads ids below "
                f"{model_vocab} only (its vocab_size): score with a model of the data's tokenizer "
                f"({self.input_meta['vocab_size']} ids)"
            )

    def _check_context(self) -> None:
        """Rows no wider than the model reads: refused here, not by the model in every shard after it
        loaded. The data's width is its n_ctx (every row is padded or packed to it)."""
        limit, width = self.scorer.max_row_tokens(), int(self.input_meta["n_ctx"])
        if limit is not None and width > limit:
            raise StageError(
                f"{self.data.location} holds rows of {width} tokens (n_ctx), longer than the "
                f"{self.scorer.name} scorer's model reads ({limit}, its n_ctx): tokenize with --n-ctx "
                f"{limit} or less, or score with a model of a longer context"
            )

    def plan_inputs(self) -> list[ShardInput]:
        self.prepare()
        inputs = part_inputs(self.data, "sequences")
        self.lineages = part_lineages(self.data)  # what each input shard's documents went through
        if self.rows is not None:
            inputs = [i.model_copy(update={"stop": self.rows}) for i in inputs]
        return inputs[: self.limit] if self.limit else inputs

    def input_universe(self, planned: list[ShardInput]) -> set[str]:
        return set(part_locations(self.data))  # with `limit`: the parts not yet scored too

    def carry(self, out_dir) -> None:
        if self.tokenizer_path is not None:  # the weighted data stays self-describing
            carry_tokenizer(self.tokenizer_path, out_dir)

    def resources(self) -> dict[str, float]:
        # one accelerator per worker: one model copy on each, never several on one
        return {
            "num_cpus": self.cpus_per_worker,
            "num_gpus": 1 if self.scorer.device.startswith("cuda") else 0,
        }

    def config(self) -> dict[str, Any]:
        # batch size and device change speed, not values (to float tolerance): not hashed
        return {
            "input_tokenizer_sha256": self.input_meta["tokenizer_sha256"],
            "n_ctx": self.input_meta["n_ctx"],
            "packed": self.input_meta.get("packed", False),
            **self.scorer.config(),
            **weighing_metadata(self.weighting, self.steps),
            "with_entropy": self.with_entropy,
            # only when set: the configs (and shards) of unlimited scores stay what they were
            **({"rows": self.rows} if self.rows is not None else {}),
        }

    def file_metadata(self) -> dict[str, Any]:
        # the tokens' facts only: the metadata of a weighted input's scorer and weighting is not ours
        inherited = {k: v for k, v in self.input_meta.items() if k in FileMetadata.model_fields}
        return {
            **inherited,
            "stage": self.name,
            "config_hash": self.config_hash,
            "code_version": __version__,
            **self.scorer.config(),
            **self.scorer.metadata(),
            **weighing_metadata(self.weighting, self.steps),
            "value_convention": "value i is about predicting token i; pads 0 (docs/scoring.md)",
        }

    # -- worker side
    def setup(self) -> None:
        self.prepare()  # done on the driver when it planned the run: the pickled stage carries it
        check_device(self.scorer.device)
        keep_freed_memory()  # a worker's batches reuse freed memory, not fresh pages (allocator.py)
        if getattr(self, "_tok", None) is None:
            self._tok = None
        if self._tok is None and self.tokenizer_json is not None:
            self._tok = tokenizer_from_bytes(self.tokenizer_json, self.tokenizer_path)
        self.scorer.setup(self._tok)

    def segment_rows(self) -> int:
        return max(MIN_SEGMENT_ROWS, SEGMENT_TOKENS // max(int(self.input_meta["n_ctx"]), 1))

    def process(self, task: ShardTask) -> ShardManifest:
        (inp,) = task.inputs
        source = read_input(inp)
        rows = source.metadata.num_rows
        # rows as they are scored, not only when the shard ends (mininterval 0: a batch takes seconds)
        bar = tqdm(
            total=rows,
            unit="row",
            desc=inp.uri.rsplit("/", 1)[-1],
            leave=False,
            mininterval=0,
            disable=not self.row_progress,
        )
        batching = Batching(batch_tokens=self.batch_tokens, on_rows=bar.update)
        computed = real = first = 0
        stats: dict[str, Any] = {}
        with (
            bar,
            WeightedShardWriter(
                self, task, self.file_metadata(), self.weighting, self.with_entropy, self.steps
            ) as out,
        ):
            # the sequences only: a weighted input's values and weights are not read
            columns = [n for n in source.schema_arrow.names if n not in WEIGHTED_COLUMNS]
            batches = source.iter_batches(batch_size=self.segment_rows(), columns=columns)
            if inp.stop is not None:  # a sample: the shard's first rows only
                batches = _first_rows(batches, inp.stop)
            for rows, n_context in segments(batches) if self.scorer.reads_documents else _alone(batches):
                ids = matrix(rows.column("input_ids"))
                n_pad = rows.column("n_pad").to_numpy().astype(np.int64)
                if self.scorer.reads_documents:
                    continues = rows.column(ROW_IN_DOC).to_numpy() > 0
                    scored = self.scorer.score(ids, n_pad, batching, continues=continues)
                else:
                    scored = self.scorer.score(ids, n_pad, batching)
                batch = rows.slice(n_context)  # the rows of the segment, after their left context
                values = scored.values[n_context:]
                excluded = None if scored.excluded is None else scored.excluded[n_context:]
                bar.update(first + batch.num_rows - bar.n)  # for scorers that report no batches
                computed += scored.computed
                real += scored.real
                add_stats(stats, scored.stats)
                out.add(batch, values, excluded, first)
                first += batch.num_rows
            from entroweight.scorers.forward import resolved_device

            return out.finish(
                {
                    "scorer": self.scorer.name,
                    # of the row positions the forwards computed, the share that were padding (for
                    # cross_tokenizer, of its windows of model tokens)
                    "pad_fraction": round(1 - real / computed, 4) if computed else None,
                    "batch_tokens": self.batch_tokens,
                    # resolved here, in the worker that ran the model (a driver may have no accelerator)
                    "device": resolved_device(self.scorer.device),
                    "dtype": getattr(self.scorer, "dtype", None),
                    **{k: v.as_dict() for k, v in stats.items()},
                }
            )


def _first_rows(batches: Iterator[pa.RecordBatch], n: int) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        if n <= 0:
            return
        yield batch.slice(0, n)
        n -= batch.num_rows


def _alone(batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[pa.RecordBatch, int]]:
    return ((b, 0) for b in batches)


def segments(batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[pa.RecordBatch, int]]:
    """(rows, n_context) for a scorer that reads documents: the shard's rows in order, each segment
    ending where a document starts (the rows of a document that began in it are held back for the
    next one), so a document shorter than a segment is scored whole. A segment that begins inside a
    document (one longer than a segment, or packed windows) comes after `n_context` = 1 row of left
    context, the row before it, scored again and not written. Memory: at most two segments' rows."""
    held: pa.RecordBatch | None = None
    previous: pa.RecordBatch | None = None  # the last row of the segment before

    def with_context(rows: pa.RecordBatch) -> tuple[pa.RecordBatch, int]:
        nonlocal previous
        begins_inside = rows.column(ROW_IN_DOC)[0].as_py() > 0
        last, n_context = rows.slice(rows.num_rows - 1), 0
        if begins_inside and previous is not None:
            rows, n_context = pa.concat_batches([previous, rows]), 1
        previous = last
        return rows, n_context

    for batch in batches:
        rows = batch if held is None else pa.concat_batches([held, batch])
        held = None
        if rows.num_rows == 0:
            continue
        starts = document_starts(rows.column(ROW_IN_DOC).to_numpy())
        cut = int(starts[-1]) if len(starts) and starts[-1] > 0 else rows.num_rows
        if cut < rows.num_rows:
            held = rows.slice(cut)
        yield with_context(rows.slice(0, cut))
    if held is not None:
        yield with_context(held)


__all__ = ["ScoreStage", "ScorerError", "segments"]
