"""`entroweight export-data SCORED --format megatron|litdata|hf --out DIR`: feed another trainer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click

from .common import EXIT_LOCKED, Location, _fail


@click.command("export-data")
@click.argument("scored", type=Location(exists=True, file_okay=False))
@click.option(
    "--format",
    "fmt",
    required=True,
    metavar="megatron|litdata|hf",
    help="megatron: Megatron-LM/NeMo .bin/.idx + a weight sidecar; litdata: LitData chunks; "
    "hf: parquet + dataset card for datasets.load_dataset / push_to_hub. See docs/export.md.",
)
@click.option("--out", required=True, type=Location(file_okay=False))
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --out.")
def export_data_cmd(scored, fmt, out, overwrite):
    """Write the scored shards of SCORED (tokens + per-token weights) in a trainer's own format."""
    from entroweight import storage
    from entroweight.pipelines.export_data import ExportError, export_data

    try:  # every rule of its output: entroweight.output.writing, inside export_data
        record = export_data(scored, out, fmt, overwrite, workflow_bpb(scored), advise_wait=False)
    except storage.OutputHeld as e:
        _fail(str(e), EXIT_LOCKED)
    except (ExportError, storage.StorageError) as e:
        _fail(str(e))
    c = record["counts"]
    size = record["bytes_per_real_token"]
    what = f"({fmt}): {c['documents']} documents, {c['rows']} rows, {c['real_tokens']} tokens" + (
        f", {size} bytes per token" if size is not None else ""
    )
    if record.get("up_to_date"):
        click.echo(f"nothing to do: {out} already holds this export of {scored} {what}")
    else:
        click.echo(f"wrote {out} {what}")


def workflow_bpb(scored: str) -> list[dict]:
    """The BPB results of the workflow whose run directory holds SCORED (none when it is not in one)."""
    from ..engine.runner import RUN_FILE
    from ..report.data import ReportError, read_result

    for root in Path(scored).resolve().parents:
        run = root / RUN_FILE
        if not run.exists():
            continue
        eval_spec = json.loads(run.read_text()).get("config", {}).get("eval") or {}
        ev = root / eval_spec.get("out", "eval")
        try:  # each result read as the report reads it: an edited one is refused, not put on the card
            # the main text's (seed-N.json), as the report's BPB table: not the held-out split's too
            main = [p for p in sorted(ev.glob("*/seed-*.json")) if re.fullmatch(r"seed-\d+\.json", p.name)]
            rows = [read_result(p, "evaluation") for p in main]
            if (ev / "unigram.json").exists():
                rows.append({"run": "unigram baseline", **read_result(ev / "unigram.json", "evaluation")})
        except ReportError as e:
            _fail(str(e))
        return [{k: r.get(k) for k in ("run", "seed", "loss", "bpb")} for r in rows if "bpb" in r]
    return []


COMMANDS = [export_data_cmd]
