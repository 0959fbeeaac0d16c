"""Rows of one document are recognised by what tokenize recorded (`row_in_doc`), never by equal ids;
data written before that column existed is refused by every reader that groups rows into documents
(score, weigh, export-data), exit 2 before anything is written, naming the column and what to do.

Why refuse rather than fall back to equal ids: the fallback is the bug (two documents that share an
id, kept by default, glued into one), and re-tokenizing is cheap next to scoring; the trainer, which
never groups rows, still reads such data."""

from __future__ import annotations

from click.testing import CliRunner
from stagecopy import stage_subset
from test_export_data import scored  # noqa: F401 - fixture
from test_score_stage import small_data, tiny_llama  # noqa: F401 - fixtures

from entroweight.workflows.cli.main import main


def without_row_in_doc(src, dst):
    return stage_subset(src, dst, edit=lambda t: t.drop_columns(["row_in_doc"]))


def test_old_data_is_refused_by_every_reader_that_groups_documents(small_data, scored, tiny_llama, tmp_path):  # noqa: F811
    old_tokens = without_row_in_doc(small_data, tmp_path / "old_tokens")
    old_scored = without_row_in_doc(scored, tmp_path / "old_scored")
    cases = {
        "score": ["score", str(old_tokens), "--scorer", "causal_loss", "--model", str(tiny_llama)],
        "weigh": ["weigh", str(old_scored)],
        "export-data": ["export-data", str(old_scored), "--format", "hf"],
    }
    for name, args in cases.items():
        out = tmp_path / f"out-{name}"
        res = CliRunner().invoke(main, [*args, "--out", str(out)])
        assert res.exit_code == 2, (name, res.output)
        assert "row_in_doc" in res.output and "tokenize the sources again" in res.output, (name, res.output)
        assert "Traceback" not in res.output
        assert not out.exists() or not any(out.iterdir()), name
