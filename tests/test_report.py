"""The HTML report, read back with html.parser: its numbers are the run's eval and metrics files."""

from __future__ import annotations

import json
import os
import shutil
from html.parser import HTMLParser

import numpy as np
import pytest
from test_workflow import run_cli, tiny_run  # noqa: F401 - the session fixture: one tiny run for both files

from entroweight.workflows.report.html import ReportError, compare, highlight, outcome, verdict, write_report
from entroweight.workflows.report.stats import decide


class Page(HTMLParser):
    """Cells with data-value, images, headings, verdicts and the sample spans of a report."""

    def __init__(self):
        super().__init__()
        self.cells, self.images, self.headings, self.verdicts, self.spans = [], [], [], [], []
        self.spans_bpb = []
        self._in, self._text = None, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "td" and "data-value" in a:
            self.cells.append(a)
        if tag == "img":
            self.images.append(a["src"])
        if tag == "span" and "title" in a:
            self.spans.append(a)
        if tag == "span" and "data-value" in a:
            self.spans_bpb.append(a)
        if tag in ("h2", "p") and (tag == "h2" or a.get("class") == "verdict"):
            self._in, self._text = (tag, a), []

    def handle_data(self, data):
        if self._in:
            self._text.append(data)

    def handle_endtag(self, tag):
        if self._in and tag == self._in[0]:
            text = "".join(self._text)
            (self.headings if tag == "h2" else self.verdicts).append((text, self._in[1]))
            self._in = None


@pytest.fixture(scope="module")
def page(tiny_run):  # noqa: F811
    p = Page()
    p.feed((tiny_run["run_dir"] / "report.html").read_text())
    return p


def test_report_is_self_contained(page, tiny_run):  # noqa: F811
    html = (tiny_run["run_dir"] / "report.html").read_text()
    assert page.images and all(src.startswith("data:image/png;base64,") for src in page.images)
    assert "http://" not in html and "https://" not in html and "<script" not in html
    titles = [h for h, _ in page.headings]
    for want in ("Provenance", "Scorers", "Mean entropy by position", "Sample texts", "Scorer agreement"):
        assert any(t.startswith(want) for t in titles), titles
    assert any(t.startswith("Bits per byte") for t in titles)


def test_bpb_numbers_equal_the_eval_files(page, tiny_run):  # noqa: F811
    run = tiny_run["run_dir"]
    per_seed = {
        (c["data-run"], int(c["data-seed"])): float(c["data-value"]) for c in page.cells if "data-seed" in c
    }
    stats = {(c["data-run"], c["data-stat"]): float(c["data-value"]) for c in page.cells if "data-stat" in c}
    assert len(per_seed) == 4
    for r in ("reference", "weighted-causal"):
        values = []
        for s in (0, 1):
            bpb = json.loads((run / "eval" / r / f"seed-{s}.json").read_text())["bpb"]
            assert per_seed[(r, s)] == bpb  # repr round-trips exactly
            values.append(bpb)
        assert stats[(r, "mean")] == pytest.approx(np.mean(values), rel=1e-12)
        assert stats[(r, "std")] == pytest.approx(np.std(values, ddof=1), rel=1e-12)
    ((sentence, attrs),) = page.verdicts
    assert attrs["data-run"] == "weighted-causal" and attrs["data-primary"] == "False"
    assert "within noise (t over 2 seeds × " in sentence and "blocks of the text, p = " in sentence
    assert "95 % interval" in sentence and "sign-flip test of the 2 per-seed differences" in sentence


def test_training_curves_come_from_the_metrics_files(tiny_run):  # noqa: F811
    run = tiny_run["run_dir"]
    html = (run / "report.html").read_text()
    for r in ("reference", "weighted-causal"):
        finals = [
            json.loads((run / "train" / r / f"seed-{s}" / "metrics.jsonl").read_text().splitlines()[-1])["ce"]
            for s in (0, 1)
        ]
        assert f"<tr><td>{r}</td><td class='num'>{np.mean(finals):.4f}</td>" in html


def test_samples_decode_exact_bytes_and_shade_by_entropy(page, tiny_run):  # noqa: F811
    assert page.spans, "no highlighted tokens"
    alphas = [float(s["style"].split(",")[-1].rstrip(")")) for s in page.spans]
    assert min(alphas) == 0.0 and max(alphas) == 1.0


