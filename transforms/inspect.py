"""Summaries of an output directory or file: metadata, counts, token and weight statistics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from entroweight import storage
from entroweight.schemas import read_file_metadata
from entroweight.schemas.datadir import data_files
from entroweight.schemas.manifest import DUPLICATES_KEPT, NOT_READ, SHARDS_FILE, sum_lineage
from entroweight.schemas.weighted import (
    ENTROPY,
    EXCLUDED,
    WEIGHT,
    excluded_mask,
    matrix,
    real_mask,
    row_lengths,
    weights_matrix,
)


def parquet_files(path: str | Path) -> list[str]:
    """The committed shards of a stage's output directory (local or a URL), or the one file; a
    directory that is not a stage's output is refused (DataDirError)."""
    return data_files(path, complete=False, hint="inspect reads what tokenize, score and weigh write")[1]


def summarize(path: str | Path) -> dict:
    d, files = data_files(path, complete=False, hint="inspect reads what tokenize, score and weigh write")
    meta = read_file_metadata(files[0])
    schema = pq.read_schema(storage.open_input(files[0]))
    rows = real = total = n_bytes = 0
    per_doc: list[int] = []
    weights: list[np.ndarray] = []
    entropies: list[np.ndarray] = []
    ids_min, ids_max = None, 0
    for f in files:
        table = d.read_table(f)  # a stage's shard checked against its manifest (DataDirError)
        rows += table.num_rows
        if table.num_rows == 0:
            continue
        n_pad = table.column("n_pad").to_numpy()
        lengths = row_lengths(table.column("input_ids"))
        total += int(lengths.sum())
        real_per_row = lengths - n_pad
        real += int(real_per_row.sum())
        per_doc.extend(real_per_row.tolist())
        n_bytes += int(pc.sum(table.column("n_bytes")).as_py())
        flat_ids = pc.list_flatten(table.column("input_ids"))
        lo, hi = pc.min_max(flat_ids).values()
        ids_min = lo.as_py() if ids_min is None else min(ids_min, lo.as_py())
        ids_max = max(ids_max, hi.as_py())
        width = int(lengths.max())
        # statistics over the weighable tokens: real, and not excluded by the scorer
        mask = real_mask(n_pad, width, lengths)
        excluded = excluded_mask(table.column(EXCLUDED), width) if EXCLUDED in table.column_names else None
        if excluded is not None:
            mask &= ~excluded
        if WEIGHT in table.column_names:
            weights.append(weights_matrix(table.column(WEIGHT), width)[mask])
        if ENTROPY in table.column_names:
            entropies.append(matrix(table.column(ENTROPY), np.float32, width=width)[mask])
    out = {
        "files": len(files),
        "schema": {f.name: str(f.type) for f in schema},
        "metadata": meta,
        "rows": rows,
        "tokens": total,
        "real_tokens": real,
        "pad_fraction": round(1 - real / total, 4) if total else 0.0,
        "tokens_per_row": _stats(np.asarray(per_doc, dtype=np.float64)),
        "bytes_of_text": n_bytes,
        "bytes_on_disk": sum(p.size for p in d.parts) if d.parts else sum(storage.size(f) for f in files),
        "id_range": [ids_min, ids_max],
    }
    if real:
        out["disk_bytes_per_real_token"] = round(out["bytes_on_disk"] / real, 3)
    if weights:
        out["weight"] = _stats(np.concatenate(weights))
    if entropies:
        out["entropy"] = _stats(np.concatenate(entropies))
    if d.kind is not None:
        out["kind"] = d.kind
    if d.parts:  # a directory, not one file: its bookkeeping
        *upstream, own = sum_lineage([p.manifest for p in d.parts])
        out["docs_in"] = own["docs_in"]
        out["docs_out"] = own["docs_out"]  # docs_in = docs_out + the rejected, shard by shard
        out["rejected"] = own["rejected"]
        if own.get(NOT_READ):  # a sample (score's first rows of each shard): the documents left unread
            out["not_read"] = own[NOT_READ]
        if own.get("n_truncated"):  # tokenize --overflow truncate cut documents: say how much text is missing
            out["truncated_docs"] = own["n_truncated"]
            out["bytes_dropped"] = own["bytes_dropped"]
        if own.get(DUPLICATES_KEPT):  # documents whose id was seen before in tokenize's input, kept
            out["duplicate_ids_kept"] = own[DUPLICATES_KEPT]
        if upstream:  # the stages before this one: the documents tokenize rejected are still counted
            out["upstream"] = upstream
        if d.registry_lost:  # nothing records what was planned: say so rather than show none missing
            out["missing_shards"] = f"unknown: {d.location} has no {SHARDS_FILE} (run `entroweight verify`)"
        elif d.missing:
            out["missing_shards"] = d.missing
    return out


def _stats(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"n": 0}
    q = np.quantile(x, [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
    return {"n": int(x.size), "mean": round(float(x.mean()), 4), "std": round(float(x.std()), 4)} | {
        k: round(float(v), 4)
        for k, v in zip(("min", "p10", "p25", "p50", "p75", "p90", "max"), q, strict=True)
    }
