"""Workflows: what a workflow is (`spec`, and what its steps share: `quantiles`, `results`), and three
concerns, each a sub-package importing only those below it: `cli` (the commands) -> `engine` (a spec
run as steps) -> `report` (a run's records read back and shown) -> the modules here."""
