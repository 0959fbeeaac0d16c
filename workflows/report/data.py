"""The data of a workflow run's report: what `workflows/report/html.py` renders, as plain values.

Reads run.json and the step outputs under the run directory: the scores' entropy and weight
columns, the BPB and the downstream accuracy (lm-eval) of every run and seed, the training metrics,
the manifests; compares each run with the reference, and each named contrast, over seeds × documents
(workflows/report/stats.py: Δ with its 95 % interval, the primary comparison, Holm, the smallest detectable
difference) and says, per run and in one sentence, which runs beat it. No HTML.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from entroweight.schemas.datadir import DataDir, DataDirError
from entroweight.schemas.manifest import SHARDS_FILE, STAGE_FILE, sum_lineage
from entroweight.schemas.weighted import (
    ENTROPY,
    EXCLUDED,
    WEIGHT,
    excluded_mask,
    matrix,
    real_mask,
    weights_matrix,
)
from entroweight.trainers.accuracy import MARGIN
from entroweight.trainers.checkpoint import METRICS, STATE

from ..results import checkpoint_damage, edited
from ..spec import PRIMARY, TOKENS, SpecError, Workflow, parse_workflow
from . import stats


class ReportError(ValueError):
    """RUN_DIR is not a workflow run (no run.json); the message says what to do."""


# -- reading the run
def read_record(path: Path, what: str = "record") -> Any:
    """A JSON record of the run (run.json, an evaluation, the agreement table), or ReportError naming
    the file when it cannot be read: cut short or edited into something else."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ReportError(
            f"{path} is not a readable {what} ({e}); `entroweight run` makes it again once it is removed"
        ) from None


def read_result(path: Path, what: str = "evaluation") -> Any:
    """A step's result (an evaluation, an accuracy, the agreement table) as `read_record` reads it, or
    ReportError naming it where it is not as its step wrote it (`results.edited`: edited by hand, its
    seal removed, or written before seals): a number in the report is its step's."""
    record = read_record(path, what)
    if edited(record):
        raise ReportError(
            f"{path} is not as its step wrote it (edited since, or written before results were sealed: "
            "its record_sha256 is missing or differs); `entroweight run` makes it again"
        )
    return record


def read_number(path: Path, key: str, what: str) -> float:
    """`key` of a JSON record, a finite number, or ReportError naming the file: a NaN read as a
    seed's value made every statistic of its table NaN, and the verdict "within noise"."""
    record = read_result(path, what)
    value = record.get(key) if isinstance(record, dict) else record
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ReportError(
            f"{path} holds {key} {value!r}, not a finite number; `entroweight run` makes it again once it "
            "is removed"
        )
    return float(value)


def load_run(run_dir: str | Path) -> tuple[dict, Workflow]:
    run_dir = Path(run_dir)
    record_file = run_dir / "run.json"
    if not record_file.is_file():
        raise ReportError(
            f"{run_dir} has no run.json: it is not a workflow run; run `entroweight run WORKFLOW.yaml`"
        )
    record = read_record(record_file, "run record")
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise ReportError(
            f"{record_file} holds no workflow config (not the run record `entroweight run` writes); "
            "`entroweight run` makes it again once it is removed"
        )
    try:
        wf = parse_workflow(record["config"], str(record_file))
    except (SpecError, TypeError, KeyError) as e:
        raise ReportError(str(e)) from None
    wf.run_dir = str(run_dir)  # outputs are relative to the run dir, wherever it is now
    return record, wf


def read_scores(score_dir: str | Path, max_tokens: int) -> dict | None:
    """Entropy/weight of real tokens (flat), mean entropy by context position, and the first rows, of a
    weighted directory (score or weigh output; local or a URL); None when it holds no committed shard
    yet. Positions the scorer excluded (`excluded`) stay out of the statistics."""
    d = DataDir(score_dir)
    if d.record is None or not d.parts:
        return None
    d.require("weighted", complete=False, hint="the report reads scores")
    files = d.files
    ent, wts, rows = [], [], []
    pos_sum = pos_n = None
    n_tokens = n_seq = 0
    for f in files:
        try:  # each shard checked against its manifest: no plots of corrupt bytes
            t = d.read_table(f, ("input_ids", "n_pad", ENTROPY, EXCLUDED, WEIGHT))
        except DataDirError as e:
            raise ReportError(str(e)) from None
        names = t.column_names
        ids = matrix(t.column("input_ids"))
        n_pad = t.column("n_pad").to_numpy()
        width = ids.shape[1]
        e = matrix(t.column(ENTROPY), np.float64, width=width) if ENTROPY in names else None
        w = weights_matrix(t.column(WEIGHT), width).astype(np.float64) if WEIGHT in names else None
        real = real_mask(n_pad, width)
        excluded = excluded_mask(t.column(EXCLUDED), width) if EXCLUDED in names else None
        counted = real if excluded is None else real & ~excluded
        if pos_sum is None:
            pos_sum, pos_n = np.zeros(width), np.zeros(width)
        if e is not None:
            # position = tokens of context before this one (left padding: column - n_pad)
            ctx = np.arange(width)[None, :] - n_pad[:, None]
            np.add.at(pos_sum, ctx[counted], e[counted])
            np.add.at(pos_n, ctx[counted], 1)
            ent.append(e[counted])
        if w is not None:
            wts.append(w[counted])
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


