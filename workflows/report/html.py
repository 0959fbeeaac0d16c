"""`entroweight report RUN_DIR`: one self-contained HTML page of a workflow run (opens offline).

Sections: the experiment's headline (a table of every run's BPB on each evaluation text, mean ± std
over seeds, Δ and the paired test against the reference seed by seed with each run's verdict and,
within noise, the smallest difference it could have detected; the primary comparison, the verdict
rule (workflows/report/stats.py) and one sentence computed from them: which runs beat the reference, which
lose, which are within noise); provenance and
config; per scorer the entropy and weight histograms, mean entropy by position, sample texts with
every token shaded by its entropy (the write-up's red highlighting, decoded from exact token bytes);
scorer agreement; training curves; the BPB table of the reference and weighted runs over seeds with
each run's verdict sentence.

The values come from `report/data.py`; the page is the Jinja2 template `templates/report.html.j2`
(autoescaped); this module draws the plots (matplotlib's Agg backend, PNGs embedded as base64) and
shades the sample texts. Every number in the BPB tables is also in a `data-value` attribute, so a
test (or a script) can read the page back.
"""

from __future__ import annotations

import base64
import functools
import html
import io
import os
from pathlib import Path

import numpy as np

from entroweight import storage
from entroweight.transforms.writer import write_text_atomic

from ..spec import REPORT_FILE, REPORT_SUFFIX, is_report_name
from .data import (  # noqa: F401 - re-exported: the report's public names
    TRUTH_NAME,
    ReportError,
    bpb_table,
    compare,
    load_run,
    outcome,
    read_metrics,
    read_scores,
    report_data,
    verdict,
    verdict_sentence,
)

E = html.escape


# -- drawing
def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def histograms(name: str, sc: dict) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 2.8))
    for ax, key, color in ((axes[0], "entropy", "tab:red"), (axes[1], "weight", "tab:blue")):
        v = sc[key]
        if v is None or not len(v):
            ax.set_title(f"{key}: not stored")
            continue
        ax.hist(v, bins=60, color=color, alpha=0.8)
        ax.set_title(f"{name}: {key} (mean {v.mean():.3f})")
        ax.set_xlabel(key)
    return _png(fig)


def position_plot(scores: dict[str, dict]) -> str:
    plt = _plt()
    named = [(n, s) for n, s in scores.items() if s["entropy"] is not None]
    fig, axes = plt.subplots(len(named), 1, figsize=(9, 1.9 * len(named)), sharex=True, squeeze=False)
    for ax, (name, sc) in zip(axes[:, 0], named, strict=True):
        ax.plot(sc["by_position"], lw=1)
        ax.set_ylabel(name, fontsize=8)
    axes[-1, 0].set_xlabel("tokens of context before the token (position in its document's window)")
    return _png(fig)