def test_highlight_joins_tokens_split_inside_a_character():
    class Tok:  # token 0: first byte of "é", token 1: its second byte, token 2: "x"
        token_bytes = ["é".encode()[:1], "é".encode()[1:], b"<x>"]

    out = highlight(Tok(), np.array([0, 1, 2]), np.array([0.0, 2.0, 1.0]))
    assert out.count("<span") == 2
    assert ">é</span>" in out and ">&lt;x&gt;</span>" in out
    assert 'rgba(220,0,0,1.00)" title="2.000">é' in out  # the run takes its tokens' largest value


def test_noise_verdict():
    ref = {"run": "ref", "seeds": {0: 1.00, 1: 1.01, 2: 0.99}}
    near = compare({"run": "w", "seeds": {0: 1.005, 1: 0.995, 2: 1.0}}, ref)
    far = compare({"run": "w2", "seeds": {0: 0.90, 1: 0.91, 2: 0.89}}, ref)
    one = compare({"run": "w3", "seeds": {0: 0.9}}, ref)
    for c in decide([near, far, one], None, lower_is_better=True):
        c["verdict"] = verdict(c)
    assert outcome(near) == "within noise" and "within noise (t over 3 seeds, p = " in near["verdict"]
    assert "could have detected |Δ| ≥" in near["verdict"] and near["mde"] > abs(near["delta"])
    assert outcome(far) == "beats" and "beyond the noise of seeds and documents" in far["verdict"]
    lo, hi = far["ci"]
    assert hi < 0 and f"95 % interval {lo:+.4f} to {hi:+.4f}" in far["verdict"]
    assert outcome(one) == "undecided" and "add seeds" in one["verdict"]


def test_runs_are_compared_seed_by_seed():
    """A run 0.01 BPB better on every seed, seeds 0.1 apart: the paired test sees it; a test of the
    two seed means (the report's former Welch's t-test) called it noise."""
    ref = {"run": "ref", "seeds": {0: 1.00, 1: 1.10, 2: 0.90, 3: 1.05}}
    run = {"run": "w", "seeds": {s: v - 0.01 + 0.001 * s for s, v in ref["seeds"].items()}}
    (c,) = decide([compare(run, ref)], "w", lower_is_better=True)
    assert c["p"] < 0.001 and outcome(c) == "beats" and c["delta"] == pytest.approx(-0.0085)
    assert c["seeds"] == [0, 1, 2, 3]
    partial = {"run": "w", "seeds": {0: 0.99, 2: 0.89, 7: 0.5}}  # only seeds both have are paired
    assert compare(partial, ref)["seeds"] == [0, 2]


def test_accuracy_verdict_from_item_vectors():
    """The accuracy table's path: compare_items per run over seeds × documents, decide over the table,
    verdict(unit=accuracy)."""
    from entroweight.workflows.report.stats import compare_items

    rng = np.random.default_rng(0)
    docs = np.repeat(np.arange(100), 4)  # 4 items per document
    ref = {s: (rng.random(400) < 0.5).astype(int) for s in range(6)}
    better = {s: np.maximum(v, rng.random(400) < 0.4) for s, v in ref.items()}  # ~20 % more right
    same = {s: (rng.random(400) < 0.5).astype(int) for s in range(6)}  # as good, other items
    comps = [
        {"run": n, "reference": "ref", "cluster": "documents"} | compare_items(ref, r, docs)
        for n, r in (("better", better), ("same", same))
    ]
    for c in decide(comps, "better", lower_is_better=False):
        c["verdict"] = verdict(c, "accuracy")
    b, s_ = comps
    assert outcome(b) == "beats" and b["clusters"] == 100
    assert b["verdict"].startswith(
        f"better (the primary comparison) is higher (better) than ref by {b['delta']:.4f}"
    )
    assert "t over 6 seeds × 100 documents" in b["verdict"]
    assert outcome(s_) == "within noise" and "could have detected |Δ| ≥" in s_["verdict"]
    assert s_["alpha"] == 0.05 and "Holm-adjusted" in s_["verdict"]
    assert s_["ci"][0] < 0 < s_["ci"][1] and "No difference can be claimed" in s_["verdict"]


