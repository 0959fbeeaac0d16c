"""`entroweight report RUN_DIR`: one self-contained HTML page of a workflow run (opens offline).

Sections: the experiment's headline (a table of every run's BPB on each evaluation text, mean ± std
over seeds, Δ and Welch's t-test against the reference, and one sentence computed from them: which
runs beat the reference beyond the seed noise, which lose, which are within it); provenance and config; per scorer the entropy and weight histograms, mean entropy by
position, sample texts with every token shaded by its entropy (the write-up's red highlighting,
decoded from exact token bytes); scorer agreement; training curves; the BPB table of the reference
and weighted runs over seeds with a sentence on whether the difference exceeds the seed noise.

Plots are PNGs from matplotlib's Agg backend, embedded as base64. Every number in the BPB table
is also in a `data-value` attribute, so a test (or a script) can read the page back.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import yaml

from entroweight.transforms.writer import write_text_atomic

from .spec import TOKENS, SpecError, Workflow, parse_workflow

E = html.escape


class ReportError(ValueError):
    """RUN_DIR is not a workflow run (no run.json); the message says what to do."""


# -- reading the run
def load_run(run_dir: str | Path) -> tuple[dict, Workflow]:
    run_dir = Path(run_dir)
    record_file = run_dir / "run.json"
    if not record_file.is_file():
        raise ReportError(
            f"{run_dir} has no run.json: it is not a workflow run; run `entroweight run WORKFLOW.yaml`"
        )
    record = json.loads(record_file.read_text())
    try:
        wf = parse_workflow(record["config"], str(record_file))
    except SpecError as e:
        raise ReportError(str(e)) from None
    wf.run_dir = str(run_dir)  # outputs are relative to the run dir, wherever it is now
    return record, wf


def read_scores(score_dir: Path, max_tokens: int) -> dict | None:
    """Entropy/weight of real tokens (flat), mean entropy by context position, and the first rows."""
    files = sorted(score_dir.glob("part-*.parquet"))
    if not files:
        return None
    ent, wts, rows = [], [], []
    pos_sum = pos_n = None
    n_tokens = n_seq = 0
    for f in files:
        names = pq.read_schema(f).names
        cols = [c for c in ("input_ids", "n_pad", "entropy", "weight") if c in names]
        t = pq.read_table(f, columns=cols)
        ids = _matrix(t.column("input_ids"))
        n_pad = t.column("n_pad").to_numpy()
        e = _matrix(t.column("entropy")).astype(np.float64) if "entropy" in names else None
        w = _matrix(t.column("weight")).astype(np.float64) if "weight" in names else None
        if w is not None and t.schema.field("weight").type.value_type.bit_width == 8:
            w = w / 255.0
        width = ids.shape[1]
        real = np.arange(width)[None, :] >= n_pad[:, None]
        if pos_sum is None:
            pos_sum, pos_n = np.zeros(width), np.zeros(width)
        if e is not None:
            # position = tokens of context before this one (left padding: column - n_pad)
            ctx = np.arange(width)[None, :] - n_pad[:, None]
            np.add.at(pos_sum, ctx[real], e[real])
            np.add.at(pos_n, ctx[real], 1)
            ent.append(e[real])
        if w is not None:
            wts.append(w[real])
        for i in range(min(len(ids), 50 - len(rows))):
            rows.append((ids[i, n_pad[i] :], None if e is None else e[i, n_pad[i] :]))
        n_tokens += int(real.sum())
        n_seq += len(ids)
        if n_tokens >= max_tokens:
            break
    with np.errstate(invalid="ignore", divide="ignore"):
        by_pos = np.where(pos_n > 0, pos_sum / np.maximum(pos_n, 1), np.nan)
    return {
        "entropy": np.concatenate(ent) if ent else None,
        "weight": np.concatenate(wts) if wts else None,
        "by_position": by_pos,
        "rows": rows,
        "n_tokens": n_tokens,
        "n_sequences": n_seq,
        "n_files": len(files),
    }


def _matrix(col) -> np.ndarray:
    """A fixed-width list column (left-padded or packed rows) as a (rows, n_ctx) array."""
    arr = col.combine_chunks()
    flat = arr.flatten().to_numpy(zero_copy_only=False)
    return flat.reshape(len(arr), -1) if len(arr) else flat.reshape(0, 0)


def read_metrics(ckpt: Path) -> list[dict]:
    path = ckpt / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


TEXT_NAMES = {"main": "WikiText-2", "heldout": "held-out source text"}


def text_name(wf: Workflow, text: str) -> str:
    if text == "main":
        return Path(wf.eval.text).name if wf.eval.text else TEXT_NAMES["main"]
    return f"held-out ({wf.holdout.docs} documents never trained on)"


def bpb_table(wf: Workflow, text: str = "main") -> dict:
    """Per run: each seed's BPB (from eval/RUN/seed-S[.TEXT].json), mean, std; per compared run: the
    difference to the reference and whether it exceeds the seed noise."""
    runs = []
    for r in wf.train.runs:
        seeds = {}
        for s in wf.train.seeds:
            f = wf.eval_file(r.name, s, text)
            if f.is_file():
                seeds[s] = json.loads(f.read_text())["bpb"]
        v = np.array(list(seeds.values()), dtype=np.float64)
        runs.append(
            {
                "run": r.name,
                "data": r.data,
                "loss": r.loss,
                "seeds": seeds,
                "mean": float(v.mean()) if len(v) else None,
                "std": float(v.std(ddof=1)) if len(v) > 1 else None,
            }
        )
    ref_name = wf.reference_run()
    ref = next((x for x in runs if x["run"] == ref_name), None)
    comparisons = [compare(x, ref) for x in runs if ref is not None and x is not ref and x["seeds"]]
    return {"reference": ref_name, "runs": runs, "comparisons": comparisons}


def compare(run: dict, ref: dict) -> dict:
    """Δ mean BPB of `run` vs `ref`, and whether it exceeds seed noise: |Δ| > 2·pooled std and
    Welch's t-test p < 0.05 (both, with at least 2 seeds each; otherwise noise cannot be told)."""
    a, b = np.array(list(run["seeds"].values())), np.array(list(ref["seeds"].values()))
    out = {"run": run["run"], "reference": ref["run"], "delta": None, "pooled_std": None, "p_value": None}
    if not len(a) or not len(b):
        out["verdict"] = "no BPB for one of the runs yet"
        return out
    out["delta"] = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        out["exceeds_noise"] = None
        out["verdict"] = "one seed only: the seed noise cannot be estimated; add seeds"
        return out
    from scipy import stats

    pooled = math.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2)
    t = stats.ttest_ind(a, b, equal_var=False)
    p = float(t.pvalue) if np.isfinite(t.pvalue) else (0.0 if out["delta"] != 0 else 1.0)
    exceeds = abs(out["delta"]) > 2 * pooled and p < 0.05
    out |= {"pooled_std": pooled, "p_value": p, "exceeds_noise": bool(exceeds)}
    direction = "lower (better)" if out["delta"] < 0 else "higher (worse)"
    if exceeds:
        out["verdict"] = (
            f"{run['run']} is {direction} than {ref['run']} by {abs(out['delta']):.4f} BPB, beyond the seed "
            f"noise (|Δ| > 2 × pooled std {pooled:.4f}; Welch t-test p = {p:.3g})."
        )
    else:
        out["verdict"] = (
            f"{run['run']} differs from {ref['run']} by {out['delta']:+.4f} BPB: within the seed noise "
            f"(pooled std {pooled:.4f}, Welch t-test p = {p:.3g}); no difference can be claimed."
        )
    return out


