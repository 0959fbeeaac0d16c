"""`entroweight verify DIR`: every shard against its manifest; exit 1 with the list of problems."""

from __future__ import annotations

import json

import click

from .cli_common import EXIT_FAILED_SHARDS, Location


@click.command("verify")
@click.argument("directory", type=Location(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print {directory, ok, problems} as JSON.")
def verify_cmd(directory, as_json):
    """Re-check every shard of DIRECTORY (tokenized or scored) against its manifest and contracts."""
    from entroweight.pipelines.verify import verify_dir

    problems = verify_dir(directory)
    if as_json:
        click.echo(json.dumps({"directory": directory, "ok": not problems, "problems": problems}, indent=2))
    elif problems:
        click.secho(f"{directory}: {len(problems)} problem(s)", fg="red", err=True)
        for p in problems:
            click.echo(f"  {p}", err=True)
    else:
        click.echo(f"{directory}: ok")
    if problems:
        raise SystemExit(EXIT_FAILED_SHARDS)


COMMANDS = [verify_cmd]
