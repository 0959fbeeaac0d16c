"""Re-check a stage's output directory against its bookkeeping: the dataset has no silent hole.

`verify_dir(path)` reads everything (manifests, `.shards.json`, `.stage.json`, every parquet and
rejects file) and returns a list of problems, each naming the file and saying what to do; an empty
list means the directory is what its manifests claim. It works on tokenized and weighted (score or
weigh) directories; the directory is listed through DataDir (schemas/datadir.py).

What it checks:
- bookkeeping: `.stage.json` parses; every shard of `.shards.json` has a manifest (else a shard
  failed or was never run: a hole); every manifest is of this stage and config and registered;
- files: each output and rejects file exists with its recorded sha256 and row counts; no stray
  non-hidden file, no unreferenced rejects file, no temp file left by a killed run;
- accounting: per shard and over the run, documents in = documents out + rejected; a shard's rows
  hold the documents its manifest puts out (`schemas.document_count`: packed rows too); token and
  byte totals equal the manifests'; a scored shard has as many rows as its input shard's manifest
  and, reading all of it, as many documents in as that one put out;
- contracts: the schema the metadata implies; one tokenizer and one config (scorer) per directory;
  list lengths of input_ids / entropy / weight equal n_ctx; left pads hold pad_id; weights finite,
  in [0, 1], 0 on pads; entropy finite; `excluded` positions lie within their row's real tokens and
  weigh 0. The weights' encoding is read from their stored type (schemas/weighted.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from entroweight import storage
from entroweight.schemas import (
    ROW_IN_DOC,
    ShardManifest,
    StageRecord,
    document_count,
    read_file_metadata,
    sequence_schema,
    weighted_sequence_schema,
)
from entroweight.schemas.arrow import DOC_IDS
from entroweight.schemas.datadir import STAGE_KINDS, DataDir
from entroweight.schemas.manifest import ShardInput, is_manifest, lineage_problem, manifest_name
from entroweight.schemas.tokenizer import CARRIED_TOKENIZER
from entroweight.schemas.weighted import (
    ENTROPY,
    EXCLUDED,
    SURPRISAL,
    WEIGHT,
    excluded_mask,
    matrix,
    real_mask,
    row_lengths,
    weight_dtype,
    weights_matrix,
)
from entroweight.transforms.writer import TMP_MARK, sha256_file

from .stage import REJECTS_DIR, SHARDS_FILE, STAGE_FILE, manifest_path, shard_base

# metadata keys that may differ between shards of one config (file name of the tokenizer, code version)
_FREE_KEYS = {"tokenizer", "code_version"}
# keys that name the scorer and its model: a difference means two scorers in one directory
_SCORER_KEYS = {"scorer", "model", "model_sha256", "checkpoint", "checkpoint_sha256", "dtype", "weighting"}
_ROWS = 1024  # rows read at a time: bounded memory on large shards


def _unregistered_stream(registry: dict[str, str], inp: ShardInput, shard: str) -> bool:
    """Whether `shard` is one of a streamed file's shards (part-NNNNN-KKKKK) whose file the registry
    gives to the same part-NNNNN: a streamed run registers the shards it committed only when it
    ends (pipelines/stage.py `_register`), so a killed one leaves them out."""
    base = shard_base(shard)
    return base != shard and any(
        shard_base(v) == base and ShardInput.parse_key(k)[0] == inp.uri for k, v in registry.items()
    )


def verify_dir(path: str | Path) -> list[str]:
    """Problems found in the stage output directory `path` (local or a URL: s3://, gs://); [] when
    every shard checks out."""
    d = DataDir(path)
    out = d.root
    files = d.tree  # one recursive listing: manifests, shards, strays
    if not files and not (storage.is_local(out) and out.is_dir()):
        return [f"{out} is not a directory"]
    problems: list[str] = []
    record = _read_json_model(out / STAGE_FILE, StageRecord, problems)
    if record is None:
        if not (out / STAGE_FILE).exists():
            problems.append(f"{out} has no {STAGE_FILE}: it is not the output of an entroweight stage")
        return problems
    registry = _read_registry(out, problems)
    manifests: dict[str, ShardManifest] = {}
    unreadable: set[str] = set()  # shards whose manifest is there but does not parse (said once, above)
    for name in sorted(n for n in files if "/" not in n and is_manifest(n)):
        p = out / name
        m = _read_json_model(p, ShardManifest, problems)
        if m is None:
            unreadable.add(name.removeprefix(".").removesuffix(".manifest.json"))
        else:
            manifests[m.shard] = m
            if p.name != manifest_path(out, m.shard).name:
                problems.append(f"{p.name} holds the manifest of {m.shard}: the bookkeeping was edited")

    # every registered shard is done (a missing manifest is a failed or unrun shard: a hole)
    for key, shard in sorted((registry or {}).items(), key=lambda kv: kv[1]):
        if shard not in manifests and shard not in unreadable:
            problems.append(
                f"{shard} (input {key}) has no manifest: it failed or never ran; rerun the stage to complete it"
            )
    unfinished: dict[str, list[ShardInput]] = {}  # a streamed file's shards committed, not registered
    for shard, m in manifests.items():
        if m.stage != record.stage or m.config_hash != record.config_hash:
            problems.append(
                f"{shard}: manifest of {m.stage} config {m.config_hash}, but {STAGE_FILE} says "
                f"{record.stage} config {record.config_hash}: mixed configs; rerun with --overwrite"
            )
        for inp in m.inputs:
            if registry is not None and registry.get(inp.key) != shard:
                if _unregistered_stream(registry, inp, shard):
                    unfinished.setdefault(inp.uri, []).append(inp)
                else:
                    problems.append(f"{shard}: its input {inp.key} is not registered to it in {SHARDS_FILE}")
    for uri, inps in unfinished.items():  # one line per file, not one per shard
        problems.append(
            f"{uri}: {len(inps)} shard(s) of its rows {min(i.start for i in inps)}-"
            f"{max(i.stop or i.start for i in inps)} were committed by a run that stopped before it "
            f"registered them in {SHARDS_FILE} (killed?): rerun the stage to resume after them (they are kept)"
        )

    _check_files_present(files, manifests, problems, unreadable)
    first_meta: tuple[str, dict] | None = None
    totals = {"docs_in": 0, "docs_out": 0, "rejected": 0}
    for shard in sorted(manifests):
        m = manifests[shard]
        totals["docs_in"] += m.docs_in
        totals["docs_out"] += m.docs_out
        totals["rejected"] += m.n_rejected
        meta = _check_shard(out, m, record, problems)
        if meta is None:
            continue
        if first_meta is None:
            first_meta = (m.output, meta)
        else:
            _compare_meta(first_meta, (m.output, meta), problems)
    if first_meta is not None:
        _check_carried_tokenizer(out, first_meta[1], problems)
    if totals["docs_in"] != totals["docs_out"] + totals["rejected"]:
        problems.append(
            f"{out}: {totals['docs_in']} documents in, but {totals['docs_out']} out + {totals['rejected']} "
            "rejected: documents were lost"
        )
    return problems


# ---------------------------------------------------------------- bookkeeping


def _read_json_model(path: Path, model, problems: list[str]):
    if not path.exists():
        return None
    try:
        return model.model_validate_json(path.read_bytes())
    except (ValueError, OSError) as e:
        problems.append(f"{path.name} does not parse ({type(e).__name__}); rerun the stage to rewrite it")
        return None


def _read_registry(out: Path, problems: list[str]) -> dict[str, str] | None:
    path = out / SHARDS_FILE
    if not path.exists():
        problems.append(f"{out} has no {SHARDS_FILE}: the shard registry is gone; rerun the stage")
        return None
    try:
        registry = json.loads(path.read_bytes())
        if not isinstance(registry, dict):
            raise ValueError("not a mapping")
        return {str(k): str(v) for k, v in registry.items()}
    except ValueError as e:
        problems.append(f"{SHARDS_FILE} does not parse ({e}); rerun the stage")
        return None


def _check_files_present(
    files: dict[str, int], manifests: dict[str, ShardManifest], problems: list[str], unreadable: set[str]
) -> None:
    """Stray files: data nobody accounts for (a shard with no manifest, a copy, a temp file). A shard
    whose manifest does not parse is not one: told to move it out, a user would lose a good shard."""
    outputs = {m.output for m in manifests.values()}
    rejects = {m.rejects_file for m in manifests.values() if m.rejects_file}
    for rel in sorted(files):
        if TMP_MARK in rel.rsplit("/", 1)[-1]:
            problems.append(f"{rel} is a temp file of a killed run; rerun the stage (it cleans them up)")
        elif rel.startswith(f"{REJECTS_DIR}/"):
            if rel not in rejects:
                problems.append(
                    f"{rel} is a rejects file no manifest accounts for; delete it or rerun the stage"
                )
        elif not any(part.startswith(".") for part in rel.split("/")):
            if rel not in outputs and rel.split(".", 1)[0] not in unreadable:
                problems.append(
                    f"{rel} is not a shard of this directory (no manifest names it): datasets would load it; "
                    "move it out, or rerun the stage if a shard lost its manifest"
                )
        # other hidden files (.stage.json, .lock, someone's own): datasets skips them, so do we


# ---------------------------------------------------------------- one shard


def _check_shard(out: Path, m: ShardManifest, record: StageRecord, problems: list[str]) -> dict | None:
    """All checks of one shard; returns its file metadata (for cross-shard consistency) or None."""
    where = f"{m.shard} ({m.output})"
    # its own counts and those it carries of the stages before, as every reader judges them
    if off := lineage_problem(m.lineage()):
        problems.append(
            f"{manifest_name(m.shard)}: its counts do not add up ({off}): edited, not as the stage wrote "
            "it; rerun the stage with --overwrite to make it again"
        )
    if m.rejects_file:
        _check_rejects(out, m, problems)
    elif m.n_rejected:
        problems.append(f"{where}: {m.n_rejected} rejected documents but no rejects file")
    path = out / m.output
    if not path.is_file():
        problems.append(f"{where}: the shard file is missing; rerun the stage to rewrite it")
        return None
    if sha256_file(path) != m.output_sha256:
        problems.append(
            f"{where}: sha256 differs from its manifest (changed or corrupt); rerun with --overwrite"
        )
    try:
        pf = pq.ParquetFile(storage.open_input(path))
    except Exception as e:  # truncated or not parquet at all
        problems.append(f"{where}: not a readable parquet file ({type(e).__name__}: {e})")
        return None
    if pf.metadata.num_rows != m.rows_out:
        problems.append(f"{where}: {pf.metadata.num_rows} rows, its manifest says {m.rows_out}")
    try:
        meta = read_file_metadata(path)
    except ValueError:  # metadata that does not parse: not ours either
        meta = None
    if not meta:
        problems.append(f"{where}: no entroweight file metadata; it was not written by this stage")
        return None
    if meta.get("config_hash") != record.config_hash or meta.get("stage") != record.stage:
        problems.append(
            f"{where}: file metadata says {meta.get('stage')} config {meta.get('config_hash')}, the directory "
            f"{record.stage} config {record.config_hash}"
        )
    expected = _expected_schema(meta, record, pf.schema_arrow, where, problems)
    if expected is not None:
        got = pa.schema([pa.field(f.name, f.type) for f in pf.schema_arrow])
        want = pa.schema([pa.field(f.name, f.type) for f in expected])
        if not got.equals(want):
            problems.append(f"{where}: schema {_fmt(got)} is not the contract {_fmt(want)}")
        else:
            try:
                _check_values(pf, m, meta, where, problems)
            except (OSError, pa.ArrowException) as e:  # a corrupt page: report it, check the other shards
                problems.append(f"{where}: a page does not decode ({type(e).__name__}: {e})")
    if STAGE_KINDS.get(record.stage) == "weighted":
        _check_score_input(m, where, problems)
    return meta


def _check_rejects(out: Path, m: ShardManifest, problems: list[str]) -> None:
    path = out / m.rejects_file
    where = f"{m.shard} ({m.rejects_file})"
    if not path.is_file():
        problems.append(f"{where}: rejects file missing; rerun the stage with --overwrite")
        return
    if m.rejects_sha256 and sha256_file(path) != m.rejects_sha256:
        problems.append(f"{where}: sha256 differs from its manifest (changed or corrupt)")
    try:
        table = pq.read_table(storage.open_input(path), columns=["reason"])
    except Exception as e:
        problems.append(f"{where}: not a readable parquet file ({type(e).__name__})")
        return
    counts: dict[str, int] = {}
    for reason in table.column("reason").to_pylist():
        counts[reason] = counts.get(reason, 0) + 1
    if counts != dict(m.rejected):
        problems.append(f"{where}: holds rejects {counts}, its manifest counts {dict(m.rejected)}")


def _expected_schema(
    meta: dict, record: StageRecord, stored: pa.Schema, where: str, problems: list[str]
) -> pa.Schema | None:
    try:
        vocab, packed = int(meta["vocab_size"]), bool(meta.get("packed", False))
        kind = STAGE_KINDS.get(record.stage)
        if kind == "sequences":
            return sequence_schema(vocab, packed)
        if kind == "weighted":
            with_entropy = bool(record.config.get("with_entropy", True))
            # the weights' encoding is read from their stored type (schemas/weighted.py); a file
            # whose metadata names another is inconsistent
            dtype = weight_dtype(stored) if WEIGHT in stored.names else "float16"
            if meta.get("weight_dtype", dtype) != dtype:
                problems.append(
                    f"{where}: weights are stored as {dtype}, its file metadata says {meta['weight_dtype']}"
                )
            return weighted_sequence_schema(vocab, packed, dtype, with_entropy, SURPRISAL in stored.names)
    except (KeyError, ValueError, TypeError) as e:
        problems.append(f"{where}: file metadata lacks what the schema needs ({e})")
        return None
    return None  # a stage this checker does not know: bookkeeping checks only


def _check_values(pf: pq.ParquetFile, m: ShardManifest, meta: dict, where: str, problems: list[str]) -> None:
    n_ctx, pad_id = int(meta["n_ctx"]), int(meta["pad_id"])
    names = pf.schema_arrow.names
    lists = [c for c in ("input_ids", ENTROPY, SURPRISAL, WEIGHT) if c in names]
    columns = [*lists, "n_pad", "n_bytes", *([EXCLUDED] if EXCLUDED in names else [])]
    documents = ROW_IN_DOC in names  # rows written before `row_in_doc` cannot say where documents start
    columns += [ROW_IN_DOC, *([DOC_IDS] if DOC_IDS in names else [])] if documents else []
    real = n_bytes = docs = 0
    bad: dict[str, int] = {}  # over the whole file: any problem also skips the totals check below

    def flag(kind: str, n: int) -> None:
        if n:
            bad[kind] = bad.get(kind, 0) + int(n)

    for batch in pf.iter_batches(batch_size=_ROWS, columns=columns):
        docs += document_count(batch) if documents else 0
        n_pad = batch.column("n_pad").to_numpy().astype(np.int64)
        layout = {"n_pad outside [0, n_ctx]": ((n_pad < 0) | (n_pad > n_ctx)).sum()}
        for c in lists:
            lengths = pc.list_value_length(batch.column(c)).to_numpy(zero_copy_only=False)
            layout[f"{c} lists not of length n_ctx={n_ctx}"] = (lengths != n_ctx).sum()
        for kind, n in layout.items():
            flag(kind, n)
        if any(layout.values()):
            continue  # this batch cannot be laid out as (rows, n_ctx); later batches are still checked
        rows = batch.num_rows
        pad = ~real_mask(n_pad, n_ctx)
        ids = matrix(batch.column("input_ids"), width=n_ctx)
        flag("pads that are not pad_id", (ids[pad] != pad_id).sum())
        flag("token ids beyond the vocabulary", (ids >= int(meta["vocab_size"])).sum())
        real += int(rows * n_ctx - n_pad.sum())
        n_bytes += int(pc.sum(batch.column("n_bytes")).as_py() or 0)
        excluded = None
        if EXCLUDED in columns:
            col = batch.column(EXCLUDED)
            positions = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.int64)
            starts = np.repeat(n_pad, row_lengths(col))
            outside = (positions < starts) | (positions >= n_ctx)
            flag("excluded positions outside their row's real tokens", outside.sum())
            if not outside.any():
                excluded = excluded_mask(col, n_ctx)
        if WEIGHT in lists:
            w = weights_matrix(batch.column(WEIGHT), n_ctx)
            flag("weights NaN or infinite", (~np.isfinite(w)).sum())
            with np.errstate(invalid="ignore"):
                flag("weights outside [0, 1]", ((w < 0) | (w > 1)).sum())
            flag("pads with a weight other than 0", (w[pad] != 0).sum())
            if excluded is not None:
                flag("excluded positions with a weight other than 0", (w[excluded] != 0).sum())
        for c in (ENTROPY, SURPRISAL):
            if c in lists:
                flag(f"{c} NaN or infinite", (~np.isfinite(matrix(batch.column(c), width=n_ctx))).sum())
    for kind, n in bad.items():
        problems.append(f"{where}: {n} {kind}")
    if documents and docs != m.docs_out:
        problems.append(
            f"{where}: its rows hold {docs} documents, its manifest says {m.docs_out} out (the manifest "
            f"edited, or written by an older entroweight that counted packed rows as documents); remove "
            f"{manifest_name(m.shard)} and rerun the stage: that shard is redone"
        )
    if not bad:
        if real != m.n_real_tokens:
            problems.append(f"{where}: {real} real tokens, its manifest says {m.n_real_tokens}")
        if n_bytes != m.n_bytes:
            problems.append(f"{where}: n_bytes sum {n_bytes}, its manifest says {m.n_bytes}")


def _check_score_input(m: ShardManifest, where: str, problems: list[str]) -> None:
    """A scored shard scores every row of its input shard's range, and of a whole input shard the
    documents its manifest put out (when the input directory is still there): the counts chain."""
    for inp in m.inputs:
        src = storage.path(inp.uri)
        manifest = manifest_path(src.parent, src.stem)
        try:
            theirs = ShardManifest.model_validate_json(manifest.read_bytes())
        except (ValueError, OSError):  # the input directory is gone or was edited: nothing to compare
            continue
        read = m.rows_in if m.rows_in is not None else m.docs_in  # manifests before rows_in: rows = docs
        rows = min(theirs.rows_out, inp.stop if inp.stop is not None else theirs.rows_out) - inp.start
        if rows != read:  # a sample: its range
            problems.append(f"{where}: scored {read} rows, its input {src} has {rows}")
        elif rows == theirs.rows_out and m.docs_in != theirs.docs_out:
            problems.append(
                f"{where}: {m.docs_in} documents in, its input {src} put out {theirs.docs_out} (a manifest "
                "edited, or written by an older entroweight that counted packed rows as documents); remove "
                "the wrong one and rerun the stage that wrote it: that shard is redone"
            )


def _check_carried_tokenizer(out: Path, meta: dict, problems: list[str]) -> None:
    """The tokenizer a directory carries is the one its shards name (downstream commands trust it)."""
    path = out / CARRIED_TOKENIZER
    if path.is_file() and sha256_file(path) != meta.get("tokenizer_sha256"):
        problems.append(
            f"{CARRIED_TOKENIZER}: not the tokenizer of the shards (sha256 differs from their metadata); "
            "restore it, or delete it and pass --tokenizer downstream"
        )


def _compare_meta(a: tuple[str, dict], b: tuple[str, dict], problems: list[str]) -> None:
    (fa, ma), (fb, mb) = a, b
    if ma.get("tokenizer_sha256") != mb.get("tokenizer_sha256"):
        problems.append(f"{fb}: tokenized with another tokenizer than {fa}: one tokenizer per directory")
        return
    keys = sorted(k for k in set(ma) | set(mb) if k not in _FREE_KEYS and ma.get(k) != mb.get(k))
    if not keys:
        return
    what = "another scorer config" if set(keys) & _SCORER_KEYS else "other metadata"
    problems.append(f"{fb}: {what} than {fa} ({', '.join(keys)} differ): one config per directory")


def _fmt(schema: pa.Schema) -> str:
    return "{" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "}"
