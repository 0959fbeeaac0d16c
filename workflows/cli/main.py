"""The `entroweight` command line. Each command is a thin shell over a library call.

Exit codes: see common.py.
"""

from __future__ import annotations

import collections
import importlib
import json
import sys

import click

from entroweight import __version__

from .common import (
    COUNT,
    Commands,
    GeneratedOptions,
    Location,
    _fail,
    engine_options,
    judge_stage_out,
    run_stage_cli,
    say_listing,
    stage_options,
    wait_option,
    writing_out,
)

# Command modules added by other areas; each exports COMMANDS, a list of click commands.
COMMAND_MODULES = (
    "train",
    "models",
    "score",
    "compare",
    "verify",
    "workflow",
    "export",
    "weigh",
    "evaluate",
    "synthesize",
)


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="entroweight")
def main():
    """entroweight: tokenize, score and weigh pretraining data; train on the weighted parquet."""


@main.command("train-tokenizer")
@click.argument("sources", nargs=-1, required=True)
@click.option("--vocab-size", type=int, default=8000, show_default=True)
@click.option(
    "--base",
    default=None,
    help="Tokenizer whose normalizer and pre-tokenizer to reuse (default: the bundled Llama 3 tokenizer).",
)
@click.option("--max-docs", type=COUNT, default=None, help="Train on the first N valid documents only.")
@click.option(
    "--algorithm",
    type=click.Choice(["bpe", "lz78", "lz78-freqgated"]),
    default="bpe",
    show_default=True,
    help="bpe: byte-level BPE. lz78 / lz78-freqgated: byte-level LZ78 dictionary, greedy longest match "
    "(a related-work baseline; --base is not used, pieces are GPT-2 pre-tokens). See docs/baselines.md.",
)
@click.option("--text-column", default="text", show_default=True, help="The field that holds the text.")
@click.option("--out", required=True, type=Location(file_okay=False))
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace the tokenizer (or another command's output) --out holds; what was tokenized with the "
    "old one no longer matches it.",
)
@wait_option
def train_tokenizer_cmd(sources, vocab_size, base, max_docs, algorithm, text_column, out, overwrite, wait):
    """Train a tokenizer of VOCAB_SIZE tokens (pad/bos/eos reserved) on SOURCES: BPE or LZ78."""
    from entroweight.transforms.sources import SourceError
    from entroweight.transforms.train_tokenizer import (
        TRAIN_TOKENIZER,
        corpus_texts,
        rejects_said,
        save_tokenizer,
        train_tokenizer,
        trained_from,
    )

    reads = [("the source", s) for s in sources] + [("--base", base)]
    rejected: collections.Counter = collections.Counter()

    def made_of() -> dict | None:  # after the path rule: its refusals come first
        try:
            say_listing(sources)
            return trained_from(list(sources), vocab_size, base, max_docs, algorithm, text_column)
        except (SourceError, ValueError) as e:
            _fail(str(e))

    trained = []

    def train() -> None:  # under the lock, before --out is touched: a refusal leaves it as it was
        try:
            texts = corpus_texts(list(sources), max_docs, text_column, rejected)
            trained.append(train_tokenizer(texts, vocab_size, algorithm, base, progress=sys.stderr.isatty()))
        except (SourceError, ValueError) as e:
            _fail(str(e))

    with writing_out(TRAIN_TOKENIZER, out, reads, made_of, overwrite, wait, "a tokenizer", train) as w:
        if w.nothing_to_do:
            click.echo(f"nothing to do: {out} already holds the tokenizer these arguments train")
            return
        path, sha = save_tokenizer(trained[0], w.dest)
    skipped = f"; {rejects_said(rejected)}" if rejected else ""
    n = trained[0].get_vocab_size()
    short = f"; {vocab_size} asked: the documents give no more" if n < vocab_size else ""
    click.echo(f"wrote {out}/{path.name} ({n} tokens, sha256 {sha}){short}{skipped}")


