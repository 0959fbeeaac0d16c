"""The workflow engine: a parsed spec (`..spec`) run as steps, each up to date by its record
(`runner`, `steps`), and the output it declares (`outputs`)."""
