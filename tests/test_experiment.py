"""The experiment of issue 17 as a workflow: held-out source documents nothing trains on, BPB on them
and on WikiText-2, Rho-1's top-k selection from stored values (the weigh stage), and a report that opens with the
comparison table and a verdict computed from the numbers."""

from __future__ import annotations

import gzip
import json
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from test_workflow import c4_subset, run_cli, write_yaml

from entroweight.transforms.agreement import WRITEUP
from entroweight.transforms.tokenizer import load_tokenizer
from entroweight.workflows.report.html import bpb_table, outcome, verdict_sentence
from entroweight.workflows.results import sealed
from entroweight.workflows.spec import SpecError, parse_workflow

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}


def spec(tmp: Path, tokenizer_dir: Path, **changes) -> dict:
    s = {
        "run_dir": str(tmp / "run"),
        "sources": [str(c4_subset(tmp / "c4-60.json.gz", 0, 60))],
        "holdout": {"docs": 10, "max_bytes": 4000},
        "tokenizer": {"path": str(tokenizer_dir)},
        "tokenize": {"n_ctx": 32, "shard_docs": 25},
        "models": [
            {"name": "causal", "config": TINY_MODEL, "steps": 4, "batch_size": 8, "lr": 0.003},
            {"name": "other", "config": TINY_MODEL, "steps": 2, "batch_size": 8, "lr": 0.003, "seed": 1},
        ],
        "scores": [
            {
                "name": "causal_loss",
                "scorer": "causal_loss",
                "checkpoint_from": "causal",
                "options": {"dtype": "fp32"},
            },
            {
                "name": "topk",
                "values_from": "causal_loss",
                "weighting": {"method": "topk", "keep": 0.6, "quantiles_from": "causal_loss"},
            },
            {
                "name": "other",
                "scorer": "causal_loss",
                "checkpoint_from": "other",
                "options": {"dtype": "fp32"},
            },
            # derived from the two stored losses (no model run), and the shuffled control
            {"name": "excess", "values_from": ["causal_loss", "other"], "op": "difference"},
            {"name": "shuffled", "values_from": "causal_loss", "weighting": {"shuffle": 3}},
        ],
        "agreement": {"pairs": [{"y": "other", "x": "causal_loss", "writeup": "small-large"}]},
        "train": {
            "config": TINY_MODEL,
            "steps": 3,
            "batch_size": 8,
            "lr": 0.003,
            "seeds": [0, 1],
            "runs": [
                {"name": "reference", "data": "tokens", "loss": "ce"},
                {"name": "weighted", "data": "causal_loss", "loss": "weighted_ce"},
                {"name": "topk", "data": "topk", "loss": "weighted_ce", "normalize": "weight"},
            ],
        },
        "eval": {"max_bytes": 4000},
        "report": {"samples": 1},
    }
    s.update(changes)
    return s


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer_dir):
    tmp = tmp_path_factory.mktemp("experiment")
    wf = write_yaml(tmp / "wf.yaml", spec(tmp, tokenizer_dir))
    code, out = run_cli("run", wf)
    assert code == 0, out
    return {"dir": tmp / "run", "out": out, "source": tmp / "c4-60.json.gz", "tok": tokenizer_dir}


def test_held_out_documents_are_never_trained_on(run):
    d = run["dir"]
    docs = [json.loads(ln)["text"] for ln in gzip.open(run["source"], "rt")]
    assert (d / "holdout" / "heldout.txt").read_text() == "\n\n".join(docs[-10:])
    tok = load_tokenizer(run["tok"])
    trained, doc_ids = set(), set()
    for f in sorted((d / "tokens").glob("part-*.parquet")):
        t = pq.read_table(f)
        doc_ids.update(t.column("doc_id").to_pylist())  # a long document continues in later rows
        for ids, pad in zip(t.column("input_ids").to_pylist(), t.column("n_pad").to_pylist(), strict=True):
            trained.add(tok.decode_bytes(ids[pad:]).decode("utf-8", errors="ignore"))
    assert len(doc_ids) == 50
    for held in docs[-10:]:
        assert not any(held.startswith(x[:40]) for x in trained)  # no row starts like a held-out doc
    for kept in docs[:3]:
        assert any(kept.startswith(x[:40]) for x in trained)


