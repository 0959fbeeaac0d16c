"""A stage's output directory made from part of another: what a test needs when it wants a smaller or
edited dataset that is still a committed stage output (DataDir reads it like the original)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from entroweight.schemas.datadir import DataDir
from entroweight.schemas.manifest import SHARDS_FILE, STAGE_FILE, manifest_name
from entroweight.transforms.writer import sha256_file


def stage_subset(
    src: Path,
    dst: Path,
    shards: int | None = None,
    rows: int | None = None,
    edit: Callable[[pa.Table], pa.Table] | None = None,
) -> Path:
    """The first `shards` committed parts of `src` (all when None), each cut to its first `rows` rows
    and passed through `edit`, as the committed output of the same stage in `dst`: the stage record,
    the carried tokenizer, each part with its manifest (sha256, size and rows updated), the registry."""
    dst.mkdir(parents=True, exist_ok=True)
    if (src / ".tokenizer").is_dir():
        shutil.copytree(src / ".tokenizer", dst / ".tokenizer", dirs_exist_ok=True)
    shutil.copy(src / STAGE_FILE, dst / STAGE_FILE)
    registry = {}
    for part in DataDir(src).parts[:shards]:
        t = pq.read_table(part.location)
        metadata = t.schema.metadata
        if rows is not None:
            t = t.slice(0, rows)
        if edit is not None:
            t = edit(t)
            metadata = t.schema.metadata or metadata
        f = dst / part.name
        pq.write_table(t.replace_schema_metadata(metadata), f, compression="zstd")
        m = part.manifest.model_copy(
            update={
                "output_sha256": sha256_file(f),
                "output_bytes": f.stat().st_size,
                "rows_out": t.num_rows,
                "output_row_groups": None,
            }
        )
        (dst / manifest_name(m.shard)).write_text(m.model_dump_json())
        registry[m.inputs[0].key] = m.shard
    (dst / SHARDS_FILE).write_text(json.dumps(registry))
    return dst
