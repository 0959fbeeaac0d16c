# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""The training loop: it learns, logs, checkpoints, resumes exactly, refuses bad runs, runs every loss."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from test_trainer_fixtures import TINY, one_thread, weighted_dir  # noqa: F401 - fixtures

from entroweight.models.checkpoint import load_checkpoint
from entroweight.trainers import TrainConfig, TrainError, train


def cfg(data, out, **kw) -> TrainConfig:
    base = dict(data=str(data), out=str(out), model_config=TINY, steps=12, batch_size=8, lr=3e-3, quiet=True)
    return TrainConfig(**{**base, **kw})


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_trains_logs_and_checkpoints(weighted_dir, tokenizer_dir, tmp_path):
    out = tmp_path / "run"
    res = train(cfg(weighted_dir, out, steps=30, log_every=5, tokenizer=str(tokenizer_dir)))
    rows = metrics(out)
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    assert set(rows[0]) >= {"step", "loss", "ce", "lr", "tokens", "tokens_per_s"}
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # from ~log(1024) ≈ 6.9 towards the unigram entropy
    assert rows[-1]["tokens"] == 30 * 8 * 128 == res.tokens
    assert rows[0]["lr"] > rows[-1]["lr"]  # cosine decay after warmup
    model, config = load_checkpoint(out)
    assert config["step"] == 30 and config["vocab_size"] == 1024 and config["n_ctx"] == 128
    assert config["tokenizer_sha256"] == (tokenizer_dir / "tokenizer.sha256").read_text().split()[0]
    assert (out / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    assert json.loads((out / "trainer_state.json").read_text())["position"] == 30
    assert model.config.d_model == 64


@pytest.mark.parametrize(
    "stop", [6, 5]
)  # at a log step, and between two (a row's loss sums both runs' steps)
def test_resume_continues_to_the_same_result(weighted_dir, tmp_path, stop):
    full, part = tmp_path / "full", tmp_path / "part"
    train(cfg(weighted_dir, full, log_every=3, shuffle_buffer=100))
    train(cfg(weighted_dir, part, log_every=3, shuffle_buffer=100, stop_at=stop))
    assert json.loads((part / "trainer_state.json").read_text())["step"] == stop
    train(cfg(weighted_dir, part, log_every=3, shuffle_buffer=100, resume=True))
    a, b = load_file(str(full / "model.safetensors")), load_file(str(part / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = load_file(str(full / "optimizer.safetensors")), load_file(str(part / "optimizer.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)

    def losses(out):  # the rows of the log steps (a run stopped between them logs a row where it stopped)
        return [(r["step"], r["loss"], r["lr"]) for r in metrics(out) if r["step"] % 3 == 0]

    assert losses(full) == losses(part) and len(losses(full)) == 4


def test_refusals_say_what_to_do(weighted_dir, tokenized_dir, llama3_tokenizer, tmp_path):
    with pytest.raises(TrainError, match="re-tokenize"):
        train(cfg(weighted_dir, tmp_path / "a", tokenizer=str(llama3_tokenizer)))
    with pytest.raises(TrainError, match="no 'weight' column"):
        train(cfg(tokenized_dir, tmp_path / "b", loss="weighted_ce"))
    with pytest.raises(TrainError, match="drop vocab_size"):
        train(cfg(weighted_dir, tmp_path / "c", model_config={**TINY, "vocab_size": 2048}))
    with pytest.raises(TrainError, match="raise n_ctx"):
        train(cfg(weighted_dir, tmp_path / "c", model_config={**TINY, "n_ctx": 64}))
    with pytest.raises(TrainError, match="nothing to resume"):
        train(cfg(weighted_dir, tmp_path / "d", resume=True))
    with pytest.raises(TrainError, match="unknown loss"):
        cfg(weighted_dir, tmp_path / "e", loss="focal")
    with pytest.raises(TrainError, match="pass --tokenizer"):
        train(cfg(weighted_dir, tmp_path / "f", loss="prefix_smooth"))
    out = tmp_path / "g"
    train(cfg(weighted_dir, out, steps=2))
    with pytest.raises(TrainError, match="pass --resume"):  # another run's settings (the same: it continues)
        train(cfg(weighted_dir, out, steps=3))
    with pytest.raises(TrainError, match="differs from the checkpoint"):
        train(cfg(weighted_dir, out, steps=4, resume=True, model_config={**TINY, "d_ff": 128}))


@pytest.mark.parametrize(
    "loss,kw",
    [
        ("weighted_ce", {"normalize": "weight", "grad_accum": 2}),
        ("rescaled", {}),
        ("hard_negative", {"margin": 2.0}),
        ("prefix_smooth", {"prefix_weight": 0.1}),
    ],
)
def test_every_loss_trains(weighted_dir, tokenizer_dir, tmp_path, loss, kw):
    out = tmp_path / loss
    train(cfg(weighted_dir, out, loss=loss, steps=4, log_every=2, tokenizer=str(tokenizer_dir), **kw))
    rows = metrics(out)
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert json.loads((out / "config.json").read_text())["loss"] == loss


def test_any_registered_model_kind_trains(weighted_dir, tmp_path):
    from entroweight.models import REGISTRY, model_class

    trained = []
    for kind in REGISTRY:
        try:
            cls = model_class(kind)
        except ModuleNotFoundError:
            continue  # that model has not landed yet
        fields = {f.name for f in dataclasses.fields(cls.Config)}
        mc = {k: v for k, v in TINY.items() if k in fields}
        # a model of parts (the estimator, the autoencoder): tiny parts too, not their full defaults
        mc |= {
            part: {"d_model": 64, "n_layers": 1}
            for part in ("encoder_config", "decoder_config")
            if part in fields
        }
        res = train(cfg(weighted_dir, tmp_path / kind, model=kind, model_config=mc, steps=2, log_every=1))
        assert res.step == 2 and res.loss is not None
        trained.append(kind)
    assert "llama" in trained


def test_cli_train_and_refusal(weighted_dir, tokenizer_dir, tmp_path):
    from entroweight.workflows.cli.main import main

    mc = tmp_path / "tiny.yaml"
    mc.write_text("d_model: 64\nn_layers: 2\nn_heads: 2\nd_ff: 192\n")
    args = [
        "train",
        str(weighted_dir),
        "--model",
        "llama",
        "--model-config",
        str(mc),
        "--loss",
        "weighted_ce",
    ]
    args += [
        "--out",
        str(tmp_path / "ck"),
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--lr",
        "1e-3",
        "--seed",
        "1",
    ]
    r = CliRunner().invoke(main, [*args, "--tokenizer", str(tokenizer_dir), "--log-every", "1"])
    assert r.exit_code == 0, r.output
    assert "trained 3 steps" in r.output
    r = CliRunner().invoke(main, args)  # again into the same --out
    assert r.exit_code == 2 and "pass --resume" in r.output