def read_metrics(ckpt: Path) -> list[dict]:
    path = ckpt / METRICS
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            try:  # named by its line: the JSON error counts within the line alone
                row = json.loads(line)
            except ValueError as e:  # UnicodeDecodeError included
                raise ReportError(f"{path} is not readable training metrics (line {number}: {e})") from None
            if not isinstance(row, dict):
                raise ReportError(
                    f"{path} is not readable training metrics (line {number}: not a JSON object)"
                )
            rows.append(row)
    return rows


TEXT_NAMES = {"main": "WikiText-2", "heldout": "held-out source text"}


def text_name(wf: Workflow, text: str) -> str:
    if text == "main":
        return Path(wf.eval.text).name if wf.eval.text else TEXT_NAMES["main"]
    return f"held-out ({wf.holdout.docs} documents never trained on)"


def bpb_table(wf: Workflow, text: str = "main") -> dict:
    """Per run: each seed's BPB (from eval/RUN/seed-S[.TEXT].json) and its nats per block of the text,
    mean, std; per compared run: the comparison with the reference over seeds × blocks, decided by the
    rule of workflows/report/stats.py (the primary run unadjusted, the others Holm-corrected over this
    table), with its verdict; and the contrasts the workflow names (report.contrasts), run against
    run, Holm-corrected over the contrasts."""
    runs = []
    for r in wf.train.runs:
        seeds, blocks = {}, {}
        for s in wf.train.seeds:
            f = wf.eval_file(r.name, s, text)
            if f.is_file():
                seeds[s] = read_number(f, "bpb", "evaluation")
                if isinstance(b := read_result(f, "evaluation").get("blocks"), dict):
                    blocks[s] = b
        v = np.array(list(seeds.values()), dtype=np.float64)
        runs.append(
            {
                "run": r.name,
                "data": r.data,
                "loss": r.loss,
                "seeds": seeds,
                "blocks": blocks,
                "mean": float(v.mean()) if len(v) else None,
                "std": float(v.std(ddof=1)) if len(v) > 1 else None,
            }
        )
    ref_name = wf.reference_run()
    ref = next((x for x in runs if x["run"] == ref_name), None)
    comparisons = [compare(x, ref) for x in runs if ref is not None and x is not ref and x["seeds"]]
    stats.decide(comparisons, wf.primary_run(), lower_is_better=True)
    by = {x["run"]: x for x in runs}
    contrasts = [compare(by[a], by[b]) for a, b in contrast_pairs(wf) if by[a]["seeds"] and by[b]["seeds"]]
    stats.decide(contrasts, None, lower_is_better=True)
    for c in comparisons + contrasts:
        c["verdict"] = verdict(c)
    return {
        "reference": ref_name,
        "primary": wf.primary_run(),
        "runs": runs,
        "comparisons": comparisons,
        "contrasts": contrasts,
    }


def contrast_pairs(wf: Workflow) -> list[tuple[str, str]]:
    return [tuple(p) for p in wf.report.contrasts] if wf.report is not None else []


def compare(run: dict, other: dict) -> dict:
    """`run`'s BPB against `other`'s over the seeds both have (stats.compare): per seed, the bits of
    each block of the text over its bytes where every evaluation of both holds the same blocks
    (results written before blocks: one number per seed). `decide` then reads it."""
    seeds = [s for s in other["seeds"] if s in run["seeds"]]
    pairs = {"run": run["run"], "reference": other["run"]}
    held = [x.get("blocks", {}) for x in (run, other)]
    sizes = {tuple(b[s]["bytes"]) for b in held for s in seeds if s in b}
    whole = all(s in b for b in held for s in seeds)
    if seeds and whole and len(sizes) == 1:

        def bits(b):
            return {s: np.asarray(b[s]["nats"]) / math.log(2) for s in seeds}

        return (
            pairs
            | stats.compare(bits(held[1]), bits(held[0]), sizes.pop())
            | {"cluster": "blocks of the text"}
        )
    return pairs | stats.compare(other["seeds"], run["seeds"]) | {"cluster": None}


