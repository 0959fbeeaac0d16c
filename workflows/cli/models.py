"""`entroweight eval-quant`: how much an estimator / autoencoder loses when its embedding is stored
in 8 bits (float8 e4m3fn / e5m2, int8 absmax), and its amortized bits per byte."""

from __future__ import annotations

import json

import click

from .common import COUNT, DEVICE, Location, _fail

DEFAULT_FORMATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int8")


def token_batches(files, pad_id: int, batch_size: int, max_sequences: int | None, parts=None):
    """(input_ids (B, T) left-padded with pad_id, n_bytes (B,)) from token parquet files; a stage's
    shard (in `parts`) read checked against its manifest, a file that does not decode refused
    (DataDirError either way)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from entroweight.schemas.datadir import open_data_file, undecodable

    parts = parts or {}

    def read(path):  # streamed, as the sequences are needed
        try:
            pf = pq.ParquetFile(open_data_file(path, parts.get(path)))
            yield from pf.iter_batches(batch_size=batch_size, columns=["input_ids", "n_bytes"])
        except (pa.ArrowException, OSError) as e:
            raise undecodable(path, e) from None

    left = max_sequences if max_sequences is not None else float("inf")
    for path in files:
        for batch in read(path):
            rows = batch.column("input_ids").to_pylist()[: int(min(left, batch.num_rows))]
            if not rows:
                return
            n_bytes = batch.column("n_bytes").to_numpy()[: len(rows)]
            T = max(len(r) for r in rows)
            ids = np.full((len(rows), T), pad_id, dtype=np.int64)
            for i, r in enumerate(rows):  # left padding: a shorter row keeps its tokens at the end
                ids[i, T - len(r) :] = r
            yield torch.from_numpy(ids), torch.from_numpy(n_bytes.astype(np.int64))
            left -= len(rows)
            if left <= 0:
                return


@click.command("eval-quant")
@click.argument("ckpt_dir", type=Location(exists=True, file_okay=False))
@click.option(
    "--data", "data", multiple=True, required=True, help="Token parquet (dirs or files); repeatable."
)
@click.option(
    "--formats",
    default=",".join(DEFAULT_FORMATS),
    show_default=True,
    help="Embedding formats to compare with float32 (float8_e4m3fn, float8_e5m2, int8, bfloat16, float16).",
)
@click.option("--max-sequences", type=COUNT, default=None, help="Evaluate the first N sequences only.")
@click.option("--batch-size", type=COUNT, default=32, show_default=True)
@click.option("--device", type=DEVICE, default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def eval_quant_cmd(ckpt_dir, data, formats, max_sequences, batch_size, device, as_json):
    """Eval loss of CKPT_DIR's decoder with its embedding cast to each format vs float32, and the
    amortized bits per byte: (embedding bits + Σ token bits) / Σ bytes of the --data sequences."""
    from entroweight.models.checkpoint import CheckpointError, a_model_of, load_checkpoint
    from entroweight.models.quant import FORMATS, evaluate_quantized
    from entroweight.options import device_here
    from entroweight.trainers.data import DataError, inspect_data

    fmts = [f.strip() for f in formats.split(",") if f.strip()]
    if not fmts:  # float32 against nothing: a table of one row
        _fail(f"--formats names no format; choose from {', '.join(FORMATS)}")
    unknown = [f for f in fmts if f not in FORMATS]
    if unknown:
        _fail(f"unknown --formats {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    dev = str(device_here(device))  # checked as the option was parsed: auto resolved
    try:
        model, config = load_checkpoint(ckpt_dir, map_location=dev)
        if not all(hasattr(model, a) for a in ("encode", "decode", "embed_dim")):
            _fail(
                f"{ckpt_dir} holds {a_model_of(config['kind'])}, which has no embedding to quantize; "
                "eval-quant is for estimator and autoencoder checkpoints (use eval-bpb for the others)"
            )
        info = inspect_data(list(data), (), config.get("tokenizer_sha256"))
    except (CheckpointError, DataError) as e:
        _fail(str(e))
    width = getattr(model.config, "n_ctx", None)
    if (
        info.n_ctx is not None and width is not None and info.n_ctx > width
    ):  # the model would refuse each batch
        _fail(
            f"{', '.join(data)} holds rows of {info.n_ctx} tokens (n_ctx), longer than {ckpt_dir} reads "
            f"({width}, its n_ctx): tokenize with --n-ctx {width} or less"
        )
    pad_id = info.pad_id if info.pad_id is not None else config.get("pad_id")
    if pad_id is None:
        _fail("the data record no pad_id; tokenize it with `entroweight tokenize` (left-padded sequences)")
    from entroweight.schemas.datadir import DataDirError

    try:
        res = evaluate_quantized(
            model,
            token_batches(info.files, pad_id, batch_size, max_sequences, info.parts),
            pad_id,
            formats=fmts,
        )
    except DataDirError as e:  # a shard that differs from its manifest, a file that does not decode
        _fail(str(e))
    res["checkpoint"] = str(ckpt_dir)
    res["kind"] = config["kind"]
    if as_json:
        click.echo(json.dumps(res, indent=2))
        return
    click.echo(
        f"{res['kind']} {ckpt_dir}: {res['sequences']:,} sequences, {res['targets']:,} target tokens, "
        f"{res['bytes']:,} bytes, embedding {res['embed_dim']} values"
    )
    click.echo(f"{'format':<15}{'loss':>9}{'delta':>10}{'embed bpb':>11}{'token bpb':>11}{'bpb':>9}")
    for fmt in ["float32", *[f for f in fmts if f != "float32"]]:
        r = res[fmt]
        click.echo(
            f"{fmt:<15}{r['loss']:>9.4f}{r['delta']:>+10.4f}{r['embed_bpb']:>11.4f}"
            f"{r['token_bpb']:>11.4f}{r['bpb']:>9.4f}"
        )


COMMANDS = [eval_quant_cmd]