def test_every_run_is_evaluated_on_both_texts(run):
    d = run["dir"]
    for r in ("reference", "weighted", "topk"):
        for s in (0, 1):
            main = json.loads((d / "eval" / r / f"seed-{s}.json").read_text())
            held = json.loads((d / "eval" / r / f"seed-{s}.heldout.json").read_text())
            assert held["bytes"] == 4000 and main["bytes"] == 4000
            assert held["bpb"] != main["bpb"]
    meta = pq.read_schema(next((d / "scores" / "topk").glob("part-*.parquet"))).metadata
    md = json.loads(next(v for k, v in meta.items() if k == b"entroweight"))
    assert md["weighting"]["method"] == "topk" and md["unit"] == "nats"


def test_agreement_step_is_compare_of_x_and_y(run):
    """The agreement table's row is `compare` of its x and y (y's line on x's), and the report shows
    it beside the write-up's row."""
    from entroweight.transforms.agreement import WRITEUP, compare_dirs

    d = run["dir"]
    table = json.loads((d / "agreement.json").read_text())
    (row,) = table["pairs"]
    want = compare_dirs(d / "scores" / "causal_loss", d / "scores" / "other")
    for k in ("slope", "intercept", "r2", "pearson", "spearman", "n_tokens", "n_sequences"):
        assert row[k] == want[k], k
    assert row["slope"] != compare_dirs(d / "scores" / "other", d / "scores" / "causal_loss")["slope"]
    assert row["writeup"]["r2"] == WRITEUP["small-large"][3]
    page = (d / "report.html").read_text()
    assert f"data-r2='{row['r2']!r}'" in page and "0.4922" in page
    assert "agreement agreement: up to date" in run_cli("run", run["dir"].parent / "wf.yaml")[1]


def test_derived_and_shuffled_steps(run):
    d = run["dir"]

    def read(name, col):
        t = pq.read_table(sorted((d / "scores" / name).glob("part-*.parquet"))[0])
        return np.stack(t.column(col).to_numpy(zero_copy_only=False)).astype(np.float64)

    np.testing.assert_array_equal(
        read("excess", "entropy"), read("causal_loss", "entropy") - read("other", "entropy")
    )
    np.testing.assert_array_equal(np.sort(read("shuffled", "weight")), np.sort(read("causal_loss", "weight")))
    assert not np.array_equal(read("shuffled", "weight"), read("causal_loss", "weight"))


class Headline(HTMLParser):
    def __init__(self):
        super().__init__()
        self.order, self.cells, self.sentence, self._in = [], [], None, False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "h2":
            self.order.append("h2")
        if tag == "td" and "data-head-mean" in a:
            self.cells.append(a)
        if tag == "p" and a.get("class") == "headline-verdict":
            self._in = True

    def handle_data(self, data):
        if self._in:
            self.sentence = (self.sentence or "") + data
            self.order.append("verdict")

    def handle_endtag(self, tag):
        if tag == "p":
            self._in = False


def test_report_opens_with_the_table_and_a_verdict_from_the_numbers(run):
    page = Headline()
    page.feed((run["dir"] / "report.html").read_text())
    assert page.order[:2] == ["h2", "verdict"]  # the first section of the page
    wf = parse_workflow(json.loads((run["dir"] / "run.json").read_text())["config"])
    wf.run_dir = str(run["dir"])
    for c in page.cells:
        seeds = [
            json.loads(wf.eval_file(c["data-head-run"], s, c["data-head-text"]).read_text())["bpb"]
            for s in (0, 1)
        ]
        assert float(c["data-head-mean"]) == pytest.approx(np.mean(seeds), rel=1e-12)
    assert len(page.cells) == 6  # 3 runs x 2 texts
    tables = {t: bpb_table(wf, t) for t in wf.eval_texts()}
    assert page.sentence == verdict_sentence(wf, tables)


def _fake_run(tmp: Path, tokenizer_dir: Path, bpb: dict, seeds: int = 5, **changes) -> object:
    """A workflow whose eval files hold `bpb` ((run, text) -> one value per seed) and nothing else."""
    base = spec(tmp, tokenizer_dir)
    train = {**base["train"], "seeds": list(range(seeds))} | changes.pop("train", {})
    wf = parse_workflow(spec(tmp, tokenizer_dir, train=train, **changes))
    for (run, text), values in bpb.items():
        for s, v in enumerate(values):
            p = wf.eval_file(run, s, text)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(sealed({"bpb": v})))  # as the eval step writes it
    return wf


