"""Data contracts: Arrow schemas of every table entroweight writes, and the JSON models beside them.

Imports nothing of ours but the storage layer (entroweight/storage.py); every other layer reads its
column names and metadata keys from here, decodes stored weights with the codec (`schemas.weighted`)
and lists a data directory with `schemas.datadir.DataDir`.
"""

from .arrow import (
    DOCUMENT_SCHEMA,
    METADATA_KEY,
    REJECT_SCHEMA,
    ROW_IN_DOC,
    DocumentRowsMissing,
    document_count,
    document_starts,
    ids_type,
    read_file_metadata,
    require_row_in_doc,
    sequence_schema,
    weighted_sequence_schema,
    with_file_metadata,
)
from .manifest import FileMetadata, ShardManifest, StageRecord, config_hash

__all__ = [
    "DOCUMENT_SCHEMA",
    "METADATA_KEY",
    "REJECT_SCHEMA",
    "ROW_IN_DOC",
    "DocumentRowsMissing",
    "document_count",
    "document_starts",
    "FileMetadata",
    "ShardManifest",
    "StageRecord",
    "config_hash",
    "ids_type",
    "read_file_metadata",
    "require_row_in_doc",
    "sequence_schema",
    "weighted_sequence_schema",
    "with_file_metadata",
]