def outcome(c: dict) -> str:
    """beats | loses | within noise | undecided (fewer than 2 seeds or no BPB)."""
    if c.get("exceeds_noise") is None:
        return "undecided"
    if not c["exceeds_noise"]:
        return "within noise"
    return "beats" if c["delta"] < 0 else "loses"


def verdict_sentence(wf: Workflow, tables: dict[str, dict]) -> str:
    """One sentence from the numbers: the runs grouped by their outcome against the reference on
    every evaluation text (beats / loses / within noise)."""
    ref = wf.reference_run()
    names = {t: "held-out text" if t == "heldout" else text_name(wf, t) for t in tables}
    groups: dict[tuple, list[str]] = {}
    for r in wf.train.runs:
        if r.name == ref:
            continue
        comps = [next((c for c in tab["comparisons"] if c["run"] == r.name), {}) for tab in tables.values()]
        groups.setdefault(tuple(outcome(c) for c in comps), []).append(r.name)
    if not groups:
        return "Only the reference was trained: nothing to compare."
    clauses = []
    for kinds, runs in groups.items():
        who = _join(runs)
        if len(set(kinds)) == 1:
            clauses.append(f"{who} {_say(kinds[0], len(runs))} on {_join(list(names.values()))}")
        else:
            clauses.append(
                f"{who}: "
                + ", ".join(f"{_say(k, len(runs))} on {names[t]}" for t, k in zip(tables, kinds, strict=True))
            )
    n = len(wf.train.seeds)
    seeds = f"{n} seed{'s' if n != 1 else ''} each"
    return (
        f"Against {ref} ({seeds}; beyond noise: |Δ| > 2 pooled std and Welch p < 0.05), "
        + "; ".join(clauses)
        + "."
    )


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _say(kind: str, n: int = 1) -> str:
    one = n == 1
    return {
        "beats": f"beat{'s' if one else ''} the reference beyond noise",
        "loses": f"lose{'s' if one else ''} to the reference beyond noise",
        "within noise": f"{'is' if one else 'are'} within noise of the reference",
        "undecided": "cannot be told from the reference (fewer than 2 seeds)",
    }[kind]


