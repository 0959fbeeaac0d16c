"""Parquet written atomically, locally or on an object store: a file appears complete or not at all.

The commit itself (temp file and rename, or a held-back upload) is entroweight.storage's; the small
atomic helpers are re-exported here for the stages that write JSON beside their parquet.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from entroweight.storage import (  # noqa: F401 - re-exported for the stages
    TMP_MARK,
    AnyPath,
    AtomicFile,
    remove_stale_tmp,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from entroweight.storage import sha256 as sha256_file  # noqa: F401

# zstd at a moderate level: ~1.6 B per real left-padded uint16 id; pads compress to almost nothing.
PARQUET_OPTIONS = dict(compression="zstd", compression_level=6, use_dictionary=False, write_statistics=False)


class AtomicParquetWriter:
    """Streams record batches into `path` (local or a URL); it appears on a clean close, hashed as written."""

    def __init__(
        self, path: AnyPath, schema: pa.Schema, row_group_size: int = 1024, options: dict | None = None
    ):
        self.sink = AtomicFile(path)
        self.path = self.sink.path
        self.schema = schema
        self.row_group_size = row_group_size
        try:
            self._writer = pq.ParquetWriter(self.sink, schema, **(options or PARQUET_OPTIONS))
        except BaseException:
            self.sink.discard()
            raise
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self.rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        if self._pending_rows >= self.row_group_size:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            table = pa.Table.from_batches(self._pending, schema=self.schema)
            self._writer.write_table(table, row_group_size=self.row_group_size)
            self.rows += table.num_rows
            self._pending, self._pending_rows = [], 0

    def close(self) -> str:
        """Finish, commit under the final name, return the sha256 of the file."""
        self._flush()
        self._writer.close()
        self.sink.commit()
        return self.sink.sha256

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self.sink.discard()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()


def write_table_atomic(table: pa.Table, path: AnyPath) -> tuple[str, int]:
    """`table` as one parquet file, atomically: (its sha256, its size in bytes)."""
    with AtomicParquetWriter(path, table.schema) as w:
        for batch in table.to_batches():
            w.write(batch)
        return w.close(), w.sink.size