def test_report_cli_and_refusal(tiny_run, tmp_path):  # noqa: F811
    code, out = run_cli("report", tiny_run["run_dir"], "--out", tmp_path / "r.html")
    assert code == 0, out
    assert (tmp_path / "r.html").stat().st_size > 10_000
    with pytest.raises(ReportError, match="not a workflow run"):
        write_report(tmp_path)
    code, out = run_cli("report", tmp_path)
    assert code == 2 and "run.json" in out


def test_report_writes_over_its_own_reports_only(tiny_run, tmp_path):  # noqa: F811
    """A file at --out that the report did not write (a user's page) was replaced without a word;
    refused now (exit 2, the file as it was). Its own earlier report it writes over."""
    mine = tmp_path / "mine.html"
    mine.write_text("<html>my own page</html>")
    code, out = run_cli("report", tiny_run["run_dir"], "--out", mine)
    assert code == 2 and "a file the report did not write" in out, out
    assert mine.read_text() == "<html>my own page</html>"
    fifo = tmp_path / "fifo.html"
    os.mkfifo(fifo)  # reading it would block: refused as no file of the report's
    code, out = run_cli("report", tiny_run["run_dir"], "--out", fifo)
    assert code == 2 and "a file the report did not write" in out, out
    ours = tmp_path / "ours.html"
    ours.touch()  # an empty file holds nothing to lose
    for _ in range(2):
        code, out = run_cli("report", tiny_run["run_dir"], "--out", ours, "--samples", 0)
        assert code == 0, out


