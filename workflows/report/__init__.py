"""The report of a workflow run: the values read from its records (`data`), the statistics of its
comparisons (`stats`), and the page (`html`)."""