def test_verdict_names_winners_losers_and_ties(tmp_path, tokenizer_dir):
    base = [2.00, 2.01, 1.99, 2.005, 1.995]
    better = [v - 0.05 for v in base]
    noisy = [2.03, 1.97, 2.02, 1.98, 2.0]
    worse = [v + 0.05 for v in base]
    bpb = {
        ("reference", "main"): base,
        ("reference", "heldout"): base,
        ("weighted", "main"): better,
        ("weighted", "heldout"): noisy,
        ("topk", "main"): worse,
        ("topk", "heldout"): worse,
    }
    wf = _fake_run(tmp_path, tokenizer_dir, bpb)
    tables = {t: bpb_table(wf, t) for t in wf.eval_texts()}
    got = {(c["run"], t): outcome(c) for t, tab in tables.items() for c in tab["comparisons"]}
    assert got == {
        ("weighted", "main"): "beats",
        ("weighted", "heldout"): "within noise",
        ("topk", "main"): "loses",
        ("topk", "heldout"): "loses",
    }
    sentence = verdict_sentence(wf, tables)
    assert "5 seeds each" in sentence
    assert (
        "weighted: beats the reference beyond noise on WikiText-2, is within noise of the reference on held-out"
        in sentence
    )
    assert "topk loses to the reference beyond noise on WikiText-2 and held-out text" in sentence


def test_report_names_the_primary_corrects_the_others_and_shows_what_noise_hides(tmp_path, tokenizer_dir):
    """6 seeds: the primary run (named in the workflow) is read unadjusted, the other runs' p are
    Holm-corrected per table, each within-noise verdict carries the smallest detectable difference at
    the alpha it faces, the sign-flip test sits beside it; the page opens with that table."""
    from entroweight.workflows.report import stats
    from entroweight.workflows.report.html import write_report

    base = [2.00, 2.01, 1.99, 2.005, 1.995, 2.0]
    jitter = [0.004, -0.003, 0.002, -0.004, 0.003, -0.001]
    runs = [*spec(tmp_path, tokenizer_dir)["train"]["runs"], {"name": "causal-2", "data": "causal_loss"}]
    runs[-1]["loss"] = "weighted_ce"
    bpb = {
        ("reference", "main"): base,
        ("reference", "heldout"): base,
        ("weighted", "main"): [v + 0.001 + j for v, j in zip(base, jitter, strict=True)],  # within noise
        ("weighted", "heldout"): [v - 0.02 + j / 4 for v, j in zip(base, jitter, strict=True)],  # beats
        ("topk", "main"): [v + 0.05 + j for v, j in zip(base, jitter, strict=True)],
        ("topk", "heldout"): [v + 0.05 + j for v, j in zip(base, jitter, strict=True)],
        ("causal-2", "main"): [v + 0.002 - j for v, j in zip(base, jitter, strict=True)],
        ("causal-2", "heldout"): [v + j for v, j in zip(base, jitter, strict=True)],
    }
    wf = _fake_run(
        tmp_path,
        tokenizer_dir,
        bpb,
        seeds=6,
        train={"runs": runs},
        report={"samples": 0, "primary": "weighted"},
    )
    assert wf.primary_run() == "weighted"
    for text in wf.eval_texts():
        by = {c["run"]: c for c in bpb_table(wf, text)["comparisons"]}
        assert by["weighted"]["primary"] and by["weighted"]["p_adjusted"] == by["weighted"]["p"]
        family = [by["topk"], by["causal-2"]]
        assert [c["p_adjusted"] for c in family] == pytest.approx(stats.holm([c["p"] for c in family]))
        assert all(c["alpha"] == 0.025 and c["sign_flip"] is not None for c in family)
        for c in by.values():
            d = np.subtract(bpb[(c["run"], text)], base)
            assert c["delta"] == pytest.approx(d.mean()) and c["p"] == pytest.approx(
                stats.paired_t(bpb[(c["run"], text)], base)["p"]
            )
            if c["outcome"] == "within noise":
                assert c["mde"] == pytest.approx(stats.mde_paired_t(d.std(ddof=1), 6, c["alpha"]))
                assert f"could have detected |Δ| ≥ {c['mde']:.4f} BPB" in c["verdict"]
            else:
                assert c["mde"] is None
    got = {(c["run"], t): outcome(c) for t in wf.eval_texts() for c in bpb_table(wf, t)["comparisons"]}
    assert got == {
        ("weighted", "main"): "within noise",
        ("weighted", "heldout"): "beats",
        ("topk", "main"): "loses",
        ("topk", "heldout"): "loses",
        ("causal-2", "main"): "within noise",
        ("causal-2", "heldout"): "within noise",
    }

    (wf.root / "run.json").write_text(json.dumps({"config": wf.model_dump(mode="json", by_alias=True)}))
    html = write_report(wf.root, samples=0).read_text()
    page = Headline()
    page.feed(html)
    assert page.order[:2] == ["h2", "verdict"]
    assert "Holm-corrected except the primary comparison, weighted" in page.sentence
    cells = {(c["data-head-run"], c["data-head-text"]): c for c in page.cells}
    assert len(cells) == 8
    assert "<td>weighted (primary)</td>" in html and "<th>sign-flip p</th>" in html
    assert "Primary comparison, named in the workflow before the runs (report.primary): weighted" in html
    assert stats.RULE in unescape(html)
    causal2 = next(c for c in bpb_table(wf, "main")["comparisons"] if c["run"] == "causal-2")
    assert (
        f"data-head-mde='{causal2['mde']!r}'>within noise (could detect |Δ| ≥ {causal2['mde']:.4f})" in html
    )
    assert f"data-head-p='{causal2['p_adjusted']!r}'>{causal2['p_adjusted']:.3g} (Holm)</td>" in html