@main.command(cls=GeneratedOptions, generated=[engine_options])
@click.argument("sources", nargs=-1, required=True)
@click.option("--tokenizer", required=True, help="A tokenizer.json or a directory holding one.")
@click.option("--n-ctx", type=int, default=512, show_default=True)
@click.option(
    "--pack", is_flag=True, help="Pack documents into n_ctx windows (eos between) instead of one per row."
)
@click.option("--out", required=True, type=Location(file_okay=False))
@click.option("--shard-docs", type=int, default=None, help="Documents per shard (splits big files).")
@click.option("--text-column", default="text", show_default=True)
@click.option(
    "--reject-duplicates",
    is_flag=True,
    help="Reject a document whose id was seen before anywhere in the run's input (or in shards already in --out), naming the first copy; without it, such documents are kept and counted.",
)
@click.option(
    "--overflow",
    type=click.Choice(["split", "truncate"]),
    default="split",
    show_default=True,
    help="A document longer than --n-ctx: split continues it in the next rows (no text lost); "
    "truncate keeps its first n_ctx tokens (counted in the summary).",
)
@click.option(
    "--revision",
    default=None,
    help="hf: sources: the dataset revision (commit sha, branch or tag) to read. Default: its main "
    "branch, resolved once and recorded; a later run on the same --out that finds another revision "
    "is refused, so pin the recorded one here or write a new --out.",
)
@stage_options
def tokenize(
    sources,
    tokenizer,
    n_ctx,
    pack,
    out,
    shard_docs,
    text_column,
    reject_duplicates,
    overflow,
    revision,
    **eng,
):
    """Tokenize SOURCES into left-padded (or packed) sequences as zstd parquet shards."""
    from entroweight.pipelines.tokenize import TokenizeStage
    from entroweight.transforms.sources import SourceError
    from entroweight.transforms.tokenizer import TokenizerError

    reads = [("the source", s) for s in sources] + [("--tokenizer", tokenizer)]
    judged = judge_stage_out(out, reads, "tokenize", eng)
    try:
        say_listing(sources)  # cheap (no file is read): refuse before --out is created
        stage = TokenizeStage(
            list(sources),
            tokenizer,
            n_ctx,
            pack,
            shard_docs,
            text_column,
            reject_duplicates,
            overflow,
            revision,
        )
    except (SourceError, TokenizerError, ValueError) as e:
        _fail(str(e))
    try:
        run_stage_cli(stage, out, judged, **eng)
    except SourceError as e:
        _fail(str(e))


@main.command()
@click.argument("path", type=Location(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def inspect(path, as_json):
    """Schema, provenance metadata, row/token counts and id/weight statistics of PATH."""
    from entroweight.schemas.datadir import DataDirError
    from entroweight.schemas.manifest import counts_line
    from entroweight.transforms.inspect import summarize

    _check_inspectable(path)
    try:
        info = summarize(path)
    except (FileNotFoundError, DataDirError) as e:  # a shard that differs or does not decode
        _fail(str(e))
    if missing := info.get("missing_shards"):  # the figures are of the rest: said where a script sees it
        n = f"{len(missing)} shard(s)" if isinstance(missing, list) else "shards"
        click.echo(
            f"note: {n} of {path} missing or not matching their manifest; the figures are of the rest "
            f"(`entroweight verify {path}` says which and why)",
            err=True,
        )
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        if isinstance(value, dict):
            click.secho(f"{key}:", bold=True)
            for k, v in value.items():
                click.echo(f"  {k}: {v}")
        elif key == "upstream":
            click.secho(f"{key}:", bold=True)
            for counts in value:
                click.echo(f"  {counts_line(counts)}")
        else:
            click.echo(f"{click.style(key, bold=True)}: {value}")


def _check_inspectable(path: str) -> None:
    """Refuse (exit 2) what is not our parquet before reading it: a traceback helps nobody here."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from entroweight import storage
    from entroweight.schemas.datadir import DataDirError
    from entroweight.transforms.inspect import parquet_files

    try:
        files = parquet_files(path)
    except (DataDirError, OSError) as e:
        _fail(str(e))
    for f in files:
        try:
            with storage.open_input(f) as fh:
                names = set(pq.read_schema(fh).names)
        except (pa.ArrowException, OSError) as e:
            _fail(f"{f} is not a readable parquet file ({e})")
        if missing := sorted({"input_ids", "n_pad", "n_bytes"} - names):
            _fail(
                f"{f} is not entroweight data (no {', '.join(missing)} column): inspect reads what "
                "tokenize, score and weigh write"
            )


def _add_command_modules() -> None:
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"entroweight.workflows.cli.{name}")
        for command in module.COMMANDS:
            main.add_command(command)


_add_command_modules()

if __name__ == "__main__":
    main()
