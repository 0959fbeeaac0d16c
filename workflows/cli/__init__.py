"""The command line: `main` (the `entroweight` group) and one module per family of commands, each a
thin shell over a library call or the workflow engine."""
