"""`entroweight evaluate CKPT --tasks T1,T2 --out DIR`: downstream accuracy through lm-eval.

A thin shell over trainers/accuracy.py: the checkpoint is exported as a LlamaForCausalLM and scored by
lm-eval's `simple_evaluate` on the named tasks; the offline task (`entroweight_heldout`) is built
from `--documents` first (transforms/choice_items.py). DIR receives `accuracy.json` (per task: each
metric with its standard error, the chance level, the per-item 0/1 answers), the items, and lm-eval's
scratch (`.lm-eval/`: the task YAML, HF datasets' cache).
"""

from __future__ import annotations

import collections
import shutil
from pathlib import Path

import click

from entroweight.options import repeated
from entroweight.trainers.outputs import EVALUATE, ITEMS_FILE, RESULTS

from .common import DEVICE, SEED, Location, _fail, of_checkpoint, wait_option, writing_out


@click.command("evaluate")
@click.argument("ckpt_dir", type=Location(exists=True, file_okay=False))
@click.option(
    "--tasks",
    default="entroweight_heldout",
    show_default=True,
    help="Comma-separated lm-eval task names (hellaswag, arc_easy, ...; docs/workflows.md lists the "
    "write-up's) and/or entroweight_heldout, the offline task built from --documents.",
)
@click.option(
    "--documents",
    multiple=True,
    help="Held-out documents for entroweight_heldout (files, dirs, globs, as `tokenize` reads them); "
    "repeatable. Never documents the model trained on.",
)
@click.option(
    "--items", type=click.IntRange(min=1), default=None, help="At most N items (default: every cut)."
)
@click.option("--prefix-tokens", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--continuation-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--choices", type=click.IntRange(min=2), default=4, show_default=True)
@click.option(
    "--stride",
    type=click.IntRange(min=1),
    default=None,
    help="Least tokens between two cuts of a document (default: prefix + continuation, no overlap).",
)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Item construction's seed.")
@click.option("--text-column", default="text", show_default=True, help="The field that holds the text.")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None, help="Default: each task's own.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most N items per lm-eval task.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--device", type=DEVICE, default="auto", show_default=True)
@click.option("--out", required=True, type=Location(file_okay=False))
@click.option("--overwrite", is_flag=True, help="Replace a --out that holds another command's output.")
@wait_option
def evaluate_cmd(ckpt_dir, tasks, documents, out, overwrite, wait, **kw):
    """Accuracy of CKPT_DIR (a llama checkpoint) on lm-eval tasks, per item and in all."""
    from entroweight import storage
    from entroweight.models.checkpoint import CheckpointError
    from entroweight.trainers.accuracy import OFFLINE_TASK, AccuracyError

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    reads = [("CKPT_DIR", ckpt_dir)] + [("--documents", d) for d in documents]

    def made_of() -> dict | None:  # after the path rule: its refusals come first
        if not names:
            _fail("--tasks names no task")
        twice = repeated(names)
        if twice:  # as the workflow's accuracy.tasks: a task given twice is a typo, not two evaluations
            _fail(f"--tasks names {', '.join(twice)} more than once")
        if OFFLINE_TASK in names and not documents:
            _fail(f"--tasks {OFFLINE_TASK} is built from held-out documents: pass --documents FILE")
        return _made_of(ckpt_dir, names, documents, kw)

    items = []  # the offline task's, built under the lock by `check`, before --out is touched
    check = lambda: items.append(_checked(ckpt_dir, names, documents, kw))  # noqa: E731
    with writing_out(EVALUATE, out, reads, made_of, overwrite, wait, "an evaluation", check) as w:
        if w.nothing_to_do:
            click.echo(f"nothing to do: {out} already holds this evaluation of {ckpt_dir}")
            return
        try:
            w.record = _evaluate(ckpt_dir, names, w.dest, items[0], kw)
            if storage.is_url(out):  # lm-eval's scratch (caches and their locks) is not a result to upload
                shutil.rmtree(w.dest / ".lm-eval", ignore_errors=True)
        except (AccuracyError, CheckpointError) as e:
            if not storage.is_url(out):  # (a store's --out: nothing was uploaded)
                shutil.rmtree(storage.path(out) / ".lm-eval", ignore_errors=True)
                if items[0] is not None:
                    (storage.path(out) / ITEMS_FILE).unlink(missing_ok=True)
            _fail(str(e))
    res = w.record
    for task, t in res["tasks"].items():
        metrics = ", ".join(
            f"{k} {m['value']:.4f}" + (f" ± {m['stderr']:.4f}" if m["stderr"] is not None else "")
            for k, m in t["metrics"].items()
        )
        chance = f"; chance {t['chance']:.4f}" if t["chance"] is not None else ""
        click.echo(f"{task}: {metrics} ({t['n']} items{chance})")
    for group, g in res["groups"].items():
        click.echo(f"{group}: " + ", ".join(f"{k} {m['value']:.4f}" for k, m in g["metrics"].items()))
    click.echo(f"wrote {storage.path(out) / RESULTS}")


