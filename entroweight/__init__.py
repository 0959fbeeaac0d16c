"""entroweight: token-level entropy-weighted pretraining data.

The installed package maps each top-level folder of the repository onto a subpackage
(``entroweight.schemas`` is ``schemas/``, and so on; see pyproject.toml). docs/design.md maps the
code and cites "the write-up" that docstrings and docs refer to.
"""

__version__ = "0.1.0"
