"""Duplicate document ids over a run's whole input, decided as a map and a group (any engine runs them).

map (one input each, `input_ids`): the id and row of each document the reader keeps (the same reader,
so the same ids and the same rejects as tokenize: `DocumentReader`), with the input file's rank in the
run's order, cut into `parts` partitions by a hash of the id. group (one partition each, `repeats`):
the rows sorted by (id, rank, row); of each id the first is kept, and every later copy is listed with
where that first one is. A partition holds about 1/`parts` of the ids, never all of them: `partitions`
sizes it by the bytes of input. What comes back is the later copies alone (`LATER`).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from entroweight.schemas.manifest import ShardInput

from .sources import DocumentReader

#: the rows a map gives a partition: a document's id, its input file's rank in the run's order, its row
ID_ROWS = pa.schema([("id", pa.string()), ("rank", pa.int32()), ("row", pa.int64())])
#: what a partition finds: each later copy (rank, row) and its first copy (first_rank, first_row)
LATER = pa.schema(
    [("rank", pa.int32()), ("row", pa.int64()), ("first_rank", pa.int32()), ("first_row", pa.int64())]
)
#: bytes of input (compressed, as stored) per partition: about 1-2 M documents' ids, ~100-200 MB to sort
BYTES_PER_PARTITION = 2 << 30


def partitions(inputs: list[ShardInput]) -> int:
    """How many partitions the ids of `inputs` are cut into: one per BYTES_PER_PARTITION of input."""
    sizes = {i.uri: i.size or 0 for i in inputs}  # a parquet file's row ranges share its size
    return max(1, -(-sum(sizes.values()) // BYTES_PER_PARTITION))


def item(inp: ShardInput, rank: int) -> str:
    """One map's work as a line of text (an engine's element): the input and its file's rank."""
    return json.dumps({"input": inp.model_dump(), "rank": rank})


def input_ids(line: str, text_column: str, parts: int) -> list[tuple[int, pa.Table]]:
    """The map: (partition, ID_ROWS table) of the documents of one input (`item`), by a hash of the id."""
    d = json.loads(line)
    inp, rank = ShardInput.model_validate(d["input"]), d["rank"]
    pieces = []  # Arrow, not Python strings: a map holds its input's ids at ~50 bytes each
    try:
        for piece in DocumentReader(inp, text_column, rows=True):
            pieces.append(pa.table([piece.column("id"), piece.column("row")], names=["id", "row"]))
    except (ValueError, OSError):  # a file that cannot be read (to its end): its rows read so far, the
        # ones a shard of it may commit; the shard fails naming the file, and the other inputs go on
        pass
    if not pieces:
        return []
    ids = pa.concat_tables(pieces)
    table = pa.table(
        [ids.column("id"), pa.array(np.full(ids.num_rows, rank, np.int32)), ids.column("row")], schema=ID_ROWS
    )
    if parts == 1:
        return [(0, table)]
    hashes = (zlib.crc32(i.encode()) % parts for i in table.column("id").to_pylist())
    part = np.fromiter(hashes, np.int64, table.num_rows)
    return [(int(p), table.filter(pa.array(part == p))) for p in np.unique(part)]


def repeats(part: int, tables: list[pa.Table]) -> pa.Table:
    """The group: the later copies (LATER) among one partition's ids; the first in (rank, row) is kept."""
    tables = [t for t in tables if t is not None and t.num_rows]
    if not tables:
        return LATER.empty_table()
    t = pa.concat_tables(tables).sort_by([("id", "ascending"), ("rank", "ascending"), ("row", "ascending")])
    n = t.num_rows
    ids = t.column("id")
    later = np.zeros(n, bool)
    if n > 1:
        later[1:] = pc.equal(ids.slice(1), ids.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    at = np.arange(n)
    first = np.maximum.accumulate(np.where(later, 0, at))  # each row's run's first row
    rank, row = t.column("rank").to_numpy(), t.column("row").to_numpy()
    return pa.table([rank[later], row[later], rank[first[later]], row[first[later]]], schema=LATER)


def first_copy(uri: str, row: int) -> str:
    """Where a first copy is, as a rejected or counted later copy names it."""
    return f"{uri} row {row}"


def each_input(inputs: list[ShardInput], order: list[str]) -> Iterator[tuple[ShardInput, int]]:
    """Each input with its file's rank in `order` (the run's stable order of files)."""
    rank = {uri: i for i, uri in enumerate(order)}
    for inp in inputs:
        yield inp, rank[inp.uri]