def curves_plot(series: dict[str, list[list[dict]]], title: str) -> str:
    """CE by step; per group the seeds as thin lines and their mean as a thick one."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for i, (name, runs) in enumerate(series.items()):
        color = f"C{i}"
        # a non-finite CE is logged as null (the trainer's rule): a gap in its line, NaN to numpy
        curves = [
            ([m["step"] for m in r], [np.nan if m.get("ce") is None else m["ce"] for m in r])
            for r in runs
            if r
        ]
        for steps, ce in curves:
            ax.plot(steps, ce, color=color, lw=0.6, alpha=0.4)
        if curves:
            n = min(len(c[0]) for c in curves)
            mean = np.mean([c[1][:n] for c in curves], axis=0)
            ax.plot(curves[0][0][:n], mean, color=color, lw=1.8, label=f"{name} ({len(curves)} seed(s))")
    ax.set_xlabel("step")
    ax.set_ylabel("training CE (nats)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _png(fig)


def highlight(tok, ids: np.ndarray, values: np.ndarray) -> str:
    """The tokens' exact bytes as text, each shaded red by its entropy (min-max within the row).

    A token that ends inside a UTF-8 character is joined with the next ones until the bytes decode,
    and the run gets the largest value of its tokens."""
    v = values.astype(np.float64)
    lo, hi = np.nanmin(v), np.nanmax(v)
    norm = (v - lo) / (hi - lo) if hi > lo else np.zeros_like(v)
    tb = tok.token_bytes
    out, pending, pending_v, pending_raw = [], b"", 0.0, 0.0
    for i, t in enumerate(ids):
        pending += tb[int(t)]
        pending_v, pending_raw = max(pending_v, norm[i]), max(pending_raw, v[i])
        try:
            text = pending.decode("utf-8")
        except UnicodeDecodeError:
            if i < len(ids) - 1:
                continue
            text = pending.decode("utf-8", errors="replace")
        if text:
            out.append(
                f'<span style="background: rgba(220,0,0,{pending_v:.2f})" title="{pending_raw:.3f}">'
                f"{E(text)}</span>"
            )
        pending, pending_v, pending_raw = b"", 0.0, 0.0
    return "".join(out)


# -- the page
@functools.cache
def _template():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("entroweight.workflows.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,  # a name the template expects and the data lacks: an error
        trim_blocks=True,
    )
    env.filters |= {
        "repr": repr,
        "f4": lambda v: "undefined" if v is None else f"{v:.4f}",
        "thousands": lambda v: f"{v:,}",
    }
    return env.get_template("report.html.j2")


def build_report(run_dir: str | Path, samples: int = 3, max_tokens: int = 2_000_000) -> str:
    data = report_data(run_dir, samples, max_tokens)
    scores, tok, curves = data["scores"], data["tokenizer"], data["curves"]
    plots = [curves_plot(curves["models"], "models trained before scoring")] if curves["models"] else []
    if curves["runs"]:
        plots.append(curves_plot(curves["runs"], "experiment runs (thin: seeds, thick: mean)"))
    if tok is not None:
        for s in data["samples"] or ():
            s["html"] = highlight(tok, s["ids"], s["values"])
    if data["realism"] is not None:  # the truth beside the scores: how language-like the teacher is
        scores = {TRUTH_NAME: data["realism"], **scores}
    return _template().render(
        **data,
        histograms={name: histograms(name, sc) for name, sc in scores.items()},
        position_plot=position_plot(scores) if scores else "",
        curve_plots=plots,
    )


def write_report(
    run_dir: str | Path, out: str | Path | None = None, samples: int = 3, max_tokens: int = 2_000_000
) -> Path:
    out = storage.path(out) if out else Path(run_dir) / REPORT_FILE  # a URL stays one (s3://...)
    check_report_out(out)
    try:
        html = build_report(run_dir, samples, max_tokens)
    except ReportError:
        raise
    except (ValueError, TypeError, KeyError) as e:  # a record holding other values than the run wrote
        raise ReportError(
            f"{run_dir} holds a record the report cannot read ({type(e).__name__}: {e}); rerun "
            "`entroweight run` to make the run's records again"
        ) from None
    write_text_atomic(html, out)
    return out


def check_report_out(out: str | Path) -> None:
    """The report is one HTML file: --out names a file as `spec.is_report_name` says, never a directory,
    nor a file the report reads (every record of a run is JSON, parquet or a checkpoint)."""
    if storage.blank(out):
        raise ReportError("--out is empty (an unset variable?): name the HTML file to write")
    given, out = out, storage.path(out)
    if out.is_dir():
        raise ReportError(
            f"--out {out} is a directory; name the HTML file to write (e.g. {out}/{REPORT_FILE})"
        )
    if not is_report_name(given):
        raise ReportError(
            f"--out {given}: the report is one HTML file; name a file ending in {REPORT_SUFFIX}"
        )
    if not _ours_or_absent(out):
        raise ReportError(
            f"--out {given} is a file the report did not write (it writes over its own earlier "
            "reports only): name another file, or move that one away"
        )


#: What every report's <head> holds (the template's <title>): a file without it is someone else's.
REPORT_MARK = b"<title>entroweight report</title>"


def _ours_or_absent(out) -> bool:
    """Whether the report may write `out`: nothing there, an empty file, or a report it wrote. Not a
    FIFO or a device (reading one would block, writing one would not make a file)."""
    if storage.is_local(out) and os.path.lexists(out) and not os.path.isfile(out):
        return os.path.islink(out) and not os.path.exists(out)  # a link to nothing holds nothing
    try:
        with storage.open_input(out) as f:
            head = f.read(1024)
    except FileNotFoundError:
        return True
    return not head or REPORT_MARK in head
