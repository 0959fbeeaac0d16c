"""Values derived from two scored directories of the same tokens, with no model run.

`difference` (A − B) is Rho-1's excess loss from stored losses: a causal model's per-token loss (A)
minus a reference model's on the same tokens (B), e.g. a large model's losses kept on the small
tokenizer by `cross_tokenizer` with the `sum` aggregate, so that one scoring of the large model serves
its own weights and the excess. Both must be in one unit (nats against nats): the difference of values
in two units means nothing, and `cross_tokenizer`'s `mean` (a model token's whole loss on each of its
bytes) is not a per-token loss in nats (docs/scoring.md). A position either side excluded is excluded,
with value 0. The weigh stage (pipelines/weigh.py) reads the two directories through DataDir, checks
that every row holds the same tokens, and weighs the result through the one weighing path.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

OPS = ("difference",)


class DeriveError(ValueError):
    """Two directories whose values cannot be combined; the message says why."""


def derived_unit(
    op: str, unit_a: str | None, unit_b: str | None, aggregates: tuple[str | None, ...] = ()
) -> str | None:
    """The unit of `op`'s values; refused (DeriveError) when A's and B's recorded units differ, or when
    either side's values are `cross_tokenizer` losses regrouped by `mean` (`aggregates`: each side's
    recorded aggregate): a model token's whole loss on each small token it touches, not that token's
    share of the nats."""
    if op not in OPS:
        raise DeriveError(f"op must be one of {', '.join(OPS)}, not {op!r}")
    if "mean" in aggregates:
        raise DeriveError(
            f"the {op} needs per-token losses that add up to the model's nats: a cross_tokenizer score "
            "with aggregate: mean gives each small token its model token's whole loss; score it with "
            "aggregate: sum"
        )
    if unit_a and unit_b and unit_a != unit_b:
        raise DeriveError(
            f"the {op} of values in {unit_a!r} and in {unit_b!r} means nothing: combine values of one "
            "unit (a cross_tokenizer reference in nats needs aggregate: sum)"
        )
    unit = unit_a or unit_b
    return f"{unit}_difference" if unit else None


def same_tokens(a: pa.RecordBatch, b: pa.RecordBatch, where: str) -> None:
    """Refuse (DeriveError) rows of A and B that are not the same sequences with the same tokens."""
    for column in ("seq_id", "n_pad", "input_ids"):
        if not a.column(column).equals(b.column(column)):
            raise DeriveError(
                f"{where}: the two directories hold different {column} in the same rows: they were not "
                "scored from the same tokenized data"
            )


def combine(
    op: str,
    values_a: np.ndarray,
    values_b: np.ndarray,
    excluded_a: np.ndarray | None,
    excluded_b: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """(values, excluded) of `op` over A's and B's (rows, width) values: float32, 0 where excluded."""
    if op not in OPS:
        raise DeriveError(f"op must be one of {', '.join(OPS)}, not {op!r}")
    values = np.asarray(values_a, dtype=np.float32) - np.asarray(values_b, dtype=np.float32)
    masks = [np.asarray(m, dtype=bool) for m in (excluded_a, excluded_b) if m is not None]
    excluded = np.logical_or.reduce(masks) if masks else None
    if excluded is not None:
        values[excluded] = 0.0
    return values, excluded
