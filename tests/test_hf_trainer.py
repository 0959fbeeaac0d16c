# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""`transformers.Trainer` on our weighted data (trainers/hf.py): a real Trainer run of a tiny Llama on
CPU computes our trainer's loss, and gradient accumulation over micro-batches of unequal real-token
counts gives the loss and gradients of one batch of the same rows."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_trainer_fixtures import TINY, one_thread, weighted_dir  # noqa: F401 - fixtures
from transformers import LlamaForCausalLM, TrainerCallback, TrainingArguments

from entroweight.models import build_model
from entroweight.models.checkpoint import load_checkpoint
from entroweight.trainers import TrainConfig, train
from entroweight.trainers.export import hf_config, hf_state_dict
from entroweight.trainers.hf import (
    IGNORE,
    WeightedCollator,
    WeightedExamples,
    WeightedTrainer,
    weighted_lm_loss,
)

SEED, BUFFER = 3, 64  # the first two micro-batches of 2 rows hold 217 and 254 real targets


def our_run(data, out, **kw) -> tuple[dict, LlamaForCausalLM]:
    """Our trainer, one step: its first metrics row, and the model it started from as a LlamaForCausalLM."""
    base = dict(data=str(data), out=str(out), model_config=TINY, steps=1, lr=3e-3, quiet=True)
    train(TrainConfig(**base, loss="weighted_ce", seed=SEED, shuffle_buffer=BUFFER, **kw))
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    trained, _ = load_checkpoint(out)
    torch.manual_seed(SEED)  # the run's initial weights: built as it built them
    start = build_model("llama", dataclasses.asdict(trained.config))
    hf = LlamaForCausalLM(hf_config(start.config, {}))
    hf.load_state_dict(hf_state_dict(start), strict=False)
    return row, hf


class Grads(TrainerCallback):
    """The gradients the optimizer is about to apply (no clipping: max_grad_norm=0)."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.grads = {k: p.grad.clone() for k, p in self.model.named_parameters() if p.grad is not None}


def hf_run(data, model, tmp_path, batch: int, accumulate: int, normalize: str = "tokens"):
    """A real Trainer, one step: its first log row and the step's gradients."""
    args = TrainingArguments(
        output_dir=str(tmp_path / f"hf-{batch}-{accumulate}-{normalize}"),
        max_steps=1,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulate,
        learning_rate=1e-3,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        seed=SEED,
    )
    ds = WeightedExamples(str(data), seed=SEED, shuffle_buffer=BUFFER)
    grads = Grads(model)
    trainer = WeightedTrainer(
        model=model,
        args=args,
        train_dataset=ds,
        data_collator=WeightedCollator(ds.pad_id),
        normalize=normalize,
        callbacks=[grads],
    )
    trainer.train()
    row = next(r for r in trainer.state.log_history if "loss" in r)
    return row, grads.grads


def tiny_hf() -> LlamaForCausalLM:
    """A tiny Llama with the same initial weights on each call (and in each process)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(
        hf_config(build_model("llama", {**TINY, "vocab_size": 1024, "n_ctx": 128}).config, {})
    )


def test_a_trainer_run_computes_our_trainers_loss(weighted_dir, tmp_path):
    ours, start = our_run(weighted_dir, tmp_path / "ours", batch_size=4)
    state = {k: v.clone() for k, v in start.state_dict().items()}
    row, _ = hf_run(weighted_dir, start, tmp_path, batch=2, accumulate=2)
    assert row["loss"] == pytest.approx(ours["loss"], rel=1e-4)
    assert row["ce"] == pytest.approx(ours["ce"], rel=1e-4)  # the plain CE beside it
    assert row["loss"] < row["ce"] * 0.7  # (the weights in [0, 1] took effect)
    start.load_state_dict(state)
    whole, _ = hf_run(weighted_dir, start, tmp_path, batch=4, accumulate=1)
    assert whole["loss"] == pytest.approx(row["loss"], rel=1e-5)


@pytest.mark.parametrize("normalize", ["tokens", "weight"])
def test_accumulation_gives_one_batchs_gradients(weighted_dir, tmp_path, normalize):
    model = tiny_hf()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    whole, g1 = hf_run(weighted_dir, model, tmp_path, 4, 1, normalize)
    model.load_state_dict(state)
    accumulated, g2 = hf_run(weighted_dir, model, tmp_path, 2, 2, normalize)
    assert accumulated["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-4, atol=1e-7)


class Logits(torch.nn.Module):
    """A causal LM as a plain module that returns logits: no `loss_type` the Trainer could read."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, **_):
        return {"logits": self.lm(input_ids=input_ids).logits}


