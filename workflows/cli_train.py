"""`entroweight train`, `eval-bpb`, `export-hf`: thin shells over entroweight.trainers.

Multi-GPU / multi-node: run `train` under torchrun, e.g.
`torchrun --nproc_per_node 8 -m entroweight.workflows.cli train DATA --out CKPT ...`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .cli_common import EXIT_FAILED_SHARDS, Location, _fail

ALLOW_PICKLE_HELP = (
    "Load a checkpoint's .pt/.bin/.pth weights where it has no model.safetensors (torch.load with "
    "weights_only=True). Pickles can run code: only for files you trust."
)


def _read_model_config(path: str | None) -> dict:
    if path is None:
        return {}
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        _fail(f"cannot read --model-config {path}: {e}")
    if not isinstance(data, dict):
        _fail(f"--model-config {path} must hold a mapping of model config fields (d_model: 512, ...)")
    return data


@click.command("train")
@click.argument("data", nargs=-1, required=True)
@click.option(
    "--model", default="llama", show_default=True, help="Model kind (llama, mixer, estimator, ...)."
)
@click.option("--model-config", default=None, help="YAML/JSON file of the model's config fields.")
@click.option(
    "--loss",
    type=click.Choice(["ce", "weighted_ce", "rescaled", "hard_negative", "prefix_smooth", "tfree_bce"]),
    default="ce",
    show_default=True,
)
@click.option("--out", required=True, type=Location(file_okay=False), help="Checkpoint directory.")
@click.option("--steps", type=int, default=1000, show_default=True)
@click.option(
    "--batch-size", type=int, default=32, show_default=True, help="Sequences per micro-batch per rank."
)
@click.option("--lr", type=float, default=2e-4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--tokenizer",
    default=None,
    help="The data's tokenizer.json (default: the copy the data carries); stored for eval-bpb / export-hf.",
)
@click.option("--grad-accum", type=int, default=1, show_default=True)
@click.option("--warmup-steps", type=int, default=None, help="Default: 5% of --steps.")
@click.option("--min-lr-ratio", type=float, default=0.1, show_default=True)
@click.option("--weight-decay", type=float, default=0.1, show_default=True)
@click.option("--grad-clip", type=float, default=1.0, show_default=True)
@click.option(
    "--normalize",
    type=click.Choice(["tokens", "weight"]),
    default="tokens",
    show_default=True,
    help="weighted_ce: divide Σ w·CE by the real-token count or by Σ w.",
)
@click.option("--margin", type=float, default=2.0, show_default=True, help="hard_negative margin.")
@click.option("--prefix-weight", type=float, default=0.1, show_default=True, help="prefix_smooth pw.")
@click.option("--shuffle-buffer", type=int, default=4096, show_default=True)
@click.option("--log-every", type=int, default=10, show_default=True)
@click.option("--save-every", type=int, default=None, help="Checkpoint every N steps (default: at the end).")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its last checkpoint.")
@click.option(
    "--stop-at", type=int, default=None, help="Stop after this step, leaving a resumable checkpoint."
)
@click.option(
    "--allow-config-change",
    is_flag=True,
    help="With --resume: continue under settings (lr, steps, loss, ...) that differ from the checkpoint's; "
    "config.json's train_history records each config and the step it took effect.",
)
@click.option("--overwrite", is_flag=True, help="Start over in an --out that already holds a checkpoint.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:1, ...")
@click.option("--compile", "compile_", is_flag=True, help="torch.compile the model.")
def train_cmd(data, model, model_config, loss, out, compile_, allow_config_change, **kw):
    """Train a MODEL on token parquet DATA (directories or files) with LOSS; checkpoints to --out."""
    from entroweight.models.checkpoint import CheckpointError
    from entroweight.trainers import DataError, TrainConfig, TrainError, TrainFailed, train

    try:
        cfg = TrainConfig(
            data=list(data),
            out=out,
            model=model,
            model_config=_read_model_config(model_config),
            loss=loss,
            compile=compile_,
            **kw,
        )
        result = train(cfg, allow_config_change=allow_config_change)
    except (
        TrainFailed
    ) as e:  # the run started: exit 1 as a failed stage does (its last checkpoint stays valid)
        _fail(str(e), EXIT_FAILED_SHARDS)
    except (TrainError, DataError, CheckpointError, ValueError) as e:
        _fail(str(e))
    click.echo(
        f"trained {result.step} steps, {result.tokens:,} tokens, loss {result.loss}, "
        f"{result.tokens_per_s:,.0f} tok/s -> {result.out}"
    )


@click.command("eval-bpb")
@click.argument("ckpt_dir", type=Location(exists=True, file_okay=False))
@click.option(
    "--text", "text_path", default=None, help="UTF-8 text file (default: the bundled WikiText-2 test set)."
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
@click.option("--device", default="auto", show_default=True)
@click.option(
    "--unigram", "unigram_data", default=None, help="Also the unigram baseline of this training data."
)
@click.option("--json", "as_json", is_flag=True)
@click.option("--allow-pickle", is_flag=True, help=ALLOW_PICKLE_HELP)
@click.option(
    "--embed-format",
    default="float8_e4m3fn",
    show_default=True,
    help="Estimator/autoencoder: the format each window's embedding is stored (and paid) in.",
)
def eval_bpb_cmd(ckpt_dir, unigram_data, as_json, **kw):
    """Bits per byte of CKPT_DIR on held-out text (sliding window, exact UTF-8 bytes)."""
    from entroweight.models.checkpoint import CheckpointError
    from entroweight.schemas.tokenizer import resolve_tokenizer_path
    from entroweight.trainers.bpb import eval_bpb, unigram_bpb

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
def export_hf_cmd(ckpt_dir, out, tokenizer, allow_pickle):
    """Write CKPT_DIR as a Hugging Face LlamaForCausalLM directory (config, safetensors, tokenizer)."""
    from entroweight.models.checkpoint import CheckpointError
    from entroweight.trainers.export import export_hf

    try:
        path = export_hf(ckpt_dir, out, tokenizer, allow_pickle=allow_pickle)
    except (CheckpointError, ValueError) as e:
        _fail(str(e))
    click.echo(
        f"wrote {path}; evaluate with: lm_eval --model hf --model_args pretrained={path} --tasks hellaswag"
    )


COMMANDS = [train_cmd, eval_bpb_cmd, export_hf_cmd]
