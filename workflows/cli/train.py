"""`entroweight train`, `eval-bpb`, `export-hf`: thin shells over entroweight.trainers.

Multi-GPU / multi-node: run `train` under torchrun, e.g.
`torchrun --nproc_per_node 8 -m entroweight.workflows.cli train DATA --out CKPT ...`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from entroweight.trainers.config import TrainConfig

from .common import (
    DEVICE,
    EXIT_FAILED_SHARDS,
    EXIT_LOCKED,
    Location,
    _fail,
    config_options,
    given_options,
    of_checkpoint,
    wait_option,
    writing_out,
)

ALLOW_PICKLE_HELP = (
    "Load a checkpoint's .pt/.bin/.pth weights where it has no model.safetensors (torch.load with "
    "weights_only=True). Pickles can run code: only for files you trust."
)


def _read_mapping(path: str | None, what: str) -> dict:
    """A YAML (or JSON) file holding a mapping; {} without a path. Read as a workflow file is (a key
    given twice is refused, not the last one kept)."""
    if path is None:
        return {}
    import yaml

    from ..spec import load_yaml

    try:
        data = load_yaml(Path(path))
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:  # on one line (YAML's mark spans two)
        _fail(f"cannot read {what} {path}: {' '.join(str(e).split())}")
    if not isinstance(data, dict):
        _fail(
            f"{what} {path} must hold a mapping ({'d_model: 512' if 'model' in what else 'steps: 1000'}, ...)"
        )
    return data


@click.command("train")
@click.argument("data", nargs=-1)
@click.option(
    "--config",
    "config_file",
    default=None,
    type=Location(exists=True, dir_okay=False, local=True),
    help="YAML/JSON file of training options (the keys are these options' names, and data); "
    "options given here override it.",
)
@click.option(
    "--model-config",
    "model_config_file",
    default=None,
    type=Location(dir_okay=False, local=True),
    help="YAML/JSON file of the model's config fields.",
)
@config_options(TrainConfig, skip=("data", "model_cfg"), out={"type": Location(file_okay=False)})
@click.option(
    "--allow-config-change",
    is_flag=True,
    help="With --resume: continue under settings (lr, steps, loss, ...) that differ from the checkpoint's; "
    "config.json's train_history records each config and the step it took effect.",
)
@wait_option
@click.pass_context
def train_cmd(ctx, data, config_file, model_config_file, allow_config_change, wait, **options):
    """Train a MODEL on token parquet DATA (directories or files) with LOSS; checkpoints to --out.

    Every option can also come from a --config file (what a workflow hands to torchrun)."""
    from entroweight import storage
    from entroweight.models.checkpoint import CheckpointError
    from entroweight.trainers import DataError, TrainError, TrainFailed, train

    values = _read_mapping(config_file, "--config")
    for key in ("out", "tokenizer"):  # as the flags' Location takes them (a `..` after a missing dir)
        if isinstance(values.get(key), str) and not storage.is_url(values[key]):
            values[key] = storage.as_meant(values[key])
    model_config_flag = "--model-config"
    if isinstance(values.get("model_config"), str):  # a file, as --model-config and a workflow's take it
        named = storage.as_meant(values.pop("model_config"))
        if model_config_file is None:  # (the flag, given too, wins)
            model_config_file, model_config_flag = named, f"model_config (in --config {config_file})"
    values |= given_options(ctx, options)
    if data:
        values["data"] = list(data)
    if model_config_file:
        values["model_config"] = _read_mapping(model_config_file, model_config_flag)
    try:
        result = train(
            TrainConfig(**values),
            allow_config_change=allow_config_change,
            wait=wait,
            reads=[("--config", config_file), (model_config_flag, model_config_file)],
            apart=True,
        )  # the path rule is the trainer's (its other callers too)
    except storage.OutputHeld as e:  # another run trains into --out (under torchrun: rank 0 holds the lock)
        _fail(str(e), EXIT_LOCKED)
    except (
        TrainFailed
    ) as e:  # the run started: exit 1 as a failed stage does (its last checkpoint stays valid)
        _fail(str(e), EXIT_FAILED_SHARDS)
    except (TrainError, DataError, CheckpointError, ValueError) as e:
        _fail(str(e))
    if int(os.environ.get("RANK", 0)) != 0:  # under torchrun, one line for the run, not one per rank
        return
    if result.loss is None:  # a resume at its last step, or past --stop-at: no step ran
        behind = "" if result.step >= result.steps else f", past --stop-at {values.get('stop_at')}"
        click.echo(f"nothing to train: {result.out} is at step {result.step} of {result.steps}{behind}")
    else:
        click.echo(
            f"trained {result.step} steps, {result.tokens:,} tokens, loss {result.loss}, "
            f"{result.tokens_per_s:,.0f} real tok/s -> {result.out}"
        )


def _as_list(value) -> list:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


@click.command("eval-bpb")
@click.argument("ckpt_dir", type=Location(exists=True, file_okay=False))
@click.option(
    "--text",
    "text_path",
    type=Location(exists=True, dir_okay=False),
    default=None,
    help="UTF-8 text file (default: the bundled WikiText-2 test set).",
)
@click.option("--n-ctx", type=int, default=None, help="Window length (default: the model's n_ctx).")
@click.option(
    "--stride",
    type=int,
    default=None,
    help="Targets each window adds, 1..n_ctx (default: n_ctx/2); a window's first token is context only.",
)
@click.option("--tokenizer", default=None, help="Default: the tokenizer.json the checkpoint stores.")
@click.option("--max-bytes", type=int, default=None, help="Evaluate the first N bytes of the text only.")
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--device", type=DEVICE, default="auto", show_default=True)
@click.option(
    "--unigram",
    "unigram_data",
    type=Location(exists=True),
    default=None,
    help="Also the unigram baseline of this training data.",
)
@click.option("--json", "as_json", is_flag=True)
@click.option("--allow-pickle", is_flag=True, help=ALLOW_PICKLE_HELP)
@click.option(
    "--embed-format",
    default=None,
    help="Estimator/autoencoder: the format each window's embedding is stored (and paid) in "
    "[default: float8_e4m3fn].",
)
def eval_bpb_cmd(ckpt_dir, unigram_data, as_json, **kw):
    """Bits per byte of CKPT_DIR on held-out text (sliding window, exact UTF-8 bytes)."""
    from entroweight.models.checkpoint import CheckpointError
    from entroweight.schemas.tokenizer import resolve_tokenizer_path
    from entroweight.trainers.bpb import eval_bpb, unigram_bpb
    from entroweight.transforms.sources import not_plain_text

    if kw["text_path"] and (problem := not_plain_text(kw["text_path"])):
        _fail(f"--text {problem}")
    try:
        # the options are eval_bpb's keyword arguments; a progress bar of windows when stderr is a terminal
        res = eval_bpb(ckpt_dir, **kw, progress=sys.stderr.isatty())
        if unigram_data:
            tok = resolve_tokenizer_path(kw["tokenizer"], [ckpt_dir, unigram_data])
            res["unigram_bpb"] = unigram_bpb(unigram_data, tok, kw["text_path"], kw["max_bytes"])["bpb"]
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    if as_json:
        click.echo(json.dumps(res, indent=2))
        return
    line = f"BPB {res['bpb']:.4f} ({res['tokens']:,} tokens, {res['bytes']:,} bytes, n_ctx {res['n_ctx']}, stride {res['stride']})"
    if res.get("amortized"):
        line += (
            f"; amortized: embedding {res['embed_bpb']:.4f} ({res['windows']:,} windows in "
            f"{res['embed_format']}) + tokens {res['token_bpb']:.4f}"
        )
    if "unigram_bpb" in res:
        line += f"; unigram baseline {res['unigram_bpb']:.4f}"
    click.echo(line)


@click.command("export-hf")
@click.argument("ckpt_dir", type=Location(exists=True, file_okay=False))
@click.option("--out", required=True, type=Location(file_okay=False))
@click.option("--tokenizer", default=None, help="Default: the tokenizer.json the checkpoint stores.")
@click.option("--allow-pickle", is_flag=True, help=ALLOW_PICKLE_HELP)
@click.option(
    "--overwrite", is_flag=True, help="Replace a --out that holds another export or command's output."
)
def export_hf_cmd(ckpt_dir, out, tokenizer, allow_pickle, overwrite):
    """Write CKPT_DIR as a Hugging Face LlamaForCausalLM directory (config, safetensors, tokenizer)."""
    from entroweight import storage
    from entroweight.models.checkpoint import CheckpointError
    from entroweight.trainers.export import HFExport, write_hf
    from entroweight.trainers.outputs import EXPORT_HF, EXPORT_HF_MARK

    export = None

    def made_of() -> dict:
        """Read and checked once the path rule holds, before anything in --out is touched."""
        nonlocal export
        try:
            export = HFExport(ckpt_dir, tokenizer, allow_pickle=allow_pickle)
        except (CheckpointError, ValueError) as e:
            _fail(str(e))
        return of_checkpoint(ckpt_dir, {}, {"tokenizer_sha256": export.tokenizer_sha256})

    reads = [("CKPT_DIR", ckpt_dir), ("--tokenizer", tokenizer)]
    with writing_out(EXPORT_HF, out, reads, made_of, overwrite, what="an export") as w:
        if w.nothing_to_do:
            click.echo(f"nothing to do: {out} already holds this export of {ckpt_dir}")
            return
        write_hf(export, w.dest)
        w.record = json.loads((w.dest / EXPORT_HF_MARK).read_text())  # sealed, last, with what it is made of
    # lm-eval and transformers read a local directory or a hub id, not an object store's URL
    where = "a local copy of it" if storage.is_url(out) else out
    click.echo(
        f"wrote {out}; evaluate with: lm_eval --model hf --model_args pretrained={where} --tasks hellaswag"
    )


COMMANDS = [train_cmd, eval_bpb_cmd, export_hf_cmd]
