"""`python -m entroweight.workflows.cli ...` (torchrun's form): the `entroweight` command."""

from .main import main

main()