def verdict(c: dict, unit: str = "BPB") -> str:
    """The sentence of one comparison that `stats.decide` decided (BPB from `compare`, or an accuracy
    endpoint from `stats.compare_items`): the outcome, Δ with its interval, the test and its p
    (Holm-adjusted where it is not the primary), the sign-flip test beside it, and, within noise, the
    smallest difference it could have detected."""
    who = f"{c['run']}{' (the primary comparison)' if c['primary'] else ''}"
    ref = c.get("reference", "the reference")
    if c["delta"] is None:
        return f"{who}: nothing paired with {ref} yet: nothing to compare."
    if c["p"] is None:
        return f"{who}: one seed only: the seed noise cannot be estimated; add seeds."
    lo, hi = c["ci"]
    interval = f"95 % interval {lo:+.4f} to {hi:+.4f}"
    over = f"{c['n']} seeds" + (f" × {c['clusters']} {c['cluster']}" if c.get("cluster") else "")
    test = f"t over {over}, p = {c['p']:.3g}"
    if not c["primary"]:
        test += f", Holm-adjusted {c['p_adjusted']:.3g}"
    test += f"; sign-flip test of the {c['n']} per-seed differences p = {c['sign_flip']:.3g}"
    if c["outcome"] in ("better", "worse"):
        direction = f"{'lower' if c['delta'] < 0 else 'higher'} ({c['outcome']})"
        return (
            f"{who} is {direction} than {ref} by {abs(c['delta']):.4f} {unit} ({interval}), beyond the "
            f"noise of seeds and documents ({test})."
        )
    return (
        f"{who} differs from {ref} by {c['delta']:+.4f} {unit} ({interval}): within noise ({test}); it "
        f"could have detected |Δ| ≥ {c['mde']:.4f} {unit} ({stats.POWER:.0%} power at α = {c['alpha']:.3g}). "
        "No difference can be claimed."
    )


OUTCOMES = {"better": "beats", "worse": "loses", "within noise": "within noise", "undecided": "undecided"}


def outcome(c: dict) -> str:
    """beats | loses | within noise | undecided (fewer than 2 seeds or no BPB), against the reference."""
    return OUTCOMES[c["outcome"]]


def verdict_sentence(wf: Workflow, tables: dict[str, dict]) -> str:
    """One sentence from the numbers: the runs grouped by their outcome against the reference on
    every evaluation text (beats / loses / within noise)."""
    ref = wf.reference_run()
    names = {t: "held-out text" if t == "heldout" else text_name(wf, t) for t in tables}
    groups: dict[tuple, list[str]] = {}
    for r in wf.train.runs:
        if r.name == ref:
            continue
        comps = [next((c for c in tab["comparisons"] if c["run"] == r.name), None) for tab in tables.values()]
        groups.setdefault(tuple(outcome(c) if c else "undecided" for c in comps), []).append(r.name)
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
    seeds = seeds_said(wf, tables, "each")
    primary = wf.primary_run()
    rule = "t over seeds × blocks of the text, p < 0.05, " + (
        f"Holm-corrected except the primary comparison, {primary}"
        if primary
        else "all Holm-corrected (no primary)"
    )
    return f"Against {ref} ({seeds}; {rule}), " + "; ".join(clauses) + "."


def seeds_said(wf: Workflow, tables: dict[str, dict], per: str) -> str:
    """How many seeds the comparisons read: the workflow's, or fewer where an evaluation is missing
    (a comparison reads the seeds both runs have). `per`: "each", "per run"."""
    n = len(wf.train.seeds)
    evaluated = {  # per table, each run's evaluated seeds (a run with none is compared on none)
        t: {r["run"]: set(r["seeds"]) for r in tab["runs"]} for t, tab in tables.items()
    }
    fewest = min(
        (
            len(seeds & evaluated[t].get(tab["reference"], set()))
            for t, tab in tables.items()
            for run, seeds in evaluated[t].items()
            if run != tab["reference"]
        ),
        default=n,
    )
    if fewest < n:
        return f"{n} seed{'s' if n != 1 else ''} planned {per}, as few as {fewest} evaluated in a comparison"
    return f"{n} seed{'s' if n != 1 else ''} {per}"


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


