"""Weighted shards (the output of score or weigh) -> a dataset another trainer reads natively, written with that trainer's own library.

- `megatron`: Megatron-LM / NeMo indexed datasets (megatron-core's `IndexedDatasetBuilder`): the
  documents' tokens in `text_document.{bin,idx}` and their weights in `text_document_weight.{bin,idx}`,
  one document per document, in shard order (trainers/megatron.py reads the weights as `loss_mask`).
- `litdata`: LitData chunks (its `BinaryWriter`), one sample per row: `doc_id`, `input_ids`, `weight`.
- `hf`: the Hugging Face hub layout, parquet under `data/` and a README dataset card;
  `datasets.load_dataset(OUT)` and `push_to_hub` read it as is. One row per row, as for litdata.

Every export holds real tokens only (pads dropped) and the weights exactly as stored (float16, or
uint8: schemas/weighted.py); Megatron's indexed dataset has no float16, so float16 weights go to float32
there (every float16 is a float32: no loss). `export.json` records the provenance and the counts.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from entroweight import __version__, output, storage
from entroweight.schemas import ROW_IN_DOC, document_starts
from entroweight.schemas.arrow import documents_starting
from entroweight.schemas.datadir import DataDir, DataDirError, Part, no_rows
from entroweight.schemas.exports import (
    EXPORT_RECORD,
    HF_DATA_FILES,
    MEGATRON_PREFIX,
    hf_data_file,
    megatron_weight_prefix,
)
from entroweight.schemas.manifest import counts_line, sum_lineage
from entroweight.schemas.weighted import WEIGHT, describe_encoding, matrix, real_mask, row_lengths

FORMATS = ("megatron", "litdata", "hf")
# Formats asked for that this install cannot write, and why (checked before anything is read).
UNSUPPORTED = {
    "mds": "MosaicML Streaming (mds) is not supported: mosaicml-streaming 0.13 needs numpy<2.2 and "
    "transformers<5 and pulls a torchvision built for another torch, so it cannot sit beside "
    "entroweight's pinned torch; use --format litdata (LitData streams from object storage too)",
}
EXTRAS = {"megatron": "megatron", "litdata": "litdata", "hf": None}  # pip extra each format needs


class ExportError(ValueError):
    """An export refused before anything is written; the message says what to do."""


@dataclass
class Rows:
    """The real tokens of one shard's rows, flat: row r is `ids[offsets[r]:offsets[r + 1]]`."""

    shard: str
    doc_ids: np.ndarray  # one per row (object array of str)
    row_in_doc: np.ndarray  # one per row: 0 where a document (of a packed row: its first) starts
    offsets: np.ndarray
    ids: np.ndarray
    weight: np.ndarray
    window_docs: list[list[str]] | None  # packed rows: the documents each row holds


@dataclass
class Source:
    path: Path
    parts: list[Part]  # each read once, checked against its manifest's sha256 as it streams
    meta: dict
    weight_dtype: str  # how the shards store their weights ('uint8' or 'float16'), schemas/weighted.py

    @property
    def files(self) -> list[str]:
        return [p.location for p in self.parts]

    @property
    def packed(self) -> bool:
        return bool(self.meta.get("packed"))

    def rows(self, counts: dict | None = None) -> Iterator[Rows]:
        """Each shard's rows in shard order, its bytes checked against its manifest before any of its
        rows is handed on (ShardMismatch otherwise); `counts` (when given) adds up what was read."""
        for part in self.parts:
            rows = read_rows(part, self.packed)
            if counts is not None:
                counts["shards"] = counts.get("shards", 0) + 1
                counts["rows"] = counts.get("rows", 0) + len(rows.doc_ids)
                counts["documents"] = counts.get("documents", 0) + len(self.documents(rows)) - 1
                counts["real_tokens"] = counts.get("real_tokens", 0) + len(rows.ids)
            yield rows

    def documents(self, rows: Rows) -> np.ndarray:
        return document_bounds(rows, self.meta.get("eos_id"))


def open_scored(src: str | Path) -> Source:
    """The weighted shards of `src` (the output of score or weigh, local or a URL) in shard order;
    refuses anything else, and an incomplete run."""
    try:
        d = DataDir(src).require(
            "weighted", complete=True, hint="run `entroweight score` (or `weigh`) on tokenized data first"
        )
        d.require_documents().require_one_config()  # documents by `row_in_doc`; one configuration
    except DataDirError as e:
        raise ExportError(str(e)) from None
    meta = d.metadata
    return Source(d.root, d.parts, meta, d.weight_dtype)


