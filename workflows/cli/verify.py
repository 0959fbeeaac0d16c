"""`entroweight verify DIR`: every shard against its manifest; exit 1 with the list of problems, exit 2
for a directory that is no stage's output at all (a wrong argument: nothing to check)."""

from __future__ import annotations

import json

import click

from .common import EXIT_FAILED_SHARDS, Location, _fail


@click.command("verify")
@click.argument("directory", type=Location(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print {directory, ok, problems} as JSON.")
def verify_cmd(directory, as_json):
    """Re-check every shard of DIRECTORY (tokenized or scored) against its manifest and contracts."""
    from entroweight.pipelines.verify import verify_dir
    from entroweight.schemas.datadir import DataDir
    from entroweight.schemas.manifest import STAGE_FILE

    if not DataDir(directory).holds_stage_files:  # a wrong argument, not a damaged output: refused
        _fail(
            f"{directory} is not a stage's output (no {STAGE_FILE}): verify checks what tokenize, score "
            "and weigh write"
        )
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