@pytest.mark.parametrize("normalize", ["tokens", "weight"])
def test_the_normaliser_is_ours_whatever_the_model(weighted_dir, tmp_path, normalize):
    """The Trainer skips each row's first label in its count only for a model it knows to shift them;
    WeightedTrainer counts the targets its loss takes, so a model it does not know trains on our loss."""
    model = Logits(tiny_hf())
    rows = itertools.islice(WeightedExamples(str(weighted_dir), seed=SEED, shuffle_buffer=BUFFER), 4)
    batch = WeightedCollator()(list(rows))
    with torch.no_grad():
        logits = model(batch["input_ids"])["logits"]
        want = weighted_lm_loss(logits, batch["labels"], batch["weight"], normalize=normalize)
    row, _ = hf_run(weighted_dir, model, tmp_path, 4, 1, normalize)
    assert row["loss"] == pytest.approx(want.item(), rel=1e-5)


def test_with_every_weight_1_it_is_the_trainers_own_ce(weighted_dir):
    """weighted_lm_loss with weights 1 is the CE a LlamaForCausalLM computes from its labels, with and
    without the Trainer's num_items_in_batch."""
    batch = WeightedCollator()(list(itertools.islice(WeightedExamples(str(weighted_dir), epochs=1), 3)))
    model = tiny_hf()
    ones = torch.ones_like(batch["weight"])
    n = int((batch["labels"][:, 1:] != IGNORE).sum())
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        counted = model(input_ids=batch["input_ids"], labels=batch["labels"], num_items_in_batch=2 * n)
        for normalize in ("tokens", "weight"):
            ours = weighted_lm_loss(out.logits, batch["labels"], ones, normalize=normalize)
            assert ours.item() == pytest.approx(out.loss.item(), rel=1e-5)
            halved = weighted_lm_loss(out.logits, batch["labels"], ones, 2 * n, normalize)
            assert halved.item() == pytest.approx(counted.loss.item(), rel=1e-5)


def test_examples_carry_labels_minus_100_on_pads_and_float_weights(weighted_dir):
    e = next(
        e
        for e in WeightedExamples(str(weighted_dir), epochs=1, shuffle=False)
        if (e["labels"] == IGNORE).any()
    )
    real = e["labels"] != IGNORE
    assert e["weight"].dtype == torch.float32 and (e["weight"][~real] == 0).all()
    assert torch.equal(e["labels"][real], e["input_ids"][real])
    assert ((e["weight"] > 0) & (e["weight"] < 1)).any()  # fractional: never an integer mask


def test_arguments_that_would_drop_the_weights_are_refused(weighted_dir, tmp_path):
    model = tiny_hf()
    ds = WeightedExamples(str(weighted_dir))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="remove_unused_columns=False"):
        WeightedTrainer(model=model, args=args, train_dataset=ds)
    with pytest.raises(ValueError, match="normalize"):
        WeightedTrainer(model=model, args=args, train_dataset=ds, normalize="mean")


def _hf_rank(rank: int, world: int, port: int, data: str, out: str):
    """One process of a two-process Trainer run (accelerate reads the torchrun variables): for each
    normalisation, one step of 2 micro-batches of 2 rows; its logged loss and the synced gradients."""
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    got = {}
    try:
        for normalize in ("tokens", "weight"):
            row, grads = hf_run(Path(data), tiny_hf(), Path(out), 2, 2, normalize)
            got[normalize] = {"loss": row["loss"], "ce": row["ce"], "grads": grads}
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    torch.save(got, f"{out}/got.{rank}")


def test_two_processes_give_one_batchs_loss_and_gradients(weighted_dir, tmp_path):
    """Two gloo processes, each accumulating 2 micro-batches of 2 rows whose real-token counts all
    differ: the Trainer's logged loss and plain CE and the gradients it applies are those of one batch
    of the same 8 rows in one process, for both normalisations."""
    examples = list(
        itertools.islice(WeightedExamples(str(weighted_dir), seed=SEED, shuffle_buffer=BUFFER), 8)
    )
    # accelerate hands each process its 2 rows of every 4 read (dispatch_batches): rank 0 the pairs 0
    # and 2, rank 1 the pairs 1 and 3; each rank's micro-batches and the ranks' steps hold unequal counts
    n = [sum(int((e["labels"][1:] != IGNORE).sum()) for e in examples[i : i + 2]) for i in (0, 2, 4, 6)]
    assert n[0] != n[2] and n[1] != n[3] and n[0] + n[2] != n[1] + n[3], n
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_hf_rank, args=(2, port, str(weighted_dir), str(tmp_path)), nprocs=2, join=True)
    for normalize in ("tokens", "weight"):
        whole, grads = hf_run(weighted_dir, tiny_hf(), tmp_path, 8, 1, normalize)
        for rank in range(2):
            got = torch.load(tmp_path / f"got.{rank}", weights_only=True)[normalize]
            assert got["loss"] == pytest.approx(whole["loss"], rel=1e-5)
            assert got["ce"] == pytest.approx(whole["ce"], rel=1e-5)
            for k in grads:
                torch.testing.assert_close(got["grads"][k], grads[k], rtol=1e-4, atol=1e-7)