def headline(wf: Workflow) -> dict:
    """The experiment at a glance: per run and evaluation text, mean ± std over seeds, Δ with its 95 %
    interval, p (Holm-adjusted but for the primary), the sign-flip p, the outcome and, within noise, the
    smallest detectable difference; the named contrasts; the seeds a ±0.01 interval needs; the verdict
    sentence and the rule it applies."""
    texts = wf.eval_texts()
    tables = {t: bpb_table(wf, t) for t in texts}
    rows = []
    for i, r in enumerate(wf.train.runs):
        cells = []
        for t in texts:
            run = tables[t]["runs"][i]
            c = next((c for c in tables[t]["comparisons"] if c["run"] == r.name), None)
            compared = c is not None and c["delta"] is not None
            cells.append(
                {
                    "text": t,
                    "mean": run["mean"],
                    "std": run["std"],
                    "n": len(run["seeds"]),
                    "delta": c["delta"] if compared else None,
                    "ci": c["ci"] if compared else None,
                    "p": c["p_adjusted"] if compared else None,
                    "sign_flip": c["sign_flip"] if compared else None,
                    "outcome": outcome(c) if compared else None,
                    "mde": c["mde"] if compared else None,
                    "reference": not compared and r.name == tables[t]["reference"],
                }
            )
        label = f"{r.loss}" + (f", normalize {r.normalize}" if r.loss == "weighted_ce" else "")
        rows.append(
            {
                "run": r.name,
                "data": r.data,
                "label": label,
                "primary": r.name == wf.primary_run(),
                "role": r.role,
                "cells": cells,
            }
        )
    return {
        "seeds": seeds_said(wf, tables, "per run"),
        "texts": [text_name(wf, t) for t in texts],
        "verdict": verdict_sentence(wf, tables),
        "primary": wf.primary_run(),
        "primary_note": (
            f"Primary comparison, named in the workflow before the runs (report.primary): "
            f"{wf.primary_run()} against {wf.reference_run()}."
            if wf.primary_run()
            else f"No primary comparison (report.primary; by default {PRIMARY}, which this workflow "
            "does not run): every comparison is Holm-corrected."
        ),
        "rule": stats.RULE,
        "rows": rows,
        "contrasts": [
            {
                "run": a,
                "other": b,
                "cells": [
                    next((c for c in tables[t]["contrasts"] if c["run"] == a and c["reference"] == b), None)
                    for t in texts
                ],
            }
            for a, b in contrast_pairs(wf)
        ],
        "precision": precision(wf, tables),
    }


PRECISION = 0.01  # the half-width of an interval worth having at this scale (BPB, accuracy)


def precision(wf: Workflow, tables: dict[str, dict]) -> list[dict]:
    """Per text: the primary comparison's per-seed noise and the seeds its interval would need to
    reach ±PRECISION (stats.seeds_for): what to run next for a stated precision."""
    out = []
    for t, tab in tables.items():
        c = next((c for c in tab["comparisons"] if c["run"] == wf.primary_run() and c.get("sd")), None)
        if c is not None:
            out.append(
                {"text": text_name(wf, t), "sd": c["sd"], "seeds": stats.seeds_for(c["sd"], PRECISION)}
            )
    return out


# -- downstream accuracy (lm-eval; workflows/engine/steps.py AccuracyStep writes accuracy/RUN/seed-S.json)
Z95 = 1.959964  # two-sided 95 % normal interval


def read_accuracy(wf: Workflow) -> dict[tuple[str, int], dict]:
    """(run, seed) -> that evaluation's results, for the ones that exist."""
    out = {}
    for r in wf.train.runs:
        for s in wf.train.seeds:
            f = wf.accuracy_file(r.name, s)
            if f.is_file():
                out[(r.name, s)] = read_result(f, "accuracy result")
    return out


def accuracy_tables(wf: Workflow) -> list[dict]:
    """Per task: each run's metrics over seeds (mean ± std, ddof 1), the chance level, and whether the
    reference is above chance: its mean with a 95 % interval from the item sampling (± 1.96 × the mean
    of its seeds' standard errors: the seeds answer the same items, so averaging them does not shrink
    that error)."""
    results = read_accuracy(wf)
    ref = wf.reference_run()
    tables = []
    # the tasks as lm-eval ran them: a tag or group (glue) stands for its tasks (cola, mnli, ...)
    for task in dict.fromkeys(t for res in results.values() for t in res.get("tasks", {})):
        found = [res["tasks"][task] for res in results.values() if task in res.get("tasks", {})]
        metrics = list(found[0]["metrics"])
        # the mean log-likelihood margin per item (nats), where the answers hold it: no standard error,
        # so no chance line
        metrics += [MARGIN] if any(MARGIN in f.get("items", {}) for f in found) else []
        chance = found[0].get("chance")
        rows = []
        for r in wf.train.runs:
            cells = []
            for m in metrics:
                seeds, errs = {}, []
                for s in wf.train.seeds:
                    t = results.get((r.name, s), {}).get("tasks", {}).get(task)
                    if t and m in t["metrics"]:
                        seeds[s] = t["metrics"][m]["value"]
                        errs.append(t["metrics"][m]["stderr"])
                    elif t and m == MARGIN and MARGIN in t.get("items", {}):
                        seeds[s] = float(np.mean(t["items"][MARGIN]))
                        errs.append(None)
                v = np.array(list(seeds.values()), dtype=np.float64)
                se = float(np.mean(errs)) if errs and None not in errs else None
                cells.append(
                    {
                        "metric": m,
                        "seeds": seeds,
                        "mean": float(v.mean()) if len(v) else None,
                        "std": float(v.std(ddof=1)) if len(v) > 1 else None,
                        "stderr": se,
                    }
                )
            rows.append({"run": r.name, "data": r.data, "loss": r.loss, "cells": cells})
        tables.append(
            {
                "task": task,
                "n_items": found[0]["n"],
                "chance": chance,
                "metrics": metrics,
                "seeds": wf.train.seeds,
                "reference": ref,
                "rows": rows,
                "above_chance": above_chance(next((x for x in rows if x["run"] == ref), None), chance),
                **accuracy_comparisons(wf, results, task, metrics),
            }
        )
    return tables