def read_rows(part: Part, packed: bool) -> Rows:
    """One shard's real tokens and their weights as stored (uint8 or float16: the export keeps them).
    The shard's bytes are read once, hashed as they stream and compared with its manifest
    (`Part.read`), then parsed from memory; a shard with no rows gives empty Rows."""
    cols = ["doc_id", ROW_IN_DOC, "input_ids", "n_pad", WEIGHT] + (["doc_ids"] if packed else [])
    t = pq.read_table(pa.BufferReader(part.read()), columns=cols)
    path = part.location
    ids = matrix(t.column("input_ids"))
    width = ids.shape[1]
    n_pad = t.column("n_pad").to_numpy()
    lengths = row_lengths(t.column("input_ids"))
    real = real_mask(n_pad, width, lengths)  # row-major: each row's real tokens, rows in order
    return Rows(
        shard=str(path).rsplit("/", 1)[-1].removesuffix(".parquet"),
        doc_ids=np.asarray(t.column("doc_id").to_pylist(), dtype=object),
        row_in_doc=t.column(ROW_IN_DOC).to_numpy(),
        offsets=np.concatenate([[0], np.cumsum(real.sum(axis=1))]).astype(np.int64),
        ids=ids[real],
        weight=matrix(t.column(WEIGHT), width=width)[real],
        window_docs=t.column("doc_ids").to_pylist() if packed else None,
    )


def document_bounds(rows: Rows, eos_id: int | None) -> np.ndarray:
    """Offsets into `rows.ids` where each document starts, and the end.

    A document starts at a row whose `row_in_doc` is 0 and goes on over the rows after it (a long
    document split over rows), whatever the ids: two documents may share one. Packed rows hold the
    shard's documents joined by eos: a document ends after its eos.
    """
    if len(rows.doc_ids) == 0:  # a shard whose documents were all rejected
        return np.zeros(1, dtype=np.int64)
    if rows.window_docs is None:
        starts = document_starts(rows.row_in_doc)
        if not len(starts) or starts[0] != 0:
            raise ExportError(f"shard {rows.shard}: its first row continues a document (row_in_doc > 0)")
        return np.r_[rows.offsets[starts], rows.offsets[-1]]
    bounds = np.r_[0, np.flatnonzero(rows.ids == eos_id) + 1]
    if bounds[-1] != len(rows.ids):
        bounds = np.r_[bounds, len(rows.ids)]
    n_docs = documents_starting(rows.row_in_doc, [len(d) for d in rows.window_docs])
    if n_docs != len(bounds) - 1:
        raise ExportError(
            f"packed shard {rows.shard}: {len(bounds) - 1} eos-separated runs but {n_docs} documents; "
            "the document boundaries cannot be recovered (a text holding the eos token?)"
        )
    return bounds


# -- the formats


def _megatron(source: Source, out: Path, record: dict) -> None:
    mc = _quiet_import(MEGATRON_MODULE)

    prefix = str(out / MEGATRON_PREFIX)
    weight_prefix = megatron_weight_prefix(prefix)
    # the token dtype GPTDatasetConfig expects (uint16 when the vocabulary fits)
    id_dtype = np.uint16 if source.meta["vocab_size"] <= 2**16 else np.int32
    # Megatron's indexed dataset has no float16: float32 holds every float16 exactly
    weight_dtype = np.uint8 if source.weight_dtype == "uint8" else np.float32
    tokens = mc.IndexedDatasetBuilder(mc.get_bin_path(prefix), dtype=id_dtype)
    weights = mc.IndexedDatasetBuilder(mc.get_bin_path(weight_prefix), dtype=weight_dtype)
    for rows in source.rows(record["counts"]):
        bounds = source.documents(rows)
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            tokens.add_document(rows.ids[s:e], [int(e - s)])
            weights.add_document(rows.weight[s:e], [int(e - s)])
    tokens.finalize(mc.get_idx_path(prefix))
    weights.finalize(mc.get_idx_path(weight_prefix))


# LitData has no empty dataset: its writer writes no index for no item, its reader refuses an index
# without chunks ("No chunks found")
_NO_LITDATA_ROWS = (
    ", and LitData cannot hold an empty dataset: nothing to export; --format hf and megatron write an "
    "empty dataset"
)


def _litdata(source: Source, out: Path, record: dict) -> None:
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(out), chunk_bytes="64MB")
    index = 0
    for rows in source.rows(record["counts"]):
        o = rows.offsets
        for r in range(len(rows.doc_ids)):
            sample = {
                "doc_id": rows.doc_ids[r],
                "input_ids": rows.ids[o[r] : o[r + 1]],
                "weight": rows.weight[o[r] : o[r + 1]],
            }
            writer.add_item(index, sample)
            index += 1
    if index == 0:  # merge() would wait forever for the index a writer of no item never writes
        raise ExportError(no_rows(source.path) + _NO_LITDATA_ROWS)
    writer.done()
    writer.merge()


