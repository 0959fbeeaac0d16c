# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""One TrainConfig is the source of every training option: the CLI's flags, the workflow's keys and
torchrun's config file derive from it; one loss registry names the losses everywhere; the loop reads
the host once per step and reports tokens/s over real tokens."""

from __future__ import annotations

import json
import subprocess
import sys
import typing

import pytest
import torch
import yaml
from click.testing import CliRunner
from test_trainer_fixtures import TINY, one_thread, weighted_dir  # noqa: F401 - fixtures

from entroweight.trainers import LOSSES, LossSettings, TrainConfig, TrainError, TrainSettings, train
from entroweight.trainers.data import WeightedTokens, inspect_data
from entroweight.workflows import spec
from entroweight.workflows.cli.main import main
from entroweight.workflows.cli.train import train_cmd


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_every_training_option_is_a_flag_with_the_configs_default_and_choices():
    options = {o.name: o for o in train_cmd.params}
    for name, field in TrainConfig.model_fields.items():
        if name in ("data", "model_cfg") or (field.json_schema_extra or {}).get("cli") is False:
            continue
        opt = options[name]
        assert opt.opts == [flag(field.alias or name)]
        if not opt.is_flag and field.default is not None and not field.is_required():
            assert opt.default == field.default, name
    assert list(options["loss"].type.choices) == list(LOSSES)  # tfree_bce included
    assert list(options["normalize"].type.choices) == ["tokens", "weight"]


def test_the_workflow_schema_takes_its_training_keys_and_losses_from_the_config():
    assert issubclass(spec.TrainSettings, TrainSettings) and issubclass(spec.ExperimentRun, LossSettings)
    assert set(TrainSettings.model_fields) | {"nproc"} == set(spec.TrainSettings.model_fields)
    for cls in (spec.ModelSpec, spec.ExperimentRun):
        assert typing.get_args(cls.model_fields["loss"].annotation) == tuple(LOSSES)
    spec.ModelSpec(name="t", kind="tfree", loss="tfree_bce")  # the loss the old hand-written list lacked
    with pytest.raises(ValueError, match="focal"):
        spec.ExperimentRun(name="r", loss="focal")


def test_a_bad_config_names_each_field():
    with pytest.raises(TrainError) as e:
        TrainConfig(data="d", out="o", lr=0, steps=0, lossx="ce")
    msg = str(e.value)
    assert (
        "lr: Input should be greater than 0" in msg
        and "steps:" in msg
        and "lossx: not a training option" in msg
    )


def test_each_loss_gets_the_options_it_declares(weighted_dir, tmp_path):
    # hard_negative's margin reaches the loss: a tiny margin drops every competitor and changes the loss
    losses = {
        m: train(
            TrainConfig(
                data=str(weighted_dir),
                out=str(tmp_path / f"m{m}"),
                model_config=TINY,
                loss="hard_negative",
                margin=m,
                steps=1,
                batch_size=4,
                quiet=True,
            )
        ).loss
        for m in (0.01, 50.0)
    }
    assert losses[0.01] < losses[50.0]
    assert LOSSES["hard_negative"].options == ("margin",) and LOSSES["weighted_ce"].columns == ("weight",)


def test_train_reads_a_config_file_and_flags_override_it(weighted_dir, tmp_path):
    out = tmp_path / "run"
    conf = tmp_path / "run.yaml"
    conf.write_text(
        yaml.safe_dump(
            {"data": [str(weighted_dir)], "out": str(out), "model_config": TINY, "steps": 50, "batch_size": 4}
        )
    )
    r = CliRunner().invoke(main, ["train", "--config", str(conf), "--steps", "2", "--loss", "weighted_ce"])
    assert r.exit_code == 0, r.output
    train_cfg = json.loads((out / "config.json").read_text())["train"]
    assert train_cfg["steps"] == 2 and train_cfg["loss"] == "weighted_ce" and train_cfg["batch_size"] == 4
    # a typo in a key: refused with exit 2, naming it, writing nothing
    conf.write_text(yaml.safe_dump({"data": [str(weighted_dir)], "out": str(tmp_path / "x"), "stesp": 3}))
    r = CliRunner().invoke(main, ["train", "--config", str(conf)])
    assert r.exit_code == 2 and "stesp: not a training option" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x").exists()
    r = CliRunner().invoke(main, ["train", str(weighted_dir)])
    assert r.exit_code == 2 and "out: required, not given" in r.output


def test_torchrun_gets_the_run_config_as_a_file(weighted_dir, tmp_path, monkeypatch):
    from entroweight.workflows.engine.steps import torchrun

    cfg = TrainConfig(
        data=[str(weighted_dir)],
        out=str(tmp_path / "ddp"),
        model_config=TINY,
        loss="weighted_ce",
        normalize="weight",
    )
    cfg.overwrite = True
    seen = {}

    def fake_run(args, **kw):  # the command torchrun would start on each rank
        seen["args"] = args
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    torchrun(cfg, 2)
    args = seen["args"]
    assert args[args.index("train") + 1] == "--config" and "--nproc_per_node=2" in args
    handed = TrainConfig(**json.loads(open(args[-1]).read()))
    assert handed.model_copy(update={"quiet": cfg.quiet}) == cfg


def test_the_loop_reads_the_host_once_per_step_and_counts_real_tokens(weighted_dir, tmp_path, monkeypatch):
    calls = {"n": 0}
    item = torch.Tensor.item

    def counted(self):  # reads by the loop itself (AdamW on CPU reads its step counters too)
        calls["n"] += sys._getframe(1).f_code.co_filename.endswith("trainers/loop.py")
        return item(self)

    monkeypatch.setattr(torch.Tensor, "item", counted)
    steps, accum = 4, 3
    kw = dict(
        data=str(weighted_dir), model_config=TINY, steps=steps, grad_accum=accum, batch_size=4, log_every=4
    )
    res = train(TrainConfig(out=str(tmp_path / "r"), quiet=True, **kw))
    monkeypatch.undo()
    # one read per optimizer step (the non-finite guard), not one per micro-batch (12 here)
    assert calls["n"] == steps
    # tokens/s counts the real targets the loss saw, not the pads (this data is left-padded)
    files = inspect_data(str(weighted_dir)).files
    ds = WeightedTokens(files, batch_size=4, seed=0, epochs=None, columns=())
    batches = iter(ds)
    real = sum(int(next(batches)["mask"][:, 1:].sum()) for _ in range(steps * accum))
    assert res.tokens_per_s * res.seconds == pytest.approx(real, rel=1e-6)
    assert real < res.tokens


def test_out_inside_the_data_and_unknown_model_fields_are_refused(weighted_dir, tmp_path):
    for out in (weighted_dir, weighted_dir / "ckpt"):
        with pytest.raises(TrainError, match="(is|lies inside) the data"):
            train(TrainConfig(data=str(weighted_dir), out=str(out), model_config=TINY, steps=1, quiet=True))
    assert not (weighted_dir / "ckpt").exists() and not (weighted_dir / "config.json").exists()
    mc = {**TINY, "mask_pads": True}  # a llama field, not a mixer's: named, not a TypeError
    with pytest.raises(TrainError, match="mask_pads, which mixer does not take"):
        train(
            TrainConfig(
                data=str(weighted_dir), out=str(tmp_path / "m"), model="mixer", model_config=mc, quiet=True
            )
        )
    assert not (tmp_path / "m").exists()