# Where a task lacks the endpoint the workflow names (accuracy.decides), the comparisons decide on the
# first of these it has: acc_mutual_info (plain acc favours continuations of frequent tokens for models
# near the unigram level, which every run here is), else acc. The other metrics are shown, not tested.
DECIDING_METRICS = ("acc_mutual_info", "acc")


def item_documents(wf: Workflow, task: str, n_items: int) -> list | None:
    """Each item's document, from the offline task's items file (items cut from one document are one
    cluster); None (each item its own) for lm-eval's tasks, whose items we did not cut."""
    from entroweight.trainers.accuracy import ITEMS_FILE, OFFLINE_TASK

    f = wf.accuracy_items_dir() / ITEMS_FILE
    if task != OFFLINE_TASK or not f.is_file():
        return None
    docs = [json.loads(line).get("doc") for line in f.read_text(encoding="utf-8").splitlines() if line]
    return docs if len(docs) == n_items and None not in docs else None


def accuracy_comparisons(wf: Workflow, results: dict, task: str, metrics: list[str]) -> dict:
    """Each run against the reference on one task, and each named contrast, on the endpoint named
    before the runs (accuracy.decides), item by item over seeds × documents (stats.compare_items, on
    the same items file), decided by the rule of workflows/report/stats.py."""
    named = wf.accuracy.decides if wf.accuracy is not None else DECIDING_METRICS[0]
    has = {k for res in results.values() for k in res.get("tasks", {}).get(task, {}).get("items", {})}
    metric = named if named in has else next((m for m in DECIDING_METRICS if m in has), None)
    ref = wf.reference_run()

    def answers(run: str) -> dict[int, tuple[str | None, list[float]]]:
        out = {}
        for s in wf.train.seeds:
            res = results.get((run, s), {})
            items = res.get("tasks", {}).get(task, {}).get("items", {}).get(metric)
            if items is not None:
                out[s] = (res.get("items_sha256"), items)
        return out

    def against(run: str, other: str) -> dict | None:
        mine, theirs = answers(run), answers(other)
        # only the seeds answered on the same items (a stale result of other items is left out)
        shared = [s for s in mine if s in theirs and mine[s][0] == theirs[s][0]]
        if not shared:
            return None
        docs = item_documents(wf, task, len(mine[shared[0]][1]))
        c = stats.compare_items({s: theirs[s][1] for s in shared}, {s: mine[s][1] for s in shared}, docs)
        return {"run": run, "reference": other, "cluster": "documents" if docs else "items"} | c

    comparisons, contrasts = [], []
    if metric is not None:
        comparisons = [c for r in wf.train.runs if ref and r.name != ref and (c := against(r.name, ref))]
        contrasts = [c for a, b in contrast_pairs(wf) if (c := against(a, b))]
    stats.decide(comparisons, wf.primary_run(), lower_is_better=False)
    stats.decide(contrasts, None, lower_is_better=False)
    for c in comparisons + contrasts:
        c["verdict"] = verdict(c, unit=metric)
    return {
        "deciding_metric": metric,
        "named_metric": named,
        "comparisons": comparisons,
        "contrasts": contrasts,
    }


def above_chance(ref_row: dict | None, chance: float | None) -> list[dict]:
    """Per metric of the reference: its mean, the 95 % interval and whether it lies above chance."""
    if ref_row is None or chance is None:
        return []
    out = []
    for c in ref_row["cells"]:
        if c["mean"] is None or c["stderr"] is None:
            continue
        lo, hi = c["mean"] - Z95 * c["stderr"], c["mean"] + Z95 * c["stderr"]
        verdict = (
            "above chance"
            if lo > chance
            else "below chance"
            if hi < chance
            else "not distinguishable from chance"
        )
        out.append({"metric": c["metric"], "mean": c["mean"], "lo": lo, "hi": hi, "verdict": verdict})
    return out


