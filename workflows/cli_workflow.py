"""`entroweight run WORKFLOW.yaml` and `entroweight report RUN_DIR`.

Exit codes (cli_common.py): 0 done or nothing to do, 1 a step failed after it started (failed shards,
verification problems, a crashed training), 2 the workflow or an input was refused before the step's
work, 3 another run holds RUN_DIR's lock.
"""

from __future__ import annotations

from pathlib import Path

import click

from .cli_common import EXIT_FAILED_SHARDS, EXIT_LOCKED, _engine_kwargs, _fail


@click.command("run")
@click.argument("workflow", type=click.Path(exists=True, dir_okay=False))
@click.option("--engine", type=click.Choice(["local", "beam", "ray"]), default="local", show_default=True)
@click.option(
    "--beam-option",
    "beam_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Beam pipeline option (repeatable).",
)
@click.option("--ray-address", default=None, help="Ray cluster address (default: a local Ray in process).")
@click.option("--workers", type=int, default=None, help="Parallel workers of the data stages.")
@click.option("--dry-run", is_flag=True, help="Print which steps and shards are done and which would run.")
@click.option("--overwrite", is_flag=True, help="Redo steps whose config changed instead of refusing.")
@click.option("--wait", type=float, default=0, help="Seconds to wait for another run's lock on the run dir.")
def run_cmd(workflow, engine, beam_options, ray_address, workers, dry_run, overwrite, wait):
    """Run WORKFLOW (a YAML file) end to end; every step skips what is already done."""
    from entroweight.pipelines import LockHeld, StageError, StageFailed, require_engine

    from .runner import Runner, StepFailed, WorkflowError
    from .spec import SpecError, load_workflow

    try:
        wf = load_workflow(workflow)
    except SpecError as e:
        _fail(str(e))
    runner = Runner(
        wf,
        engine=engine,
        engine_options=_engine_kwargs(engine, beam_options, ray_address, workers),
        dry_run=dry_run,
        overwrite=overwrite,
        wait=wait,
        echo=click.echo,
        workflow_file=str(Path(workflow).resolve()),
    )
    try:
        require_engine(engine)  # before the first step: not after a tokenizer was trained
        runner.run()
    except LockHeld as e:
        _fail(str(e), EXIT_LOCKED)
    except (StageFailed, StepFailed) as e:
        _fail(str(e), EXIT_FAILED_SHARDS)
    except (StageError, WorkflowError) as e:
        _fail(str(e))


@click.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", default=None, help="HTML file to write (default: RUN_DIR/report.html).")
@click.option("--samples", type=int, default=3, show_default=True, help="Sample texts per scorer.")
def report_cmd(run_dir, out, samples):
    """Write one self-contained HTML report of RUN_DIR (plots embedded; opens offline)."""
    from .report import ReportError, write_report

    try:
        path = write_report(run_dir, out, samples=samples)
    except ReportError as e:
        _fail(str(e))
    click.echo(f"wrote {path}")


COMMANDS = [run_cmd, report_cmd]
