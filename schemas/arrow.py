"""Arrow schemas of documents, sequences, weighted sequences and rejects."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from entroweight import storage

from .weighted import ENTROPY, EXCLUDED, EXCLUDED_TYPE, SURPRISAL, WEIGHT, weight_type

# The one key-value entry every output parquet file carries: JSON of FileMetadata.
METADATA_KEY = b"entroweight"

DOCUMENT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("url", pa.string(), nullable=True),
    ]
)

REJECT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string(), nullable=True),
    ]
)

# Reasons a document is rejected; the manifest counts them by these names.
REJECT_REASONS = (
    "empty",  # no visible text: empty, or whitespace and characters that show nothing (sources.is_blank)
    "invalid_utf8",  # bytes that are not UTF-8, or lone surrogates
    "missing_text",  # no text column, or a null text
    "not_string",  # text of another type
    "invalid_json",  # a jsonl line that does not parse as a JSON object
    "duplicate_id",  # an id seen before in the same shard (with --reject-duplicates)
    "low_weight",  # a document whose mean weight is below --min-mean-weight (score, weigh)
)


# The longest row a sequence may hold (n_ctx): 2**20 tokens, above the longest context of today's
# models; a wider row is a mistyped --n-ctx, whose every row (n_ctx ids, weights and values) would
# exhaust memory while its shard is written
MAX_N_CTX = 2**20


def check_n_ctx(n_ctx: int, name: str = "--n-ctx") -> int:
    """`n_ctx` when it is a row width the sequences can hold (2 to MAX_N_CTX), else ValueError."""
    if not 2 <= n_ctx <= MAX_N_CTX:
        raise ValueError(f"{name} must be from 2 to {MAX_N_CTX:,} (2**20) tokens, not {n_ctx:,}")
    return n_ctx


def ids_type(vocab_size: int) -> pa.DataType:
    """uint16 ids when the vocabulary fits (half the bytes), int32 otherwise."""
    return pa.uint16() if vocab_size <= 2**16 else pa.int32()


# How many rows before this one hold part of its document (of a packed row: of its first document,
# `doc_id`): 0 where the document starts. Rows of one document are recognised by this, written at
# tokenize time, never by equal ids (two documents may share an id).
ROW_IN_DOC = "row_in_doc"


class DocumentRowsMissing(ValueError):
    """Sequences written before rows recorded their place in their document (`row_in_doc`)."""


def require_row_in_doc(schema: pa.Schema, where: str) -> None:
    """Refuse sequences without `row_in_doc`: their documents could only be told apart by equal ids,
    which glues two documents that share an id into one (the message says what to do)."""
    if ROW_IN_DOC not in schema.names:
        raise DocumentRowsMissing(
            f"{where} was written by an older entroweight: its rows do not record where each document "
            f"starts (the `{ROW_IN_DOC}` column); tokenize the sources again (and score that output)"
        )


def document_starts(row_in_doc) -> np.ndarray:
    """Indices of the rows where a document starts (its first row), from the `row_in_doc` column."""
    return np.flatnonzero(np.asarray(row_in_doc) == 0)


# Of a packed row: the documents it holds a part of, in order (its first is `doc_id`).
DOC_IDS = "doc_ids"


def document_count(rows: pa.RecordBatch | pa.Table) -> int:
    """Documents that start among these rows: the unit of every manifest's `docs_in` / `docs_out`,
    so that over a shard's rows it is the count tokenize recorded while writing them, and the counts
    chain from stage to stage (`documents_starting` says how)."""
    held = None
    if DOC_IDS in rows.schema.names:
        held = pc.list_value_length(rows.column(DOC_IDS)).to_numpy(zero_copy_only=False)
    return documents_starting(rows.column(ROW_IN_DOC).to_numpy(), held)


def documents_starting(row_in_doc, held=None) -> int:
    """Documents that start among rows of these `row_in_doc` values. A row of one document starts it
    where its `row_in_doc` is 0. A packed row (`held`: how many documents each one's `doc_ids` holds)
    starts every document it holds but the first when that one goes on from the row before
    (`row_in_doc` > 0). Rows are not documents there: a row holds several, and a document spans rows."""
    starts_here = np.asarray(row_in_doc) == 0
    if held is None:
        return int(starts_here.sum())
    return int(np.sum(held) - (~starts_here).sum())


def sequence_schema(vocab_size: int, packed: bool = False) -> pa.Schema:
    fields = [
        pa.field("seq_id", pa.string(), nullable=False),
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field(ROW_IN_DOC, pa.int32(), nullable=False),
        pa.field("input_ids", pa.list_(ids_type(vocab_size)), nullable=False),
        pa.field("n_pad", pa.int32(), nullable=False),
        pa.field("n_bytes", pa.int64(), nullable=False),
    ]
    if packed:
        fields.append(pa.field(DOC_IDS, pa.list_(pa.string()), nullable=False))
    return pa.schema(fields)


def weighted_sequence_schema(
    vocab_size: int,
    packed: bool = False,
    weight_dtype: str = "float16",
    with_entropy: bool = True,
    with_surprisal: bool = False,
) -> pa.Schema:
    """A sequence plus `entropy` (raw scorer output), `excluded` (real positions the scorer gave no
    value) and `weight` (0 on pads and excluded positions); the codec is schemas/weighted.py. A
    synthetic corpus (the synthesize stage) has `surprisal` beside its entropy: the stored sequences
    carry it through the weighing as they carry their ids (`weighted_batch`)."""
    schema = sequence_schema(vocab_size, packed)
    if with_entropy:
        schema = schema.append(pa.field(ENTROPY, pa.list_(pa.float32()), nullable=False))
    if with_surprisal:
        schema = schema.append(pa.field(SURPRISAL, pa.list_(pa.float32()), nullable=False))
    schema = schema.append(pa.field(EXCLUDED, pa.list_(EXCLUDED_TYPE), nullable=False))
    return schema.append(pa.field(WEIGHT, pa.list_(weight_type(weight_dtype)), nullable=False))


# the columns a weighted sequence adds to a sequence
WEIGHTED_COLUMNS = (ENTROPY, EXCLUDED, WEIGHT)


def with_file_metadata(schema: pa.Schema, metadata: dict) -> pa.Schema:
    return schema.with_metadata({METADATA_KEY: json.dumps(metadata, sort_keys=True).encode()})


def read_file_metadata(path) -> dict:
    """The `entroweight` metadata of a parquet file (local or a URL), or {} when it has none."""
    with storage.open_input(path) as f:
        return schema_metadata(pq.read_schema(f))


def schema_metadata(schema: pa.Schema | None) -> dict:
    """The `entroweight` metadata an Arrow schema carries, or {} when it has none."""
    raw = ((schema.metadata or {}) if schema is not None else {}).get(METADATA_KEY)
    return json.loads(raw) if raw else {}
