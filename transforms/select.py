"""Document steps after weighing: drop whole documents by their weights, counted as rejects.

A step sees the weighted batches of a shard in order and returns the rows it keeps and a reject record
per document it drops. The stages that write weighted shards (score, weigh) run a list of them after
the one weighing path, so a new step is a class here and a flag: no stage changes.

A document starts at a row whose `row_in_doc` is 0 and goes on over the rows after it (the tokenizer
writes a split document's rows one after another and counts them), never recognised by equal ids:
two documents may share an id. A document that continues past a batch is held back until its last
row arrives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import pyarrow as pa

from entroweight.schemas.arrow import ROW_IN_DOC, document_starts
from entroweight.schemas.weighted import EXCLUDED, excluded_mask, weighable, weights_matrix


class StepError(ValueError):
    """A step that cannot run on this data (e.g. on packed rows); the message says why."""


class DocumentStep(ABC):
    """Keeps or drops whole documents of weighted rows; `config()` is hashed into the stage's config."""

    name: str = "step"

    @abstractmethod
    def config(self) -> dict[str, Any]: ...

    def check(self, meta: dict[str, Any]) -> None:  # noqa: B027 - optional
        """Refuse data this step cannot apply to (StepError), before anything is written."""

    @abstractmethod
    def feed(self, batch: pa.RecordBatch, source: str) -> tuple[pa.Table, list[dict]]:
        """The rows kept so far (whole documents) and the rejects (REJECT_SCHEMA dicts)."""

    @abstractmethod
    def finish(self, source: str) -> tuple[pa.Table | None, list[dict]]:
        """What is held back at the end of the shard."""


class MinMeanWeight(DocumentStep):
    """Drop documents whose mean weight over their weighted tokens (real, not excluded) is below
    `threshold`, all their rows; a document with no weighted token has mean 0."""

    name = "min_mean_weight"
    reason = "low_weight"

    def __init__(self, threshold: float):
        if not 0.0 <= threshold <= 1.0:
            raise StepError(f"--min-mean-weight must be in [0, 1] (weights are), not {threshold}")
        self.threshold = float(threshold)
        self._held: pa.Table | None = None

    def config(self) -> dict[str, Any]:
        return {"min_mean_weight": self.threshold}

    def check(self, meta: dict[str, Any]) -> None:
        if meta.get("packed"):
            raise StepError(
                "--min-mean-weight drops whole documents, and a packed row holds parts of several: "
                "tokenize without --pack to filter documents by weight"
            )

    def feed(self, batch: pa.RecordBatch, source: str) -> tuple[pa.Table, list[dict]]:
        table = pa.Table.from_batches([batch])
        if self._held is not None:
            table = pa.concat_tables([self._held, table])
        return self._select(table, source, final=False)

    def finish(self, source: str) -> tuple[pa.Table | None, list[dict]]:
        if self._held is None:
            return None, []
        table, self._held = self._held, None
        return self._select(table, source, final=True)

    def _select(self, table: pa.Table, source: str, final: bool) -> tuple[pa.Table, list[dict]]:
        n = table.num_rows
        starts = document_starts(table.column(ROW_IN_DOC).to_numpy()) if n else np.zeros(0, int)
        if n and (not len(starts) or starts[0] != 0):
            raise StepError(f"{source}: its rows begin inside a document (row_in_doc of the first row > 0)")
        if not final and len(starts):  # the last document may go on in the next batch
            cut = int(starts[-1])
            self._held, table, starts = table.slice(cut), table.slice(0, cut), starts[:-1]
        doc_ids = table.column("doc_id").to_pylist()
        if table.num_rows == 0:
            return table, []
        weights = weights_matrix(table.column("weight"))
        width = weights.shape[1]
        mask = weighable(
            table.column("n_pad").to_numpy(), width, excluded_mask(table.column(EXCLUDED), width)
        )
        sums = np.add.reduceat((weights * mask).sum(axis=1, dtype=np.float64), starts)
        counts = np.add.reduceat(mask.sum(axis=1), starts)
        rows = np.diff(np.r_[starts, table.num_rows])
        means = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
        keep_doc = means >= self.threshold
        rejects = [
            {
                "id": str(doc_ids[s]),
                "source": source,
                "reason": self.reason,
                "detail": f"mean weight {m:.4f} < {self.threshold:g} over {int(c)} token(s) in {int(r)} row(s)",
            }
            for s, m, c, r, k in zip(starts, means, counts, rows, keep_doc, strict=True)
            if not k
        ]
        return table.filter(pa.array(np.repeat(keep_doc, rows))), rejects


def document_steps(min_mean_weight: float | None = None) -> list[DocumentStep]:
    """The steps the options ask for, in the order they run: one mapping for the commands' flags
    (`--min-mean-weight`) and a workflow's score step (`min_mean_weight`)."""
    return [MinMeanWeight(min_mean_weight)] if min_mean_weight is not None else []