def test_report_takes_the_runs_own_report_settings_by_default(tiny_run, tmp_path):  # noqa: F811
    """`entroweight report RUN_DIR` writes what the run's report step writes: its `report.out` and its
    `report.samples` unless flags say otherwise (it wrote RUN_DIR/report.html with 3 samples)."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run["run_dir"], run)
    record = json.loads((run / "run.json").read_text())
    record["config"]["report"] = {
        **(record["config"].get("report") or {}),
        "out": "pages/r.html",
        "samples": 1,
    }
    (run / "run.json").write_text(json.dumps(record))
    (run / "report.html").unlink()
    code, out = run_cli("report", run)
    assert code == 0, out
    page = (run / "pages" / "r.html").read_text()
    assert not (run / "report.html").exists()
    n_scorers = len(record["config"]["scores"])
    assert page.count("<b>sample ") == n_scorers
    code, out = run_cli("report", run, "--samples", "0", "--out", tmp_path / "other.html")
    assert code == 0, out
    assert (tmp_path / "other.html").read_text().count("<b>sample ") == 0


def test_an_incomplete_run_says_what_is_missing(tiny_run, tmp_path):  # noqa: F811
    """Outputs the workflow plans but the run dir lacks (a run stopped part way, files removed) are
    named at the top of the page; a complete run names none. (The tables, read from what is there,
    showed one seed as the run's and dropped sections without a word.)"""
    import shutil

    from entroweight.workflows.report.data import missing_outputs
    from entroweight.workflows.spec import parse_workflow

    page = write_report(tiny_run["run_dir"], tmp_path / "whole.html", samples=0).read_text()
    assert "Incomplete run" not in page
    run = tmp_path / "run"
    shutil.copytree(tiny_run["run_dir"], run)
    (run / "eval" / "weighted-causal" / "seed-1.json").unlink()
    shutil.rmtree(run / "scores" / "occlusion")
    shutil.rmtree(run / "train" / "reference" / "seed-0")
    (run / "train" / "reference" / "seed-1" / "metrics.jsonl").write_text("")  # a curve gone: it said nothing
    record = json.loads((run / "run.json").read_text())
    wf = parse_workflow({**record["config"], "run_dir": str(run)})
    gone = ["scores/occlusion", "train/reference/seed-0", "train/reference/seed-1/metrics.jsonl",
            "eval/weighted-causal/seed-1.json"]  # fmt: skip
    assert sorted(missing_outputs(wf)) == sorted(gone)
    page = write_report(run, tmp_path / "part.html", samples=0).read_text()
    assert "<b>Incomplete run:</b> 4 outputs the workflow plans are missing or incomplete (" in page
    assert all(g in page for g in gone)
    # the headline and the verdict say how many seeds the comparisons read (they said "2 seeds")
    assert "2 seeds planned per run, as few as 1 evaluated in a comparison" in page
    assert "2 seeds per run" not in page and "2 seeds each" not in page
    # a run with no evaluation left is compared on none (it said "2 seeds per run")
    for f in (run / "eval" / "weighted-causal").glob("seed-*.json"):
        f.unlink()
    page = write_report(run, tmp_path / "none.html", samples=0).read_text()
    assert "2 seeds planned per run, as few as 0 evaluated in a comparison" in page


def test_a_data_output_with_shards_gone_is_named_with_how_many_and_which(tiny_run, tmp_path):  # noqa: F811
    """A score's shard and a tokens shard deleted from a finished run: the report said nothing (exit 0,
    no banner) while its Scorers table counted fewer shards, sequences and tokens, and the provenance
    said every document was processed. The banner names each directory, how many of its planned
    shards are missing and which, and says the figures are of the rest; a complete run has none."""
    from entroweight.schemas.datadir import DataDir
    from entroweight.workflows.report.data import missing_outputs
    from entroweight.workflows.spec import parse_workflow

    whole = write_report(tiny_run["run_dir"], tmp_path / "whole.html", samples=0).read_text()
    assert "Incomplete run" not in whole and "class='missing'" not in whole
    run = tmp_path / "run"
    shutil.copytree(tiny_run["run_dir"], run)
    gone = {}  # directory -> (the shard deleted, by the name its manifest gives it; shards planned)
    for directory, i in (("scores/causal_loss", 1), ("tokens", -1)):
        parts = DataDir(run / directory).parts
        assert len(parts) == 3, directory  # the tiny run: 120 docs in shards of 40
        (run / directory / parts[i].name).unlink()
        gone[directory] = (parts[i].manifest.shard, len(parts))
    assert set(gone) == {"scores/causal_loss", "tokens"}
    record = json.loads((run / "run.json").read_text())
    wf = parse_workflow({**record["config"], "run_dir": str(run)})
    said = {
        d: f"{d}: 1 of {n} shards missing or not matching their manifest ({shard})"
        for d, (shard, n) in gone.items()
    }
    assert missing_outputs(wf) == [said["tokens"], said["scores/causal_loss"]]  # in the steps' order
    code, out = run_cli("report", run, "--out", tmp_path / "part.html", "--samples", 0)
    assert code == 0, out
    page = (tmp_path / "part.html").read_text()
    assert "<b>Incomplete run:</b> 2 outputs the workflow plans are missing or incomplete (" in page
    assert all(s in page for s in said.values()), page[:3000]
    assert "the figures are of the rest of its shards" in page
    assert "scores/occlusion" not in page.split("<h2>", 1)[0]  # the whole one is not named
    # the Scorers table reads the rest: 2 of causal_loss's 3 shards
    assert "<tr><td>causal_loss</td><td>causal_loss</td><td class='num'>2</td>" in page


def test_a_seeds_value_that_is_not_a_number_is_refused_naming_its_file(tiny_run, tmp_path):  # noqa: F811
    """An evaluation holding NaN (or a string) made every statistic of its table NaN and the verdict
    "within noise", exit 0: refused, naming the file and the value."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run["run_dir"], run)
    f = run / "eval" / "reference" / "seed-1.json"
    from entroweight.workflows.results import sealed

    # sealed, as a step that wrote such a value would have (an edit by hand is refused as such:
    # tests/test_workflow.py)
    record = json.loads(f.read_text())
    for bad in (float("nan"), "abc", None):
        f.write_text(json.dumps(sealed({**record, "bpb": bad})))
        with pytest.raises(ReportError, match=f"{f} holds bpb .*, not a finite number"):
            write_report(run, tmp_path / "r.html", samples=0)


def test_the_page_escapes_what_the_run_recorded(tiny_run, tmp_path):  # noqa: F811
    """run.json is data, not markup: a workflow file name or a step detail holding HTML is shown as text."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run["run_dir"], run)
    record = json.loads((run / "run.json").read_text())
    record["workflow_file"] = "<script>alert(1)</script>.yaml"
    record["steps"][0]["detail"] = "<img src=x onerror=alert(2)>"
    (run / "run.json").write_text(json.dumps(record))
    out = write_report(run, tmp_path / "r.html", samples=1)
    page = out.read_text()
    assert "<script" not in page and "<img src=x" not in page
    assert (
        "&lt;script&gt;alert(1)&lt;/script&gt;.yaml" in page and "&lt;img src=x onerror=alert(2)&gt;" in page
    )


def test_the_report_refuses_a_score_shard_that_differs_from_its_manifest(tiny_run, tmp_path):  # noqa: F811
    """The report reads each score shard checked against its manifest, as every reader: no plots of
    corrupt bytes (exit 2, naming the shard; nothing written)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run["run_dir"], run)
    shard = sorted((run / "scores").glob("*/part-*.parquet"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    code, out = run_cli("report", run, "--out", tmp_path / "r.html")
    assert code == 2 and shard.name in out and "differ from its manifest" in out, out
    assert not (tmp_path / "r.html").exists()


# -- what report writes, and what it does with records gone bad
@pytest.mark.parametrize(
    "out, says",
    [
        ("run.json", "ending in .html"),
        ("eval/reference/seed-0.json", "ending in .html"),
        ("tokens", "holds the output of `tokenize`, not of `report`; write elsewhere\n"),
        ("train", "is a directory"),
        ("", "is empty"),
    ],
)
def test_report_never_writes_over_what_it_reads(tiny_run, out, says):  # noqa: F811
    """Rule: report writes one .html file; any other --out (a record of the run, a directory) is refused
    with exit 2, and nothing changes."""
    run_dir = tiny_run["run_dir"]
    target = run_dir / out if out else ""
    before = {p: p.read_bytes() for p in run_dir.rglob("*.json")}
    code, text = run_cli("report", run_dir, "--out", target)
    assert code == 2 and says in text and "Traceback" not in text, text
    assert {p: p.read_bytes() for p in run_dir.rglob("*.json")} == before
    assert not list(run_dir.rglob("*.tmp-*"))


@pytest.mark.parametrize(
    "name, taken",
    [
        ("r.html", True),
        ("R.HTML", True),
        ("sub/r.html", True),
        (".html", False),
        ("sub/.html", False),
        ("r.htm", False),
        ("run.json", False),
        ("r.html.j2", False),
        ("r.html/", False),
        ("sub/r.html/", False),
        ("r.html/.", False),
        ("r.html/x/..", False),
    ],
)
def test_the_workflow_and_report_out_take_the_same_report_names(tmp_path, name, taken):
    """One rule of what the report may be called (spec.is_report_name): a workflow's `report.out` is
    accepted exactly where `report --out` is (`.html`, a hidden file's name without a suffix, was
    taken by the one and refused by the other)."""
    from entroweight.workflows.report.html import check_report_out
    from entroweight.workflows.spec import REPORT_SUFFIX, SpecError, parse_workflow

    base = {"run_dir": str(tmp_path / "run"), "sources": ["a.jsonl"], "tokenizer": {"path": "t.json"}}
    try:
        parse_workflow(base | {"report": {"out": name}})
        spec_takes = True
    except SpecError as e:
        assert f"ending in {REPORT_SUFFIX}" in str(e)
        spec_takes = False
    try:
        check_report_out(f"{tmp_path}/{name}")  # as typed: a Path would drop a trailing /
        report_takes = True
    except ReportError as e:
        assert f"ending in {REPORT_SUFFIX}" in str(e)
        report_takes = False
    assert spec_takes == report_takes == taken


@pytest.mark.parametrize(
    "damage",
    [
        ("run.json", b"{not json"),
        ("eval/reference/seed-0.json", b'{"bpb": "x"}'),
        ("eval/reference/seed-0.json", b"[1, 2]"),
        ("train/reference/seed-0/metrics.jsonl", b"garbage\n"),
    ],
    ids=["run-record", "eval-value", "eval-type", "metrics"],
)
def test_a_damaged_record_is_named_not_a_traceback(tiny_run, tmp_path, damage):  # noqa: F811
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run["run_dir"], run_dir)
    name, content = damage
    (run_dir / name).write_bytes(content)
    code, text = run_cli("report", run_dir, "--out", tmp_path / "r.html")
    assert code == 2 and "Traceback" not in text, text
    assert not (tmp_path / "r.html").exists()


def test_a_null_the_trainer_writes_for_a_non_finite_value_is_read(tiny_run, tmp_path):  # noqa: F811
    """metrics.jsonl holds null where a logged value was not finite (docs/trainer.md): the report
    draws a gap there and takes each seed's last CE that is a number; it refused the run with
    numpy's TypeError."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run["run_dir"], run)
    m = run / "train" / "reference" / "seed-0" / "metrics.jsonl"
    rows = [json.loads(line) for line in m.read_text().splitlines()]
    rows[-1]["ce"] = None
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, text = run_cli("report", run, "--out", tmp_path / "r.html")
    assert code == 0, text
    from entroweight.workflows.report.data import curves
    from entroweight.workflows.spec import parse_workflow

    wf = parse_workflow({**json.loads((run / "run.json").read_text())["config"], "run_dir": str(run)})
    other = json.loads((m.parent.parent / "seed-1" / "metrics.jsonl").read_text().splitlines()[-1])["ce"]
    final = next(f for f in curves(wf)["finals"] if f["run"] == "reference")
    assert final["seeds"] == 2 and final["ce"] == pytest.approx((rows[-2]["ce"] + other) / 2)


def test_report_writes_inside_its_run_as_its_report_alone(tiny_run, tmp_path):  # noqa: F811
    """RUN_DIR/report.html (or the run's report.out) is the one file report writes inside what it
    reads; any other --out inside the run is refused, nothing written (it wrote run/train/x.html)."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run["run_dir"], run)
    for inside in (run / "train" / "x.html", run / "report2.html"):
        code, text = run_cli("report", run, "--out", inside)
        assert code == 2 and "lies inside RUN_DIR" in text and not inside.exists(), text
    code, text = run_cli("report", run, "--out", run / "report.html", "--samples", 0)
    assert code == 0, text


def test_a_truncated_metrics_line_is_named_by_its_line(tmp_path):
    """A metrics.jsonl cut mid-line (a killed run's last write) is refused naming the line, not the
    JSON error's position in the whole file."""
    from entroweight.workflows.report.data import METRICS, read_metrics

    (tmp_path / METRICS).write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.5}\n{"step": 3, "lo')
    with pytest.raises(ReportError, match="line 3: "):
        read_metrics(tmp_path)
    (tmp_path / METRICS).write_bytes(b'{"step": 1, "loss": 5.0}\n{"step": 2, "lo\xff\xfe"}\n')
    with pytest.raises(ReportError, match="line 2: "):
        read_metrics(tmp_path)
    (tmp_path / METRICS).write_text('{"step": 1, "loss": 5.0}\n[1, 2]\n')
    with pytest.raises(ReportError, match="line 2: not a JSON object"):
        read_metrics(tmp_path)
    (tmp_path / METRICS).write_text('{"step": 1, "loss": 5.0}\n\n{"step": 2, "loss": 4.5}\n')
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]


@pytest.mark.parametrize("record", ["{}", "[]", '{"config": null}', '{"config": [1]}'])
def test_a_run_record_of_no_workflow_config_is_refused_naming_it(tmp_path, record):
    """A run.json edited into JSON of another shape said "error: 'config'" (a KeyError's text)."""
    (tmp_path / "run.json").write_text(record)
    with pytest.raises(ReportError, match="run.json holds no workflow config"):
        write_report(tmp_path, tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def test_the_documents_line_is_what_tokenize_counted(tiny_run):  # noqa: F811
    """The report says how many documents the sources gave, how many were tokenized and rejected, as
    the tokens' manifests count them (the numbers `inspect` and an export show)."""
    import re

    from entroweight.pipelines.stage import read_manifests

    run = tiny_run["run_dir"]
    html = (run / "report.html").read_text()
    (line,) = re.findall(r"<p class='documents' data-docs-in='(\d+)' data-docs-out='(\d+)'>([^<]*)</p>", html)
    ms = read_manifests(run / "tokens")
    assert (int(line[0]), int(line[1])) == (sum(m.docs_in for m in ms), sum(m.docs_out for m in ms))
    rejected = sum(m.n_rejected for m in ms)
    assert f"{line[1]} tokenized, {rejected} rejected" in line[2], line[2]