def accuracy_sentence(table: dict) -> str:
    """One sentence: where the reference stands against chance on this task, metric by metric."""
    parts = [
        f"{a['metric']} {a['mean']:.3f} (95 % interval {a['lo']:.3f}–{a['hi']:.3f}) is {a['verdict']}"
        for a in table["above_chance"]
    ]
    if not parts:
        return f"The reference ({table['reference']}) has no result on {table['task']} yet."
    return (
        f"{table['task']} ({table['n_items']} items, chance {table['chance']:.3f}): in the reference run "
        f"({table['reference']}), " + "; ".join(parts) + "."
    )


def documents(tokens_dir: Path) -> dict | None:
    """What tokenize read, kept, rejected and cut (tokenize.overflow: truncate) of the sources, where
    a reader of results looks (`sum_lineage`, as `inspect` and an export say it)."""
    lineage = sum_lineage([p.manifest for p in DataDir(tokens_dir).parts])
    return lineage[-1] if lineage else None


def provenance(record: dict) -> dict:
    return {
        "facts": [
            ("code version", record.get("code_version")),
            ("workflow file", record.get("workflow_file")),
            ("engine", record.get("engine")),
            ("finished at", record.get("finished_at")),
            ("python", record.get("python")),
        ],
        "steps": record.get("steps", []),
        "config": yaml.safe_dump(record.get("config", {}), sort_keys=False),
    }


def load_tokenizer_of(wf: Workflow):
    """The run's tokenizer (its own directory, else a model's copy), to decode sample texts; None."""
    from entroweight.transforms.tokenizer import load_tokenizer

    for cand in (wf.tokenizer_dir(), *(wf.model_dir(m.name) for m in wf.models)):
        try:
            return load_tokenizer(cand)
        except Exception:
            continue
    return None


def scorer_rows(wf: Workflow, scores: dict) -> list[dict]:
    rows = []
    for s in wf.scores:
        sc = scores.get(s.name)
        if sc is None:
            continue
        e, w = sc["entropy"], sc["weight"]
        rows.append(
            {
                "name": s.name,
                "scorer": s.scorer
                or (f"{s.op} of {' and '.join(s.sources())}" if s.op else f"{s.values_from}, weighed anew"),
                "n_files": sc["n_files"],
                "n_sequences": sc["n_sequences"],
                "n_tokens": sc["n_tokens"],
                "mean_entropy": None if e is None else float(e.mean()),
                "mean_weight": None if w is None else float(w.mean()),
            }
        )
    return rows


def samples(scores: dict, n: int) -> list[dict]:
    """The first `n` rows of each scorer that stored entropies: (ids, values) to shade."""
    out = []
    for i in range(n):
        for name, sc in scores.items():
            if i >= len(sc["rows"]) or sc["rows"][i][1] is None:
                continue
            ids, values = sc["rows"][i]
            out.append({"index": i + 1, "scorer": name, "ids": ids, "values": values})
    return out


def agreement(wf: Workflow, scores: dict) -> list[dict] | None:
    """Per pair of scorers that stored entropies (not the steps that re-weigh another's: the same
    values): R², Pearson, Spearman over the sequences both scored, or the reason the pair cannot be
    compared; None with fewer than two."""
    from entroweight.transforms.agreement import compare_dirs

    # a step that weighs another's values anew stores that step's values: comparing the two says nothing
    reweighs = {s.name for s in wf.scores if isinstance(s.values_from, str)}
    names = [n for n, s in scores.items() if s["entropy"] is not None and n not in reweighs]
    if len(names) < 2:
        return None
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            try:
                r = compare_dirs(wf.score_dir(a), wf.score_dir(b), column="entropy")
            except Exception as e:  # a pair that cannot be compared is reported, not fatal
                rows.append({"a": a, "b": b, "error": str(e)})
                continue
            rows.append({"a": a, "b": b, **r})
    return rows


def writeup_agreement(wf: Workflow) -> dict | None:
    """The agreement step's table (`agreement:`), each row beside the write-up's where it has one;
    None when the workflow has no agreement section or it has not run."""
    if wf.agreement is None:
        return None
    path = wf.root / wf.agreement.out
    return read_result(path, "agreement table") if path.is_file() else None


# -- the known-entropy benchmark (a synthesize section: docs/experiments.md "A corpus of known entropy")
TRUTH_NAME = "synthetic (truth)"  # the synthetic corpus' exact entropy beside the scores' histograms


def truth_section(wf: Workflow) -> dict | None:
    """The estimator benchmark's table (`truth:`, workflows/engine/steps.py TruthStep); None when the workflow
    has none or it has not run."""
    if wf.truth is None:
        return None
    path = wf.root / wf.truth.out
    return read_result(path, "truth table") if path.is_file() else None