def _hf(source: Source, out: Path, record: dict) -> None:
    (out / HF_DATA_FILES).parent.mkdir()
    n = len(source.files)
    schema, nbytes = None, 0
    for i, rows in enumerate(source.rows(record["counts"])):
        offsets = pa.array(rows.offsets, pa.int32())
        table = pa.table(
            {
                "doc_id": pa.array(rows.doc_ids.tolist(), pa.string()),
                "input_ids": pa.ListArray.from_arrays(offsets, pa.array(rows.ids)),
                "weight": pa.ListArray.from_arrays(offsets, pa.array(rows.weight)),
            }
        )
        schema, nbytes = table.schema, nbytes + table.nbytes
        pq.write_table(table, out / hf_data_file(i, n), compression="zstd")
    (out / "README.md").write_text(dataset_card(schema, record, nbytes))


def dataset_card(schema: pa.Schema, record: dict, nbytes: int) -> str:
    """A hub dataset card: the YAML header `datasets` and the hub read (a split's size in Arrow bytes
    too: `datasets` warns of a split without it), then the provenance."""
    import datasets

    features = datasets.DatasetInfo(features=datasets.Features.from_arrow_schema(schema))._to_yaml_dict()
    c, meta = record["counts"], record["metadata"]
    header = {
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": HF_DATA_FILES}]}],
        "dataset_info": {
            **features,
            "splits": [{"name": "train", "num_bytes": nbytes, "num_examples": c["rows"]}],
        },
        "tags": ["entroweight", "token-weights"],
    }
    weight = describe_encoding(record["weight_dtype"])
    lines = [
        "---",
        yaml.safe_dump(header, sort_keys=False).rstrip(),
        "---",
        "",
        "# Token-weighted pretraining data",
        "",
        f"Exported by entroweight {__version__} (`entroweight export-data --format hf`). Each row: "
        f"`doc_id`, `input_ids` (real tokens, no padding) and `weight` ({weight}), value i "
        "belonging to token i: weigh the loss of predicting token i by `weight[i]`.",
        "",
        "```python",
        "from datasets import load_dataset",
        'ds = load_dataset("<this directory or repo>", split="train")',
        "```",
        "",
        "## Provenance",
        "",
        "| | |",
        "| --- | --- |",
        f"| tokenizer | `{meta.get('tokenizer')}` |",
        f"| tokenizer sha256 | `{meta.get('tokenizer_sha256')}` |",
        f"| vocab size, n_ctx, packed | {meta.get('vocab_size')}, {meta.get('n_ctx')}, {bool(meta.get('packed'))} |",
        f"| scorer | `{meta.get('scorer')}` ({_scorer_detail(meta)}) |",
        f"| weighting | `{json.dumps(meta.get('weighting'), sort_keys=True)}` |",
        f"| document steps | `{json.dumps(meta.get('steps') or [], sort_keys=True)}` |",
        f"| documents, rows, real tokens | {c['documents']}, {c['rows']}, {c['real_tokens']} |",
        *(f"| documents of stage {i} | {counts_line(x)} |" for i, x in enumerate(record["lineage"], 1)),
    ]
    if record.get("bpb"):
        lines += [
            "",
            "## Bits per byte (the workflow that made this data)",
            "",
            "| run | seed | loss | BPB |",
        ]
        lines += ["| --- | --- | --- | --- |"]
        lines += [
            f"| {r['run']} | {r.get('seed', '')} | {r.get('loss', '')} | {r['bpb']:.4f} |"
            for r in record["bpb"]
        ]
    return "\n".join(lines) + "\n"


def _scorer_detail(meta: dict) -> str:
    keys = ("model", "model_sha256", "checkpoint", "checkpoint_sha256", "aggregate")
    return ", ".join(f"{k}: `{meta[k]}`" for k in keys if meta.get(k)) or "see export.json"


WRITERS = {"megatron": _megatron, "litdata": _litdata, "hf": _hf}
#: export-data's output (entroweight.output's contract): export.json marks it, written first and
#: sealed last. Kept: a trainer reads the export, so one not made of this very source and format (its
#: shards changed since, its files edited) is refused unless --overwrite
EXPORT_DATA = output.declare(
    output.Output(
        "export-data",
        marks=(output.Mark(EXPORT_RECORD, ("format", "source", "code_version", "metadata", "counts")),),
        files=(EXPORT_RECORD, "README.md", "data", "index.json", "*.bin", "*.idx"),
        record=EXPORT_RECORD,
        kept=True,
    )
)
MEGATRON_MODULE = "megatron.core.datasets.indexed_dataset"