def test_the_primary_defaults_to_weighted_occlusion_where_it_runs(tmp_path, tokenizer_dir):
    runs = spec(tmp_path, tokenizer_dir)["train"]["runs"]
    assert parse_workflow(spec(tmp_path, tokenizer_dir)).primary_run() is None  # no such run: none
    renamed = [runs[0], {**runs[1], "name": "weighted-occlusion"}, runs[2]]
    train = {**spec(tmp_path, tokenizer_dir)["train"], "runs": renamed}
    wf = parse_workflow(spec(tmp_path, tokenizer_dir, train=train))
    assert wf.primary_run() == "weighted-occlusion"
    # run.json records the primary in force, and reads back as it
    for w in (wf, parse_workflow(spec(tmp_path, tokenizer_dir))):
        assert parse_workflow(w.model_dump(mode="json", by_alias=True)).primary_run() == w.primary_run()
    none = parse_workflow(spec(tmp_path, tokenizer_dir, train=train, report={"primary": None}))
    assert none.primary_run() is None


def test_spec_refusals(tmp_path, tokenizer_dir):
    good = spec(tmp_path, tokenizer_dir)
    bad = json.loads(json.dumps(good))
    bad["scores"][1]["weighting"].pop("keep")
    with pytest.raises(SpecError, match="keep"):
        parse_workflow(bad)
    bad = json.loads(json.dumps(good))
    bad["scores"][1]["values_from"] = "topk"
    with pytest.raises(SpecError, match="values_from"):
        parse_workflow(bad)
    bad = json.loads(json.dumps(good))
    bad["scores"][0]["values_from"] = "causal_loss"
    with pytest.raises(SpecError, match="either scorer"):
        parse_workflow(bad)
    with pytest.raises(SpecError, match="holdout.docs"):
        parse_workflow({**good, "holdout": {"docs": 0}})
    with pytest.raises(SpecError, match=r"report.primary: 'weighted-occlusion' is not a run of train.runs"):
        parse_workflow({**good, "report": {"primary": "weighted-occlusion"}})
    with pytest.raises(SpecError, match="report.primary: 'reference' is the reference"):
        parse_workflow({**good, "report": {"primary": "reference"}})
    with pytest.raises(SpecError, match="report.primary: 'weighted' is not a run"):
        parse_workflow({**good, "train": None, "eval": None, "report": {"primary": "weighted"}})


def test_an_unknown_primary_is_refused_before_anything_runs(tmp_path, tokenizer_dir):
    p = write_yaml(tmp_path / "wf.yaml", spec(tmp_path, tokenizer_dir, report={"primary": "weigthed"}))
    code, out = run_cli("run", p)
    assert code == 2 and "report.primary: 'weigthed' is not a run of train.runs" in out
    assert "Traceback" not in out and not (tmp_path / "run").exists()


def _with(good: dict, **changes) -> dict:
    bad = json.loads(json.dumps(good))
    bad.update(changes)
    return bad