def excess_section(wf: Workflow) -> dict | None:
    """The training benchmark (`excess:`): per run and seed the exact KL(teacher || student) and CE − H
    per token on the held-out synthetic rows; each run against the reference over seeds × held-out
    rows (stats.compare, the rows the clusters, their tokens the sizes), decided as the BPB tables
    (the primary unadjusted, the rest Holm), with the per-seed noise and the seeds a ±PRECISION nats
    interval needs (stats.seeds_for)."""
    if wf.excess is None or wf.train is None:
        return None
    runs = []
    for r in wf.train.runs:
        res = {
            s: read_result(f, "excess") for s in wf.train.seeds if (f := wf.excess_file(r.name, s)).is_file()
        }
        row = {"run": r.name, "data": r.data, "loss": r.loss, "results": res}
        for k in ("kl", "ce_minus_h"):
            v = np.array([x[k] for x in res.values()], np.float64)
            row[k] = {s: x[k] for s, x in res.items()}
            row[f"{k}_mean"] = float(v.mean()) if v.size else None
            row[f"{k}_std"] = float(v.std(ddof=1)) if v.size > 1 else None
        runs.append(row)
    by = {x["run"]: x for x in runs}

    def against(x: dict, other: dict) -> dict:
        seeds = [s for s in other["results"] if s in x["results"]]
        sizes = other["results"][seeds[0]]["rows"]["tokens"] if seeds else None
        c = stats.compare(
            {s: other["results"][s]["rows"]["kl"] for s in seeds},
            {s: x["results"][s]["rows"]["kl"] for s in seeds},
            sizes,
        )
        return {"run": x["run"], "reference": other["run"], "cluster": "held-out rows", **c}

    ref = by.get(wf.reference_run())
    comparisons = [against(x, ref) for x in runs if ref is not None and x is not ref and x["results"]]
    contrasts = [
        against(by[a], by[b]) for a, b in contrast_pairs(wf) if by[a]["results"] and by[b]["results"]
    ]
    stats.decide(comparisons, wf.primary_run(), lower_is_better=True)
    stats.decide(contrasts, None, lower_is_better=True)
    for c in comparisons + contrasts:
        c["verdict"] = verdict(c, "nats of KL per token")
        c["seeds_needed"] = stats.seeds_for(c["sd"], PRECISION) if c.get("sd") else None
    for x in runs:
        del x["results"]  # the rows: read, not shown
    return {
        "reference": wf.reference_run(),
        "seeds": wf.train.seeds,
        "runs": runs,
        "comparisons": comparisons,
        "contrasts": contrasts,
    }


def curves(wf: Workflow) -> dict:
    """Training metrics: of the models trained before scoring, and of each run per seed, with each
    run's final training CE (mean over seeds)."""
    models = {m.name: [read_metrics(wf.model_dir(m.name))] for m in wf.models}
    runs, finals = {}, []
    if wf.train is not None:
        runs = {r.name: [read_metrics(wf.run_ckpt(r.name, s)) for s in wf.train.seeds] for r in wf.train.runs}
        for name, seeds in runs.items():
            # each seed's last logged CE that is a number (the trainer writes a non-finite one as null)
            last = [v for v in (_last_number(r, "ce") for r in seeds) if v is not None]
            if last:
                finals.append({"run": name, "ce": float(np.mean(last)), "seeds": len(last)})
    return {
        "models": models if any(any(r) for r in models.values()) else None,
        "runs": runs if any(any(x) for x in runs.values()) else None,
        "finals": finals,
    }


def _last_number(rows: list[dict], key: str) -> float | None:
    return next((row[key] for row in reversed(rows) if isinstance(row.get(key), (int, float))), None)


def bpb_section(wf: Workflow, text: str = "main") -> dict:
    """A BPB table (every run × seed, mean, std), the unigram baseline and the verdicts."""
    table = bpb_table(wf, text)
    uni_file = wf.root / wf.eval.out / "unigram.json"
    unigram = read_number(uni_file, "bpb", "evaluation") if uni_file.is_file() and text == "main" else None
    title = (wf.eval.text or "the bundled WikiText-2 test set") if text == "main" else text_name(wf, text)
    return {
        "text": text,
        "title": title,
        "seeds": wf.train.seeds,
        "unigram": unigram,
        "tokens": TOKENS,
        **table,
    }