def _quiet_import(name: str):
    """`importlib.import_module(name)` without megatron-core's 8 import warnings that Apex and
    Transformer Engine are absent: neither is used to write an indexed dataset."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex)", category=UserWarning)
        return importlib.import_module(name)


# -- the command


def check_format(fmt: str) -> None:
    """Every refusal of the format, before anything is read: supported, its library installed."""
    if fmt in UNSUPPORTED:
        raise ExportError(UNSUPPORTED[fmt])
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if EXTRAS[fmt]:
        try:
            _quiet_import(MEGATRON_MODULE if fmt == "megatron" else "litdata")
        except ImportError as e:
            raise ExportError(
                f"--format {fmt} needs {e.name}: pip install 'entroweight[{EXTRAS[fmt]}]'"
            ) from None


def _made_of(source: Source, fmt: str, bpb: list[dict] | None) -> dict:
    """What an export is made of (entroweight.output's made_of): the format and the source (where it
    lies) a user chose; the fingerprints of its committed shards (each one's sha256 as its manifest
    records it), this code and the card's BPB rows."""
    shards = [[p.location.rsplit("/", 1)[-1], p.manifest.output_sha256] for p in source.parts]
    return {
        "options": {"format": fmt, "source": storage.key(source.path)},
        "inputs": {
            "source_sha256": hashlib.sha256(json.dumps(shards).encode()).hexdigest(),
            "code_version": __version__,
            "bpb": bpb or [],
        },
    }


def export_data(
    src: str | Path,
    out: str | Path,
    fmt: str,
    overwrite: bool = False,
    bpb: list[dict] | None = None,
    advise_wait: bool = True,
) -> dict:
    """Write `src`'s scored shards to `out` in `fmt`; returns the record also written to export.json,
    with `up_to_date` where `out` already holds this very export (nothing done).

    Written through the output contract (entroweight.output.writing): the path rule, the lock, this
    very export again is nothing to do, another refused unless --overwrite, export.json sealed last (an
    export without it sealed is incomplete; on an object store it is uploaded last); a refusal on the
    way (a shard that differs from its manifest) takes back what was written. `bpb`: rows {run, seed,
    loss, bpb} of the workflow that made the data, for the card. Raises ExportError (a refusal) and
    storage.OutputHeld (another run writes `out`)."""
    check_format(fmt)
    opened: list[Source] = []

    def made_of() -> dict:  # after the path rule: its refusals come first
        opened.append(open_scored(src))
        return _made_of(opened[0], fmt, bpb)

    def check() -> None:  # before anything is written
        if fmt == "litdata" and not any(p.manifest.rows_out for p in opened[0].parts):
            raise ExportError(no_rows(src) + _NO_LITDATA_ROWS)

    reads = [("SCORED", src)]
    try:
        with output.writing(
            EXPORT_DATA, out, reads, made_of, overwrite=overwrite, what="an export", advise_wait=advise_wait,
            check=check,
        ) as w:  # fmt: skip
            if w.nothing_to_do:
                return {**storage.json_record(storage.path(out) / EXPORT_RECORD), "up_to_date": True}
            w.record = _write(opened[0], w.dest, fmt, bpb)
    except storage.OutputRefused as e:
        raise ExportError(str(e)) from None
    return w.record


def _write(source: Source, dest: Path, fmt: str, bpb: list[dict] | None) -> dict:
    """The export's files in `dest`; returns what export.json records of them."""
    record = {
        "format": fmt,
        "source": storage.key(source.path),
        "code_version": __version__,
        "bpb": bpb or [],
        "metadata": source.meta,
        "weight_dtype": source.weight_dtype,
        "counts": {},  # filled as the writer reads
        # what each stage read and rejected, tokenize's first: every source document accounted for
        "lineage": sum_lineage([p.manifest for p in source.parts]),
    }
    try:
        WRITERS[fmt](source, dest, record)
    except DataDirError as e:  # a shard that differs from its manifest: what was written goes
        raise ExportError(str(e)) from None
    size = sum((dest / f).stat().st_size for f in output.written_files(dest, EXPORT_DATA))
    real = record["counts"]["real_tokens"]
    record["bytes"] = size
    record["bytes_per_real_token"] = round(size / real, 3) if real else None
    return record
