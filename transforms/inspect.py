"""Summaries of an output directory or file: metadata, counts, token and weight statistics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from entroweight import storage
from entroweight.schemas import read_file_metadata


def parquet_files(path: str | Path) -> list:
    """The shards of a stage's output directory (local or a URL), from one listing; or the one file."""
    p = storage.path(path)
    names = storage.listing(p)
    if not names and p.is_file():
        return [p]
    files = [p / n for n in sorted(names) if n.startswith("part-") and n.endswith(".parquet")]
    if not files:
        raise FileNotFoundError(f"{path} holds no part-*.parquet file")
    return files


def summarize(path: str | Path) -> dict:
    files = parquet_files(path)
    meta = read_file_metadata(files[0])
    schema = pq.read_schema(storage.open_input(files[0]))
    rows = real = total = n_bytes = 0
    per_doc: list[int] = []
    weights: list[np.ndarray] = []
    entropies: list[np.ndarray] = []
    ids_min, ids_max = None, 0
    for f in files:
        table = pq.read_table(storage.open_input(f))
        rows += table.num_rows
        if table.num_rows == 0:
            continue
        n_pad = table.column("n_pad").to_numpy()
        lengths = pc.list_value_length(table.column("input_ids")).to_numpy()
        total += int(lengths.sum())
        real_per_row = lengths - n_pad
        real += int(real_per_row.sum())
        per_doc.extend(real_per_row.tolist())
        n_bytes += int(pc.sum(table.column("n_bytes")).as_py())
        flat_ids = pc.list_flatten(table.column("input_ids"))
        lo, hi = pc.min_max(flat_ids).values()
        ids_min = lo.as_py() if ids_min is None else min(ids_min, lo.as_py())
        ids_max = max(ids_max, hi.as_py())
        if "weight" in table.column_names:
            w = pc.list_flatten(table.column("weight")).to_numpy(zero_copy_only=False).astype(np.float32)
            if table.schema.field("weight").type.value_type.bit_width == 8:
                w = w / 255.0
            mask = _real_mask(lengths, n_pad)
            weights.append(w[mask])
        if "entropy" in table.column_names:
            e = pc.list_flatten(table.column("entropy")).to_numpy(zero_copy_only=False)
            entropies.append(e[_real_mask(lengths, n_pad)])
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
        "bytes_on_disk": sum(storage.size(f) for f in files),
        "id_range": [ids_min, ids_max],
    }
    if real:
        out["disk_bytes_per_real_token"] = round(out["bytes_on_disk"] / real, 3)
    if weights:
        out["weight"] = _stats(np.concatenate(weights))
    if entropies:
        out["entropy"] = _stats(np.concatenate(entropies))
    manifest_dir = files[0].parent
    manifests = [
        manifest_dir / n
        for n in sorted(storage.listing(manifest_dir))
        if n.startswith(".part-") and n.endswith(".manifest.json")
    ]
    if manifests and storage.key(files[0]) != storage.key(path):  # a directory, not one file
        ms = [json.loads(b) for b in storage.read_many(manifests)]
        rejected: dict[str, int] = {}
        for m in ms:
            for k, v in m.get("rejected", {}).items():
                rejected[k] = rejected.get(k, 0) + v
        out["docs_in"] = sum(m["docs_in"] for m in ms)
        out["rejected"] = rejected
        truncated = sum(m.get("extra", {}).get("n_truncated", 0) for m in ms)
        if truncated:  # tokenize --overflow truncate cut documents: say how much text is missing
            out["truncated_docs"] = truncated
            out["bytes_dropped"] = sum(m.get("extra", {}).get("bytes_dropped", 0) for m in ms)
    return out


def _real_mask(lengths: np.ndarray, n_pad: np.ndarray) -> np.ndarray:
    """Flat boolean mask of non-pad positions for left-padded rows."""
    pos = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return pos >= np.repeat(n_pad, lengths)


def _stats(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"n": 0}
    q = np.quantile(x, [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
    return {"n": int(x.size), "mean": round(float(x.mean()), 4), "std": round(float(x.std()), 4)} | {
        k: round(float(v), 4)
        for k, v in zip(("min", "p10", "p25", "p50", "p75", "p90", "max"), q, strict=True)
    }