OTHER = {"name": "other", "scorer": "causal_loss", "checkpoint_from": "other", "options": {"dtype": "fp32"}}
LARGE_MEAN = {
    "name": "large",
    "scorer": "cross_tokenizer",
    "options": {"model": "x.gguf"},
}  # mean: the default


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"agreement": {"pairs": [{"y": "nope", "x": "causal_loss"}]}},
            "agreement.pairs[0].y: 'nope' is not a score step",
        ),
        (
            {"agreement": {"pairs": [{"y": "other", "x": "nope"}]}},
            "agreement.pairs[0].x: 'nope' is not a score step",
        ),
        ({"agreement": {"pairs": [{"y": "other", "x": "other"}]}}, "compare two score steps"),
        (
            {"agreement": {"pairs": [{"y": "other", "x": "causal_loss", "writeup": "l2-cos"}]}},
            "agreement.pairs[0].writeup",
        ),
        ({"agreement": {"pairs": []}}, "agreement.pairs"),
        (
            {
                "agreement": {
                    "pairs": [{"y": "other", "x": "causal_loss"}, {"y": "other", "x": "causal_loss"}]
                }
            },
            "other vs causal_loss is given more than once",
        ),
        ({"agreement": {"pairs": [{"y": "other", "x": "causal_loss"}], "out": "../a.json"}}, "agreement.out"),
        (
            {"scores@3": {"values_from": ["causal_loss", "nope"], "op": "difference"}},
            "'nope' is not an earlier score step",
        ),
        ({"scores@3": {"values_from": ["causal_loss", "other"]}}, "scores[3].op: two score steps need an op"),
        (
            {"scores@3": {"values_from": "causal_loss", "op": "difference"}},
            "scores[3].op: combines two score steps",
        ),
        ({"scores@3": {"values_from": ["causal_loss", "other"], "op": "ratio"}}, "scores[3].op"),
        ({"scores@3": {"values_from": ["a", "b", "c"], "op": "difference"}}, "scores[3].values_from"),
        ({"scores@3": {"values_from": ["other", "other"], "op": "difference"}}, "scores[3].values_from"),
        ({"scores@3": {"values_from": "other", "limit_rows": 5}}, "limit_shards/limit_rows"),
        ({"scores@4": {"weighting": {"shuffle": -1}}}, "scores[4].weighting.shuffle"),
        ({"scores@4": {"weighting": {"shuffle": False}}}, "not true/false"),  # would be seed 0: shuffled
        # what the run refused only after scoring, now refused from the spec: two units ...
        ({"scores@4": {"values_from": ["excess", "causal_loss"], "op": "difference"}}, "means nothing"),
        (  # ... two samples of rows ...
            {"scores@2": {**OTHER, "limit_rows": 5}},
            "hold different rows",
        ),
        (  # ... and a `mean` mapping reached through a re-weighing step
            {
                "scores@2": LARGE_MEAN,
                "scores@3": {"values_from": "large"},
                "scores@4": {"values_from": ["causal_loss", "excess"], "op": "difference"},
            },
            "aggregate: sum",
        ),
        (
            {
                "scores@2": LARGE_MEAN,
                "scores@3": {"values_from": ["causal_loss", "large"], "op": "difference"},
            },
            "aggregate: sum",
        ),
        (
            {"train@runs": {"name": "c", "data": "shuffled", "loss": "weighted_ce", "role": "ablation"}},
            "role",
        ),
        (  # the shuffled control permutes weights, not the entropy a `rescaled` loss reads
            {"train@runs": {"name": "c", "data": "shuffled", "loss": "rescaled"}},
            "not shuffled",
        ),
    ],
)
def test_agreement_and_derived_values_refusals(tmp_path, tokenizer_dir, change, message):
    """Refused at validation (exit 2 before anything runs), each naming its key."""
    bad = spec(tmp_path, tokenizer_dir)
    for key, value in change.items():
        if key.startswith("scores@"):
            i = int(key.split("@")[1])
            bad["scores"][i] = {"name": bad["scores"][i]["name"], **value} if "scorer" not in value else value
            if "weighting" in value:
                bad["scores"][i] = {**spec(tmp_path, tokenizer_dir)["scores"][i], **value}
        elif key == "train@runs":
            bad["train"]["runs"].append(value)
        else:
            bad[key] = value
    with pytest.raises(SpecError) as e:
        parse_workflow(bad)
    assert message in str(e.value)
    p = write_yaml(tmp_path / "bad.yaml", bad)
    code, out = run_cli("run", p)
    assert code == 2 and message in out and "Traceback" not in out
    assert not (tmp_path / "run").exists()