def missing_outputs(wf: Workflow) -> list[str]:
    """The outputs the workflow plans that its run_dir lacks (relative to it), in the steps' order: a
    run stopped part way, or outputs removed since; and each data output the report reads (the
    tokens, every score) that is there with shards missing or not matching their manifest, with how
    many and which (`incomplete_shards`). The tables use what is there; this says what is not, so a
    seed, a section or a shard short is not read as the whole run."""
    planned: list[Path] = [wf.tokens_dir() / STAGE_FILE]
    planned += [wf.score_dir(s.name) / STAGE_FILE for s in wf.scores]
    planned += [wf.model_dir(m.name) / f for m in wf.models for f in (STATE, METRICS)]
    if wf.agreement is not None:
        planned.append(wf.root / wf.agreement.out)
    if wf.synthesize is not None:
        planned += [
            wf.synthetic_dir(h) / STAGE_FILE for h in ((False, True) if wf.synthesize.heldout else (False,))
        ]
    if wf.truth is not None:
        planned.append(wf.root / wf.truth.out)
    if wf.train is not None:
        for seed in wf.train.seeds:
            for r in wf.train.runs:
                planned += [wf.run_ckpt(r.name, seed) / f for f in (STATE, METRICS)]
                planned += [wf.eval_file(r.name, seed, t) for t in (wf.eval_texts() if wf.eval else ())]
                if wf.accuracy is not None:
                    planned.append(wf.accuracy_file(r.name, seed))
                if wf.excess is not None:
                    planned.append(wf.excess_file(r.name, seed))
    # (an empty metrics.jsonl has no curve to show: missing as well)
    gone = [p for p in planned if not p.exists() or (p.name == METRICS and p.stat().st_size == 0)]
    gone = [p for p in gone if not (p.name == METRICS and p.parent / STATE in gone)]  # its run named once
    gone_set, out = set(gone), []
    for p in planned:
        # a directory's record names the directory: a step's output, not its bookkeeping
        name = str((p.parent if p.name in (STAGE_FILE, STATE) else p).relative_to(wf.root))
        if p in gone_set:
            out.append(name)
        elif p.name == STAGE_FILE and (short := incomplete_shards(p.parent, name)):
            out.append(short)
        elif p.name == STATE and (damage := checkpoint_damage(p.parent)):  # as the run judges it
            out.append(f"{name} ({damage})")
    return out


def incomplete_shards(directory: Path, name: str, shown: int = 5) -> str | None:
    """`name: K of N shards missing or not matching their manifest (the first few)` for a data
    output whose planned shards (its `.shards.json`) are not all committed (DataDir.missing: a
    deleted part, one whose size differs from its manifest's, a run stopped part way); its
    registry gone, that whether it is whole cannot be shown; None when it is whole."""
    d = DataDir(directory)
    try:
        if d.registry_lost:
            return (
                f"{name}: no {SHARDS_FILE}, so which shards its run planned, and whether any is missing, "
                "is unknown"
            )
        missing, n = d.missing, len(d.planned)
    except DataDirError as e:  # its bookkeeping does not parse: named, as every reader of it does
        raise ReportError(str(e)) from None
    if not missing:
        return None
    which = ", ".join(missing[:shown]) + (", …" if len(missing) > shown else "")
    return (
        f"{name}: {len(missing)} of {n} shard{'s' if n != 1 else ''} missing or not matching their "
        f"manifest ({which})"
    )


def report_data(run_dir: str | Path, n_samples: int = 3, max_tokens: int = 2_000_000) -> dict:
    """Everything the report shows, in the page's order."""
    record, wf = load_run(run_dir)
    experiment = wf.train is not None and wf.eval is not None
    scores = {}
    for s in wf.scores:
        sc = read_scores(wf.score_dir(s.name), max_tokens)
        if sc is not None:
            scores[s.name] = sc
    return {
        "run_dir": str(record.get("config", {}).get("run_dir", run_dir)),
        "missing": missing_outputs(wf),
        "headline": headline(wf) if experiment else None,
        "provenance": provenance(record),
        "documents": documents(wf.tokens_dir()),
        "scores": scores,
        "scorer_rows": scorer_rows(wf, scores),
        "tokenizer": load_tokenizer_of(wf) if scores and n_samples else None,
        "samples": samples(scores, n_samples) if scores and n_samples else None,
        "agreement": agreement(wf, scores) if scores else None,
        "writeup_agreement": writeup_agreement(wf),
        "curves": curves(wf),
        "bpb": [bpb_section(wf, t) for t in wf.eval_texts()] if experiment else [],
        "accuracy": accuracy_section(wf),
        "truth": truth_section(wf),
        "excess": excess_section(wf),
        "realism": realism(wf, max_tokens),
    }


def realism(wf: Workflow, max_tokens: int) -> dict | None:
    """The synthetic corpus' exact entropy, read as a score is, for the histograms and the mean by
    position beside the scores of real text (the teacher's loss on it: docs/experiments.md)."""
    if wf.synthesize is None:
        return None
    return read_scores(wf.synthetic_dir(), max_tokens)


def accuracy_section(wf: Workflow) -> list[dict]:
    if wf.train is None or wf.accuracy is None:
        return []
    return [{**t, "sentence": accuracy_sentence(t)} for t in accuracy_tables(wf)]