def _headline(wf: Workflow) -> str:
    """The experiment at a glance: every run × evaluation text, mean ± std, Δ and p, and the verdict."""
    texts = wf.eval_texts()
    tables = {t: bpb_table(wf, t) for t in texts}
    head = "".join(
        f"<th>{E(text_name(wf, t))}: BPB mean ± std</th><th>Δ vs reference</th><th>Welch p</th>"
        for t in texts
    )
    rows = []
    for i, r in enumerate(wf.train.runs):
        cells = []
        for t in texts:
            run = tables[t]["runs"][i]
            c = next((c for c in tables[t]["comparisons"] if c["run"] == r.name), None)
            ms = f"{run['mean']:.4f}" if run["mean"] is not None else "–"
            ms += f" ± {run['std']:.4f}" if run["std"] is not None else ""
            attrs = f"data-head-run='{E(r.name)}' data-head-text='{t}' data-head-mean='{run['mean']!r}'"
            cells.append(f"<td class='num' {attrs} data-head-n='{len(run['seeds'])}'>{ms}</td>")
            if c is None or c["delta"] is None:
                cells.append(
                    "<td>reference</td><td></td>"
                    if r.name == tables[t]["reference"]
                    else "<td></td><td></td>"
                )
                continue
            p = "" if c["p_value"] is None else f"{c['p_value']:.3g}"
            cells.append(
                f"<td class='num' data-head-run='{E(r.name)}' data-head-text='{t}' data-head-outcome='{outcome(c)}'>"
                f"{c['delta']:+.4f}</td><td class='num'>{p}</td>"
            )
        label = f"{r.loss}" + (f", normalize {r.normalize}" if r.loss == "weighted_ce" else "")
        rows.append(f"<tr><td>{E(r.name)}</td><td>{E(r.data)}</td><td>{E(label)}</td>{''.join(cells)}</tr>")
    n = len(wf.train.seeds)
    return (
        f"<h2>Experiment: bits per byte ({n} seed{'s' if n != 1 else ''} per run, same tokens and steps)</h2>"
        f"<p class='headline-verdict'>{E(verdict_sentence(wf, tables))}</p>"
        f"<table><tr><th>run</th><th>data</th><th>loss</th>{head}</tr>{''.join(rows)}</table>"
        "<p>Lower is better. Δ: mean BPB minus the reference's; Welch's t-test (unequal variances) over "
        "seeds.</p>"
    )


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
        curves = [([m["step"] for m in r], [m["ce"] for m in r]) for r in runs if r]
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
def build_report(run_dir: str | Path, samples: int = 3, max_tokens: int = 2_000_000) -> str:
    record, wf = load_run(run_dir)
    parts = [f"<h1>entroweight run: {E(str(record.get('config', {}).get('run_dir', run_dir)))}</h1>"]
    if wf.train is not None and wf.eval is not None:
        parts.append(_headline(wf))
    parts.append(_provenance(record))
    parts.append(_truncation(wf.tokens_dir()))

    scores = {}
    for s in wf.scores:
        sc = read_scores(wf.score_dir(s.name), max_tokens)
        if sc is not None:
            scores[s.name] = sc
    tok = _tokenizer(wf)
    if scores:
        parts.append("<h2>Scorers</h2>")
        parts.append(_scorer_table(wf, scores))
        for name, sc in scores.items():
            parts.append(f"<h3>{E(name)}</h3>{histograms(name, sc)}")
        parts.append("<h2>Mean entropy by position in the context window</h2>")
        parts.append(position_plot(scores))
        if samples:
            parts.append("<h2>Sample texts, tokens shaded by entropy (darker red = higher)</h2>")
            parts.append(_samples(scores, tok, samples))
        parts.append("<h2>Scorer agreement</h2>")
        parts.append(_agreement(wf, scores))
    parts.append(_curves(wf))
    if wf.train is not None and wf.eval is not None:
        for t in wf.eval_texts():
            parts.append(_bpb_section(wf, t))
    body = "\n".join(parts)
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>entroweight report</title>"
        f"<style>{CSS}</style></head><body>{body}</body></html>"
    )