#: evaluate's options that change no result (speed and where it runs), as score's batch size and device
NOT_MADE_OF = ("batch_size", "device")


def _made_of(ckpt_dir, names, documents, kw) -> dict | None:
    """What an evaluation's results are a function of: the checkpoint's weights, the tasks, the
    options and the --documents files (others are refused unless --overwrite), and each of those
    files' size and mtime or an object's version (one changed since is read again); None where the
    files cannot be listed (refused where the items are built)."""
    from entroweight.trainers.accuracy import OFFLINE_TASK
    from entroweight.transforms.sources import SourceError, source_files

    try:  # only the offline task reads them
        files = source_files(list(documents)) if OFFLINE_TASK in names else {}
    except (SourceError, OSError):
        return None
    options = {"tasks": sorted(names), **{k: v for k, v in kw.items() if k not in NOT_MADE_OF}}
    options["documents"] = list(files)  # which files are other documents: refused unless --overwrite
    return of_checkpoint(ckpt_dir, options, {"documents": [list(stat or ()) for stat in files.values()]})


def _checked(ckpt_dir, names, documents, kw) -> list[dict] | None:
    """The evaluation's refusals once this run holds the lock on `out`, before anything is written
    there: the checkpoint (loaded once, and dropped: weights that are corrupt or do not fit
    config.json are refused here), the tasks, the offline task's items (returned)."""
    from entroweight.models.checkpoint import (
        CheckpointError,
        a_model_of,
        load_checkpoint,
        read_checkpoint_config,
    )
    from entroweight.trainers.accuracy import OFFLINE_TASK, AccuracyError, require_lm_eval, unknown_tasks

    try:
        require_lm_eval()
        config = read_checkpoint_config(ckpt_dir)
        if config.get("kind") != "llama":
            raise CheckpointError(
                f"{ckpt_dir} holds {a_model_of(config.get('kind'))}; lm-eval reads llama checkpoints"
            )
        load_checkpoint(ckpt_dir)
        unknown = unknown_tasks(names)
        if unknown:
            raise AccuracyError(
                f"unknown --tasks {', '.join(unknown)}: lm-eval knows no such task (`lm_eval ls tasks`)"
            )
        return _items(ckpt_dir, documents, config, **kw) if OFFLINE_TASK in names else None
    except (AccuracyError, CheckpointError, ValueError) as e:
        _fail(str(e))


def _evaluate(ckpt_dir, names, dest: Path, items, kw) -> dict:
    """The evaluation written into the local directory `dest`: the items, lm-eval's scratch, the results."""
    from entroweight.models.checkpoint import made_from
    from entroweight.trainers.accuracy import evaluate_checkpoint, write_items

    dest.mkdir(parents=True, exist_ok=True)
    items_file = write_items(items, dest / ITEMS_FILE) if items is not None else None
    res = evaluate_checkpoint(  # AccuracyError, CheckpointError: said by the caller
        ckpt_dir,
        names,
        dest / ".lm-eval",
        items_file=items_file,
        batch_size=kw["batch_size"],
        device=kw["device"],
        num_fewshot=kw["num_fewshot"],
        limit=kw["limit"],
    )
    res.update(made_from(ckpt_dir))  # where it lies (not as the shell named it), and its weights
    return res  # sealed last by the contract, with what it is made of and the items' sha256


def _items(ckpt_dir, documents, config, **kw) -> list[dict]:
    """The offline task's items from --documents, sized to the checkpoint's context."""
    from tokenizers import Tokenizer

    from entroweight.trainers.bpb import checkpoint_tokenizer
    from entroweight.transforms.choice_items import build_items
    from entroweight.transforms.train_tokenizer import corpus_texts, rejects_said

    tok: Tokenizer = checkpoint_tokenizer(ckpt_dir, None, config.get("tokenizer_sha256"))
    rejected: collections.Counter = collections.Counter()
    texts = list(corpus_texts(list(documents), None, kw["text_column"], rejected))
    if rejected:  # said, not dropped silently: a truncated file's broken last line, say
        click.echo(
            f"--documents: {rejects_said(rejected)}; {len(texts)} read",
            err=True,
        )
    n_ctx = int(config["model"]["n_ctx"])  # what export_hf writes as max_position_embeddings
    return build_items(
        texts,
        tok,
        kw["prefix_tokens"],
        kw["continuation_tokens"],
        kw["choices"],
        kw["seed"],
        kw["items"],
        n_ctx,
        kw["stride"],
    )


COMMANDS = [evaluate_cmd]