def test_holdout_larger_than_the_sources_is_refused(tmp_path, tokenizer_dir):
    p = write_yaml(tmp_path / "wf.yaml", spec(tmp_path, tokenizer_dir, holdout={"docs": 60}))
    code, out = run_cli("run", p)
    assert code == 2 and "sources hold only 60 documents" in out
    assert not (tmp_path / "run" / "tokens").exists()


@pytest.mark.parametrize(
    "name", ["default.yaml", "experiment.yaml", "experiment-small.yaml", "experiment-large.yaml"]
)
def test_shipped_experiment_workflows_parse(name):
    wf = parse_workflow(yaml.safe_load((ROOT / "workflows" / name).read_text()))
    runs = {r.name: r for r in wf.train.runs}
    assert runs["reference"].loss == "ce"
    if name == "default.yaml":  # make run: the experiment's data, models and scores, a subset of its runs
        full = parse_workflow(yaml.safe_load((ROOT / "workflows" / "experiment.yaml").read_text()))
        assert {r.name: r for r in full.train.runs if r.name in runs} == runs
        assert wf.train.model_dump(exclude={"runs", "seeds"}) == full.train.model_dump(
            exclude={"runs", "seeds"}
        )
        assert [m.model_dump() for m in wf.models] == [m.model_dump() for m in full.models]
        assert {"reference", "weighted-occlusion", "shuffled-occlusion", "weighted-large"} <= set(runs)
        assert len(wf.train.seeds) == 2 and wf.primary_run() == "weighted-occlusion"
        assert [list(p) for p in wf.report.contrasts] == [["weighted-occlusion", "shuffled-occlusion"]]
        assert wf.accuracy.decides == "margin"
        assert [p.writeup for p in wf.agreement.pairs] == list(WRITEUP)
        return
    assert (runs["rho1-topk"].loss, runs["rho1-topk"].normalize) == ("weighted_ce", "weight")
    excess = next(s for s in wf.scores if s.name == "excess")
    if excess.scorer is not None:
        assert excess.scorer == "excess_loss" and excess.options["cross_tokenizer"] is True
    else:  # derived from the stored losses: SmolLM2 scored once, with the nats-conserving `sum`
        assert (excess.sources(), excess.op) == (["causal_loss", "large"], "difference")
        large = next(s for s in wf.scores if s.name == "large")
        assert (large.scorer, large.options["aggregate"]) == ("cross_tokenizer", "sum")
        assert {r.name: r.role for r in wf.train.runs if r.role} == {
            "shuffled-occlusion": "control",
            "position-shuffled-occlusion": "control",
            "rescaled-large": "extension",
            "weighted-large": "extension",
        }
        # the controls are drawn per seed by the trainer, of the treatment's own data and loss
        for control, by in (("shuffled-occlusion", "row"), ("position-shuffled-occlusion", "position")):
            assert (runs[control].data, runs[control].loss, runs[control].shuffle_weights) == (
                "occlusion",
                "weighted_ce",
                by,
            )
            assert ["weighted-occlusion", control] in [list(p) for p in wf.report.contrasts]
        assert (runs["rescaled-large"].loss, runs["rescaled-large"].data) == ("rescaled", "large")
        assert not any(r.normalize == "weight" and r.data == "occlusion" for r in wf.train.runs)
        assert [p.writeup for p in wf.agreement.pairs] == list(WRITEUP)
    assert wf.holdout is not None and wf.eval_texts() == ["main", "heldout"]
    assert len(wf.train.seeds) == {"default.yaml": 2, "experiment.yaml": 6}.get(name, 5)
    assert wf.primary_run() == "weighted-occlusion"


