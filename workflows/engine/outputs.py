"""The outputs of the workflow commands (entroweight.output's contract): a workflow run's directory.

`run` writes run.json, which records the names its steps write directly in its run_dir (`RUN_OUTPUTS`):
any other name there is a user's file, which no --overwrite removes.
"""

from __future__ import annotations

import json

from entroweight import storage
from entroweight.output import Mark, Output, declare

RUN_FILE = "run.json"
#: run.json's list of the names the workflow's steps write directly in its run_dir
RUN_OUTPUTS = "outputs"


def run_outputs(directory) -> list[str] | None:
    """The names a workflow run's steps write in its run_dir, as its run.json records them; None for a
    record from before they were recorded (or unreadable): then no name is told apart from the run's."""
    try:
        return [str(n) for n in json.loads((storage.path(directory) / RUN_FILE).read_bytes())[RUN_OUTPUTS]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


RUN = declare(
    Output(
        "run",
        marks=(Mark(RUN_FILE, ("steps", "config", "code_version", "workflow_file")),),
        files_of=run_outputs,
    )
)
