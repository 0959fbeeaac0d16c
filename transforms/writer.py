"""Atomic writes: a file appears under its final name complete, or not at all."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TMP_MARK = ".tmp-"
# zstd at a moderate level: ~1.6 B per real left-padded uint16 id; pads compress to almost nothing.
PARQUET_OPTIONS = dict(compression="zstd", compression_level=6, use_dictionary=False, write_statistics=False)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _tmp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")


def _commit(tmp: Path, final: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)  # atomic on POSIX within one filesystem


def remove_stale_tmp(directory: str | Path) -> int:
    """Delete temp files a killed run left behind; returns how many."""
    n = 0
    for p in Path(directory).rglob(f"*{TMP_MARK}*"):
        p.unlink(missing_ok=True)
        n += 1
    return n


class AtomicParquetWriter:
    """Streams record batches into `path` through a temp file; renames it on a clean close."""

    def __init__(self, path: str | Path, schema: pa.Schema, row_group_size: int = 1024):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = _tmp_name(self.path)
        self.schema = schema
        self.row_group_size = row_group_size
        self._writer = pq.ParquetWriter(self.tmp, schema, **PARQUET_OPTIONS)
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
        """Finish, rename into place, return the sha256 of the final file."""
        self._flush()
        self._writer.close()
        _commit(self.tmp, self.path)
        return sha256_file(self.path)

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()


def write_table_atomic(table: pa.Table, path: str | Path) -> str:
    with AtomicParquetWriter(path, table.schema) as w:
        for batch in table.to_batches():
            w.write(batch)
        return w.close()


def write_bytes_atomic(data: bytes, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        tmp.write_bytes(data)
    except BaseException:  # disk full, killed: leave no half-written temp file behind
        tmp.unlink(missing_ok=True)
        raise
    _commit(tmp, path)


def write_text_atomic(text: str, path: str | Path) -> None:
    write_bytes_atomic(text.encode("utf-8"), path)


def write_json_atomic(obj: dict, path: str | Path) -> None:
    write_text_atomic(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", path)