def test_the_report_follows_the_workflow_and_shows_pairs_without_a_writeup_row(run, tmp_path):
    """A change that no step sees (report settings, the seeds or runs it lists) still rewrites the
    report, and an agreement pair with no write-up row renders (it crashed the report step)."""
    wf = yaml.safe_load((run["dir"].parent / "wf.yaml").read_text())
    wf["report"] = {"samples": 2}
    p = write_yaml(run["dir"].parent / "wf.yaml", wf)
    code, out = run_cli("run", p)
    assert code == 0 and "report report: ran" in out, out
    code, out = run_cli("run", p)
    assert code == 0 and "report report: up to date" in out, out
    wf["agreement"] = {"pairs": [{"y": "other", "x": "causal_loss"}]}
    code, out = run_cli("run", write_yaml(p, wf))
    assert code == 0 and "report report: ran" in out, out
    assert "Traceback" not in out


def test_a_named_contrast_compares_two_runs_with_each_other(tmp_path, tokenizer_dir):
    """report.contrasts: a weighted run against its own control, Δ = run − control with its interval,
    in the tables and on the page; a contrast of a run that does not exist is refused from the spec."""
    from entroweight.workflows.report import stats
    from entroweight.workflows.report.html import write_report

    base = [2.00, 2.01, 1.99, 2.005, 1.995, 2.0]
    jitter = [0.004, -0.003, 0.002, -0.004, 0.003, -0.001]
    bpb = {}
    for text in ("main", "heldout"):
        bpb[("reference", text)] = base
        bpb[("weighted", text)] = [v - 0.03 + j for v, j in zip(base, jitter, strict=True)]
        bpb[("topk", text)] = [v + j / 2 for v, j in zip(base, jitter, strict=True)]
    wf = _fake_run(
        tmp_path, tokenizer_dir, bpb, seeds=6, report={"samples": 0, "contrasts": [["weighted", "topk"]]}
    )
    for text in wf.eval_texts():
        (c,) = bpb_table(wf, text)["contrasts"]
        assert (c["run"], c["reference"]) == ("weighted", "topk")
        assert c["p"] == pytest.approx(stats.paired_t(bpb[("weighted", text)], bpb[("topk", text)])["p"])
        assert c["outcome"] == "better" and c["ci"][1] < 0
    (wf.root / "run.json").write_text(json.dumps({"config": wf.model_dump(mode="json", by_alias=True)}))
    html = write_report(wf.root, samples=0).read_text()
    assert "Each run against its own control" in html
    assert "data-contrast-run='weighted' data-contrast-other='topk'" in html
    bad = spec(tmp_path, tokenizer_dir) | {"report": {"contrasts": [["weighted", "nope"]]}}
    with pytest.raises(SpecError, match=r"report.contrasts\[0\].*'nope' is not a run"):
        parse_workflow(bad)


def test_bpb_is_compared_over_seeds_and_blocks_of_the_text(tmp_path, tokenizer_dir):
    """Eval results with nats per block: Δ is the BPB difference, and a run that differs from the
    reference on a few blocks alone has a wider interval than its per-seed numbers give."""
    import math

    from entroweight.workflows.report.data import compare

    rng = np.random.default_rng(3)
    sizes = [2000.0] * 20
    ref_nats = {s: rng.normal(1000, 5, 20) for s in range(6)}
    lumpy = {
        s: v + np.where(np.arange(20) < 2, 200.0, -2.0) + rng.normal(0, 3, 20) for s, v in ref_nats.items()
    }

    def run(name, nats):
        return {
            "run": name,
            "seeds": {s: float(np.sum(v) / (math.log(2) * 40_000)) for s, v in nats.items()},
            "blocks": {s: {"bytes": sizes, "nats": list(v)} for s, v in nats.items()},
        }

    c = compare(run("lumpy", lumpy), run("reference", ref_nats))
    seeds_only = compare({**run("lumpy", lumpy), "blocks": {}}, run("reference", ref_nats))
    assert c["cluster"] == "blocks of the text" and c["clusters"] == 20 and seeds_only["clusters"] == 1
    assert c["delta"] == pytest.approx(seeds_only["delta"], rel=1e-9)
    assert c["var_cluster"] > 0 and c["ci"][1] - c["ci"][0] > seeds_only["ci"][1] - seeds_only["ci"][0]


def test_a_misspelt_accuracy_endpoint_is_refused_from_the_spec(tmp_path, tokenizer_dir):
    """The offline task's endpoints are known: a typo would otherwise decide on another without a word."""
    wf = yaml.safe_load((ROOT / "workflows" / "default.yaml").read_text())
    wf["accuracy"]["decides"] = "margn"
    with pytest.raises(SpecError, match="decides: 'margn' is not one of margin"):
        parse_workflow(wf)