CSS = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.8em; }
.sample { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 0.85em;
          border: 1px solid #ddd; padding: 0.6em; margin: 0.4em 0 1em; }
.verdict { font-weight: 600; }
"""


def _truncation(tokens_dir: Path) -> str:
    """What the tokenized data lost (tokenize.overflow: truncate), where a reader of results looks."""
    from entroweight.pipelines.stage import read_manifests

    ms = read_manifests(tokens_dir) if Path(tokens_dir).is_dir() else []
    cut = sum(m.extra.get("n_truncated", 0) for m in ms)
    if not cut:
        return ""
    dropped = sum(m.extra.get("bytes_dropped", 0) for m in ms)
    return (
        f"<p class='verdict'>Truncated data: {cut} of {sum(m.docs_out for m in ms)} documents were cut "
        f"to n_ctx tokens, {dropped:,} bytes of their text dropped (tokenize.overflow: truncate).</p>"
    )


def _provenance(record: dict) -> str:
    rows = [
        ("code version", record.get("code_version")),
        ("workflow file", record.get("workflow_file")),
        ("engine", record.get("engine")),
        ("finished at", record.get("finished_at")),
        ("python", record.get("python")),
    ]
    head = "".join(f"<tr><th>{E(k)}</th><td>{E(str(v))}</td></tr>" for k, v in rows)
    steps = "".join(
        f"<tr><td>{E(s['kind'])}</td><td>{E(s['name'])}</td><td>{E(s['status'])}</td>"
        f"<td class='num'>{s.get('seconds', 0):.1f}</td><td>{E(s.get('detail', ''))}</td></tr>"
        for s in record.get("steps", [])
    )
    cfg = yaml.safe_dump(record.get("config", {}), sort_keys=False)
    return (
        f"<h2>Provenance</h2><table>{head}</table>"
        "<h3>Steps of the last run</h3><table><tr><th>step</th><th>name</th><th>status</th><th>s</th>"
        f"<th>detail</th></tr>{steps}</table>"
        f"<details><summary>Resolved config</summary><pre>{E(cfg)}</pre></details>"
    )


def _tokenizer(wf: Workflow):
    from entroweight.transforms.tokenizer import load_tokenizer

    for cand in (wf.tokenizer_dir(), *(wf.model_dir(m.name) for m in wf.models)):
        try:
            return load_tokenizer(cand)
        except Exception:
            continue
    return None


def _scorer_table(wf: Workflow, scores: dict) -> str:
    rows = []
    for s in wf.scores:
        sc = scores.get(s.name)
        if sc is None:
            continue
        e, w = sc["entropy"], sc["weight"]
        rows.append(
            f"<tr><td>{E(s.name)}</td><td>{E(s.scorer or f'{s.values_from}, weighed anew')}</td><td class='num'>{sc['n_files']}</td>"
            f"<td class='num'>{sc['n_sequences']:,}</td><td class='num'>{sc['n_tokens']:,}</td>"
            f"<td class='num'>{'' if e is None else f'{e.mean():.4f}'}</td>"
            f"<td class='num'>{'' if w is None else f'{w.mean():.4f}'}</td></tr>"
        )
    return (
        "<table><tr><th>score</th><th>scorer</th><th>shards</th><th>sequences</th><th>tokens read</th>"
        f"<th>mean entropy</th><th>mean weight</th></tr>{''.join(rows)}</table>"
    )


def _samples(scores: dict, tok, n: int) -> str:
    if tok is None:
        return "<p>No tokenizer found in the run directory: texts cannot be decoded.</p>"
    out = []
    for i in range(n):
        for name, sc in scores.items():
            if i >= len(sc["rows"]) or sc["rows"][i][1] is None:
                continue
            ids, values = sc["rows"][i]
            out.append(
                f"<p><b>sample {i + 1}</b>, {E(name)}:</p><div class='sample'>{highlight(tok, ids, values)}</div>"
            )
    return "".join(out)


def _agreement(wf: Workflow, scores: dict) -> str:
    from entroweight.transforms.agreement import compare_dirs

    names = [n for n, s in scores.items() if s["entropy"] is not None]
    if len(names) < 2:
        return "<p>One scorer only: nothing to compare.</p>"
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            try:
                r = compare_dirs(wf.score_dir(a), wf.score_dir(b), column="entropy")
            except Exception as e:  # a pair that cannot be compared is reported, not fatal
                rows.append(f"<tr><td>{E(a)}</td><td>{E(b)}</td><td colspan='5'>{E(str(e))}</td></tr>")
                continue
            rows.append(
                f"<tr><td>{E(a)}</td><td>{E(b)}</td><td class='num'>{r['r2']:.4f}</td>"
                f"<td class='num'>{r['pearson']:.4f}</td><td class='num'>{r['spearman']:.4f}</td>"
                f"<td class='num'>{r['n_tokens']:,}</td><td class='num'>{r['n_sequences']:,}</td></tr>"
            )
    return (
        "<p>Per-token entropy estimates of each pair of scorers over the sequences both scored "
        "(the write-up: L1 occlusion vs causal loss R² ≈ 0.01).</p>"
        "<table><tr><th>a</th><th>b</th><th>R²</th><th>Pearson</th><th>Spearman</th><th>tokens</th>"
        f"<th>sequences</th></tr>{''.join(rows)}</table>"
    )


def _curves(wf: Workflow) -> str:
    parts = ["<h2>Training curves</h2>"]
    models = {m.name: [read_metrics(wf.model_dir(m.name))] for m in wf.models}
    if any(any(r) for r in models.values()):
        parts.append(curves_plot(models, "models trained before scoring"))
    if wf.train is not None:
        runs = {r.name: [read_metrics(wf.run_ckpt(r.name, s)) for s in wf.train.seeds] for r in wf.train.runs}
        if any(any(x) for x in runs.values()):
            parts.append(curves_plot(runs, "experiment runs (thin: seeds, thick: mean)"))
            rows = []
            for name, seeds in runs.items():
                last = [r[-1]["ce"] for r in seeds if r]
                if last:
                    rows.append(
                        f"<tr><td>{E(name)}</td><td class='num'>{np.mean(last):.4f}</td>"
                        f"<td class='num'>{len(last)}</td></tr>"
                    )
            parts.append(
                "<table><tr><th>run</th><th>final training CE (mean over seeds)</th><th>seeds</th></tr>"
                f"{''.join(rows)}</table>"
            )
    return "".join(parts) if len(parts) > 1 else ""


def _fmt(v, nd=4) -> str:
    return "" if v is None else f"{v:.{nd}f}"


def _bpb_section(wf: Workflow, text: str = "main") -> str:
    table = bpb_table(wf, text)
    seeds = wf.train.seeds
    head = "".join(f"<th>seed {s}</th>" for s in seeds)
    rows = []
    for r in table["runs"]:
        cells = "".join(
            f"<td class='num bpb' data-run='{E(r['run'])}' data-text='{text}' data-seed='{s}' "
            f"data-value='{r['seeds'][s]!r}'>"
            f"{r['seeds'][s]:.4f}</td>"
            if s in r["seeds"]
            else "<td></td>"
            for s in seeds
        )
        stat = "".join(
            f"<td class='num bpb' data-run='{E(r['run'])}' data-text='{text}' data-stat='{k}' "
            f"data-value='{r[k]!r}'>{_fmt(r[k])}</td>"
            if r[k] is not None
            else "<td></td>"
            for k in ("mean", "std")
        )
        ref = " (reference)" if r["run"] == table["reference"] and r["run"] != "reference" else ""
        rows.append(
            f"<tr><td>{E(r['run'])}{ref}</td><td>{E(r['data'])}</td><td>{E(r['loss'])}</td>{cells}{stat}"
            f"<td>{_fmt(r['mean'])}{' ± ' + _fmt(r['std']) if r['std'] is not None else ''}</td></tr>"
        )
    title = E(wf.eval.text or "the bundled WikiText-2 test set") if text == "main" else E(text_name(wf, text))
    uni_file = wf.root / wf.eval.out / "unigram.json"
    unigram = json.loads(uni_file.read_text())["bpb"] if uni_file.is_file() and text == "main" else None
    uni = (
        f"<p>Unigram baseline (the training tokens' frequencies as the prediction): "
        f"<span class='bpb' data-stat='unigram' data-value='{unigram!r}'>{unigram:.4f}</span> BPB; a run "
        "near it has learned little beyond token frequencies.</p>"
        if unigram is not None
        else ""
    )
    verdicts = "".join(
        f"<p class='verdict' data-run='{E(c['run'])}' data-text='{text}' data-exceeds='{c.get('exceeds_noise')}'>"
        f"{E(c['verdict'])}</p>"
        for c in table["comparisons"]
    )
    data_note = (
        f"Reference data: `{E(TOKENS)}` is the tokenized data without weights." if table["runs"] else ""
    )
    return (
        f"<h2>Bits per byte on {title}</h2><p>Lower is better. {data_note}</p>"
        f"<table><tr><th>run</th><th>data</th><th>loss</th>{head}<th>mean</th><th>std</th>"
        f"<th>mean ± std</th></tr>{''.join(rows)}</table>{uni}{verdicts}"
    )


def write_report(
    run_dir: str | Path, out: str | Path | None = None, samples: int = 3, max_tokens: int = 2_000_000
) -> Path:
    out = Path(out) if out else Path(run_dir) / "report.html"
    write_text_atomic(build_report(run_dir, samples, max_tokens), out)
    return out
