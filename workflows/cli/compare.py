"""`entroweight compare`: agreement (R², Pearson, Spearman) of two scorers on the same sequences."""

from __future__ import annotations

import json

import click

from .common import Location, _fail


@click.command("compare")
@click.argument("scored_dir_a", type=Location(exists=True, file_okay=False))
@click.argument("scored_dir_b", type=Location(exists=True, file_okay=False))
@click.option("--column", type=click.Choice(["entropy", "weight"]), default="entropy", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def compare_cmd(scored_dir_a, scored_dir_b, column, as_json):
    """R², Pearson and Spearman between two scored directories of the same tokenized data, over the real
    tokens of the sequences (seq_id) both hold."""
    import pyarrow as pa

    from entroweight.transforms.agreement import AgreementError, compare_dirs

    try:
        result = compare_dirs(scored_dir_a, scored_dir_b, column)
    except AgreementError as e:
        _fail(str(e))
    except (pa.ArrowException, OSError) as e:  # a part-*.parquet that is not parquet at all
        _fail(f"cannot read the scored data: {e}")
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    # each side by its directory and scorer: two runs of one scorer (L1 and cosine occlusion) differ
    click.echo(
        f"A {scored_dir_a} ({result['scorer_a']}) vs B {scored_dir_b} ({result['scorer_b']}), {column}"
    )
    if result["pearson"] is None:  # a side of one value: no correlation to tell
        sides = " and ".join(result["constant"]) or "a side"
        click.echo(f"  undefined: {sides} holds one value for every token (R², Pearson, Spearman)")
    else:
        click.echo(f"  R²        {result['r2']:.4f}")
        click.echo(f"  Pearson   {result['pearson']:.4f}")
        click.echo(f"  Spearman  {result['spearman']:.4f}")
    if result["slope"] is not None:  # B on A: defined while A varies
        click.echo(f"  line      B = {result['slope']:.4f} · A {result['intercept']:+.4f}")
    click.echo(f"  tokens    {result['n_tokens']:,} in {result['n_sequences']:,} sequences")
    if result["only_a"] or result["only_b"]:
        click.echo(f"  skipped   {result['only_a']} sequences only in A, {result['only_b']} only in B")


COMMANDS = [compare_cmd]
