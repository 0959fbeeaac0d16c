"""The known-entropy benchmark: the exact KL against a hand computation, the estimator table against
the truth, and the whole benchmark as a workflow on a tiny teacher (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_synthesize import _concat, save_teacher, stage
from test_workflow import c4_subset, run_cli, write_yaml

from entroweight.pipelines import run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.schemas.weighted import matrix
from entroweight.scorers.teacher import excess, excess_of_rows, incremental, teacher_source
from entroweight.transforms.agreement import truth_table
from entroweight.workflows.spec import SpecError, parse_workflow

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "workflow-known-entropy-tiny.yaml"


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir) -> tuple[Path, Path]:
    """A teacher and a student of another init (both tiny random llamas in the test tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    teacher = save_teacher(root / "teacher", tokenizer_dir)
    torch.manual_seed(1)
    student = save_teacher(root / "student", tokenizer_dir, mask_pads=True)  # another layout of the pads
    return teacher, student


@pytest.fixture(scope="module")
def heldout(tmp_path_factory, models) -> Path:
    out = tmp_path_factory.mktemp("heldout") / "out"
    run_stage(stage(models[0], temperature=0.7, sequences=6, seed=3), out, progress=False)
    return out


def _full_logp(ckpt: Path, ids: torch.Tensor, n_pad: np.ndarray, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of a checkpoint's full forward over the rows as written (fp64)."""
    from entroweight.models.checkpoint import load_checkpoint

    model = load_checkpoint(ckpt)[0]
    real = torch.tensor(np.arange(ids.shape[1])[None, :] >= n_pad[:, None])
    with torch.no_grad():
        mask = real if model.config.mask_pads else None
        return torch.log_softmax(model(ids, attention_mask=mask).double() / temperature, -1)


def test_the_kl_is_the_hand_computation_over_both_full_forwards(models, heldout):
    """KL_t = Σ_v p(v) (log p(v) − log q(v)) of the teacher's distribution at T (the one each token was
    drawn from) and the student's at 1, from each model's full forward over the rows as written; CE is
    the student's −log q(x_t); H the teacher's entropy, which the synthesize output stored."""
    teacher, student = models
    t = _concat(heldout)
    ids = torch.tensor(matrix(t.column("input_ids")).astype(np.int64))
    n_pad = t.column("n_pad").to_numpy()
    logp = _full_logp(teacher, ids, n_pad, 0.7)[:, :-1]  # position i predicts token i + 1
    logq = _full_logp(student, ids, n_pad, 1.0)[:, :-1]
    kl = (logp.exp() * (logp - logq)).sum(-1)  # the drawn tokens: after the one pad
    ce = -logq.gather(2, ids[:, 1:, None])[..., 0]
    H = -(logp.exp() * logp).sum(-1)

    def decoder(ckpt):
        source = teacher_source(str(ckpt))
        return incremental(source, source.load("cpu", "fp32", {}))

    got = excess(
        decoder(teacher),
        decoder(student),
        ids[:, :1].numpy(),
        np.zeros((len(ids), 1), bool),
        ids[:, 1:].numpy(),
        0.7,
    )
    np.testing.assert_allclose(got.kl, kl.numpy(), atol=1e-4)
    np.testing.assert_allclose(got.ce, ce.numpy(), atol=1e-4)
    np.testing.assert_allclose(got.entropy, H.numpy(), atol=1e-4)
    np.testing.assert_allclose(got.entropy, matrix(t.column("entropy"))[:, 1:], atol=2e-4)
    assert (got.kl > 0).all()
    # a student that is the teacher is at the floor: KL 0 (at T = 1), CE − H only noise around it
    same = excess(
        decoder(teacher),
        decoder(teacher),
        ids[:, :1].numpy(),
        np.zeros((len(ids), 1), bool),
        ids[:, 1:].numpy(),
    )
    assert np.abs(same.kl).max() < 1e-6

    res = excess_of_rows(str(heldout), str(student), checkpoint=str(teacher), batch_size=4)
    assert res["tokens"] == kl.numel()
    assert res["kl"] == pytest.approx(kl.mean().item(), abs=1e-4)
    assert res["ce_minus_h"] == pytest.approx((ce - H).mean().item(), abs=1e-4)
    np.testing.assert_allclose(res["rows"]["kl"], kl.sum(1).numpy(), atol=1e-3)


def test_rows_of_another_teacher_are_refused(models, heldout):
    from entroweight.scorers.teacher import TeacherError

    with pytest.raises(TeacherError, match="not drawn from the teacher"):
        excess_of_rows(str(heldout), str(models[1]), checkpoint=str(models[1]))


def test_the_truth_table_finds_the_teachers_own_loss_and_bounds_its_intervals(
    tmp_path, models, tokenizer_dir
):
    """At T = 1 the teacher's causal_loss on its own corpus is the stored surprisal: r = 1 against it
    (interval included); every statistic lies within its 95 % interval; the surprisal row is built in."""
    teacher = models[0]
    synth = tmp_path / "synth"
    run_stage(stage(teacher, sequences=12), synth, progress=False)
    scored = tmp_path / "loss"
    tok = str(tokenizer_dir / "tokenizer.json")
    run_stage(
        ScoreStage(synth, "causal_loss", {"checkpoint": str(teacher), "dtype": "fp32"}, None, True, tok),
        scored,
        progress=False,
    )
    table = truth_table(synth, {"teacher_loss": scored}, resamples=200, seed=0)
    rows = {r["scorer"]: r for r in table["rows"]}
    assert list(rows) == ["surprisal", "teacher_loss"]
    assert "surprisal" not in rows["surprisal"]  # not against itself
    own = rows["teacher_loss"]["surprisal"]
    assert own["pearson"] == pytest.approx(1.0, abs=1e-5) and own["spearman"] == pytest.approx(1.0, abs=1e-3)
    assert own["pearson_ci"][0] == pytest.approx(1.0, abs=1e-5)
    for row in rows.values():
        for target in ("entropy", "surprisal"):
            if target not in row:
                continue
            v = row[target]
            for stat in ("pearson", "spearman", "r2"):
                lo, hi = v[f"{stat}_ci"]
                assert lo - 1e-9 <= v[stat] <= hi + 1e-9, (row["scorer"], target, stat)
    assert rows["teacher_loss"]["entropy"]["r2"] == pytest.approx(
        rows["surprisal"]["entropy"]["r2"], abs=1e-5
    )


def _tiny(tmp: Path, **changes) -> dict:
    spec = yaml.safe_load(TINY.read_text())
    spec["run_dir"] = str(tmp / "run")
    spec["sources"] = [str(c4_subset(tmp / "c4-120.json.gz", 0, 120))]
    spec.update(changes)
    return spec


@pytest.mark.parametrize(
    "change, where",
    [
        ({"synthesize": None}, "models[1].data: no synthesize section"),
        (
            {"synthesize": {"teacher": "nobody", "sequences": 4}},
            "synthesize.teacher: 'nobody' is not a models step",
        ),
        (
            {"synthesize": {"teacher": "estimator", "sequences": 4}},
            "synthesize.teacher: 'estimator' is a estimator",
        ),
        (
            {"synthesize": {"teacher": "student", "sequences": 4}},
            "trains on the synthetic corpus it would draw",
        ),
        (
            {"synthesize": {"teacher": "teacher", "sequences": 4, "heldout": 2, "heldout_seed": 0}},
            "heldout_seed equals seed",
        ),
        ({"synthesize": {"teacher": "teacher", "sequences": 4}}, "excess: reads held-out synthetic rows"),
        ({"truth": {"scores": ["nothing"]}}, "truth.scores[0]: 'nothing' is not a score step"),
    ],
)
def test_the_spec_refuses_a_benchmark_it_cannot_run(tmp_path, change, where):
    spec = _tiny(tmp_path, **change)
    with pytest.raises(SpecError) as e:
        parse_workflow({k: v for k, v in spec.items() if v is not None})
    assert where in str(e.value)


def test_a_truth_score_of_the_real_tokens_is_refused(tmp_path):
    spec = _tiny(tmp_path)
    spec["scores"].append({"name": "real", "scorer": "causal_loss", "checkpoint_from": "teacher"})
    spec["truth"]["scores"].append("real")
    with pytest.raises(SpecError, match=r"truth.scores\[2\]: 'real' does not score the synthetic corpus"):
        parse_workflow(spec)


def test_the_benchmark_runs_as_a_workflow_and_a_rerun_does_nothing(tmp_path):
    """The tiny known-entropy workflow: teacher on the tokens, corpus and held-out rows drawn, student and
    estimator trained on the corpus and scored against the truth, two runs over 2 seeds measured by the
    exact KL; the report shows both tables; the rerun does nothing."""
    wf = write_yaml(tmp_path / "wf.yaml", _tiny(tmp_path))
    code, out = run_cli("run", wf)
    assert code == 0, out
    run = tmp_path / "run"
    truth = json.loads((run / "truth.json").read_text())
    assert [r["scorer"] for r in truth["rows"]] == ["surprisal", "causal_loss", "occlusion"]
    assert all(r["n_rows"] == 40 for r in truth["rows"])
    for name in ("reference", "oracle"):
        for seed in (0, 1):
            res = json.loads((run / "excess" / name / f"seed-{seed}.json").read_text())
            assert res["tokens"] == 16 * 31 and res["kl"] > 0 and len(res["rows"]["kl"]) == 16
    html = (run / "report.html").read_text()
    assert "Estimators against the truth" in html and "KL to the teacher" in html
    code, again = run_cli("run", wf)
    assert code == 0 and "ran" not in again.replace("ran in", ""), again


@pytest.mark.parametrize("name", ["known-entropy", "known-entropy-data-limited", "known-entropy-gpu"])
def test_the_benchmark_workflows_are_valid(name):
    from entroweight.workflows.spec import load_workflow

    wf = load_workflow(ROOT / "workflows" / f"{name}.yaml")
    assert wf.synthesize is not None and wf.excess is not None
    assert {r.data for r in wf.train.runs} >= {"synthetic"}


def test_a_score_that_is_only_the_position_trend_reads_zero_within_position(monkeypatch):
    """The truth's entropy falls along the row (less context early): a score that is only the position
    correlates with it, and the within-position Spearman, which takes each position's mean rank out
    of both, says it knows nothing of which token is uncertain."""
    from entroweight.transforms import agreement

    rng = np.random.default_rng(0)
    rows, width = 300, 40
    ids = {f"r{i}": rng.integers(0, 50, width) for i in range(rows)}
    trend = 3.0 * np.exp(-np.arange(width) / 8)
    h = {sid: trend + rng.normal(0, 0.5, width) for sid in ids}
    columns = {
        "truth": {"entropy": h, "surprisal": {sid: v + rng.exponential(1.0, width) for sid, v in h.items()}},
        "position": {"entropy": {sid: trend.copy() + 1e-9 * rng.random(width) for sid in ids}},
        "knows": {"entropy": {sid: v + rng.normal(0, 0.3, width) for sid, v in h.items()}},
    }
    meta = {"stage": "synthesize"}
    monkeypatch.setattr(
        agreement, "_read", lambda d, col: (meta, {sid: (ids[sid], v) for sid, v in columns[d][col].items()})
    )
    table = agreement.truth_table("truth", {"position": "position", "knows": "knows"}, resamples=100)
    rows_ = {r["scorer"]: r["entropy"] for r in table["rows"]}
    assert rows_["position"]["spearman"] > 0.5 and abs(rows_["position"]["spearman_within_position"]) < 0.1
    assert rows_["knows"]["spearman_within_position"] > 0.7
    lo, hi = rows_["knows"]["spearman_within_position_ci"]
    assert lo <= rows_["knows"]["spearman_within_position"] <= hi
