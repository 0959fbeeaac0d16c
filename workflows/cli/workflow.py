"""`entroweight run WORKFLOW.yaml` and `entroweight report RUN_DIR`.

Exit codes (cli/common.py): 0 done or nothing to do, 1 a step failed after it started (failed shards,
verification problems, a crashed training), 2 the workflow or an input was refused before the step's
work, 3 another run holds RUN_DIR's lock.
"""

from __future__ import annotations

from pathlib import Path

import click

from .common import (
    EXIT_FAILED_SHARDS,
    EXIT_LOCKED,
    SECONDS,
    GeneratedOptions,
    Location,
    _fail,
    engine_kwargs,
    engine_options,
)


@click.command("run", cls=GeneratedOptions, generated=[engine_options])
@click.argument("workflow", type=Location(exists=True, dir_okay=False, local=True))
@click.option("--dry-run", is_flag=True, help="Print which steps and shards are done and which would run.")
@click.option("--overwrite", is_flag=True, help="Redo steps whose config changed instead of refusing.")
@click.option(
    "--wait",
    type=SECONDS,
    default=0,
    help="Seconds to wait for another run's lock on the run dir.",
)
def run_cmd(workflow, dry_run, overwrite, wait, **params):
    """Run WORKFLOW (a YAML file) end to end; every step skips what is already done."""
    from entroweight.pipelines import LockHeld, StageError, StageFailed

    from ..engine.runner import Runner, StepFailed, WorkflowError
    from ..spec import SpecError, load_workflow

    try:
        wf = load_workflow(workflow)
    except SpecError as e:
        _fail(str(e))
    knobs = engine_kwargs(params)  # an engine that is not installed: refused before the first step
    runner = Runner(
        wf,
        engine=knobs.pop("engine"),
        engine_options=knobs,
        dry_run=dry_run,
        overwrite=overwrite,
        wait=wait,
        echo=click.echo,
        workflow_file=str(Path(workflow).resolve()),
    )
    try:
        runner.run()
    except LockHeld as e:
        _fail(str(e), EXIT_LOCKED)
    except (StageFailed, StepFailed) as e:
        _fail(str(e), EXIT_FAILED_SHARDS)
    except (StageError, WorkflowError) as e:
        _fail(str(e))


@click.command("report")
@click.argument("run_dir", type=Location(exists=True, file_okay=False, local=True))
@click.option(
    "--out",
    default=None,
    type=Location(),
    help="HTML file to write (default: the run's report.out, RUN_DIR/report.html unless the workflow set it).",
)
@click.option(
    "--samples",
    type=click.IntRange(0, 50),
    default=None,
    help="Sample texts per scorer (default: the run's report.samples, 3 unless the workflow set it).",
)
def report_cmd(run_dir, out, samples):
    """Write one self-contained HTML report of RUN_DIR (plots embedded; opens offline)."""
    from entroweight import output, storage

    from ..report.data import load_run
    from ..report.html import ReportError, check_report_out, write_report
    from ..spec import REPORT_FILE, ReportSpec

    try:
        if out is not None:  # RUN_DIR/report.html, its default, lies inside what it reads by design
            output.check_output(
                out,
                [("RUN_DIR", run_dir)],
                "report",
                overwrite=None,
                may_lie_inside=True,
                apart=True,
                file=True,
            )
            if storage.is_url(out):  # no bucket, no credentials: now, not after the report is built
                try:
                    storage.check_writable(storage.path(out).parent)
                except OSError as e:
                    _fail(f"cannot write to --out {out}: {e.strerror or e}")
            check_report_out(out)
        _, wf = load_run(run_dir)
        recorded = wf.report or ReportSpec()  # what the run's own report step writes: the defaults
        if out is not None:
            own = {storage.key(storage.path(run_dir) / name) for name in {REPORT_FILE, recorded.out}}
            if storage.relation(out, run_dir) == "lies inside" and storage.key(out) not in own:
                _fail(  # the one exception: elsewhere inside, it would mix into what the run rewrites
                    f"--out {out} lies inside RUN_DIR {run_dir}, which report reads: write its report "
                    f"({' or '.join(sorted(own))}) or a file outside it"
                )
        path = write_report(
            run_dir,
            out or storage.path(run_dir) / recorded.out,
            samples=recorded.samples if samples is None else samples,
            max_tokens=recorded.max_tokens,
        )
    except (ReportError, storage.OutputRefused, storage.StorageError) as e:
        _fail(str(e))
    click.echo(f"wrote {path}")


COMMANDS = [run_cmd, report_cmd]
