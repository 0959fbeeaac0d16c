# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""One normaliser per optimizer step: a step of micro-batches (gradient accumulation, DDP ranks) whose
real-token counts differ gives the loss and gradients of one batch of the same rows, for every loss
and both `normalize` settings, not a mean of the micro-batches' means."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.multiprocessing as mp
from test_trainer_fixtures import TINY, one_thread, weighted_dir  # noqa: F401 - fixtures

from entroweight.models import build_model
from entroweight.trainers import LOSSES, TrainConfig, WeightedTokens, train
from entroweight.trainers.loop import step_gradients

V, T = 64, 12
MODEL = {"vocab_size": V, "n_ctx": T, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}
# per row, the left pads: micro-batches of two rows hold 21, 12, 18 and 3 real tokens
PADS = [0, 3, 6, 6, 2, 4, 10, 11]


def rows() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (len(PADS), T), generator=g)
    mask = torch.arange(T)[None, :] >= torch.tensor(PADS)[:, None]
    ids[~mask] = 0
    weight = torch.rand(len(PADS), T, generator=g) * mask
    return {
        "input_ids": ids,
        "mask": mask,
        "weight": weight,
        "entropy": torch.rand(len(PADS), T, generator=g),
    }


def split(batch, n: int, part: int = 0, parts: int = 1) -> list[dict]:
    """`parts` shares of the rows (a rank's), each cut into `n` micro-batches: `part`'s micro-batches."""
    share = len(PADS) // parts
    mine = {k: v[part * share : (part + 1) * share] for k, v in batch.items()}
    size = share // n
    return [{k: v[i * size : (i + 1) * size] for k, v in mine.items()} for i in range(n)]


def gradients(model, micro_batches, loss: str, normalize: str, world: int = 1):
    model.zero_grad()
    step_loss, ce = step_gradients(
        model,
        micro_batches,
        LOSSES[loss],
        {"normalize": normalize} if loss == "weighted_ce" else {},
        {},
        world,
        torch.device("cpu"),
        contextlib.nullcontext(),
        False,
        lambda micro: None,
        True,
    )
    inner = getattr(model, "module", model)
    return step_loss, ce, {k: p.grad.clone() for k, p in inner.named_parameters()}


def _model():
    torch.manual_seed(0)
    return build_model("llama", MODEL)


# the losses of our data's columns alone (prefix_smooth, tfree_bce need a tokenizer or their head)
CASES = [("weighted_ce", "tokens"), ("weighted_ce", "weight"), ("ce", "tokens"), ("rescaled", "tokens")]


def test_the_micro_batches_hold_unequal_real_token_counts():
    assert len({int(b["mask"][:, 1:].sum()) for b in split(rows(), 4)}) == 4


@pytest.mark.parametrize("loss,normalize", CASES)
@pytest.mark.parametrize("accumulate", [2, 4])
def test_accumulated_micro_batches_give_one_batchs_loss_and_gradients(loss, normalize, accumulate):
    model = _model()
    whole_loss, whole_ce, whole = gradients(model, split(rows(), 1), loss, normalize)
    step_loss, ce, grads = gradients(model, split(rows(), accumulate), loss, normalize)
    assert step_loss.item() == pytest.approx(whole_loss.item(), rel=1e-5)
    assert torch.allclose(ce, whole_ce, rtol=1e-6)  # the plain CE's sum and count
    for k in whole:
        torch.testing.assert_close(grads[k], whole[k], rtol=1e-4, atol=1e-7)
    # what the loop did before: each micro-batch's own mean, divided by the accumulation steps
    means = sum(LOSSES[loss].fn(*_logits(model, b), **_columns(b, loss, normalize)) for b in split(rows(), 4))
    assert abs(means.item() / 4 - whole_loss.item()) > 1e-3  # (the test would see that bug)


def _logits(model, b):
    with torch.no_grad():
        return model(b["input_ids"])[:, :-1], b["input_ids"][:, 1:], b["mask"][:, 1:]


def _columns(b, loss, normalize):
    kw = {c: b[c][:, 1:] for c in LOSSES[loss].columns}
    return {**kw, "normalize": normalize} if loss == "weighted_ce" else kw


def _rank(rank: int, world: int, init: str, accumulate: int, loss: str, normalize: str, out: str):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = torch.nn.parallel.DistributedDataParallel(_model())
        micro = split(rows(), accumulate, rank, world)
        step_loss, ce, grads = gradients(model, micro, loss, normalize, world)
        shares = [torch.zeros(()) for _ in range(world)]
        torch.distributed.all_gather(shares, step_loss)
        torch.save({"loss": sum(shares), "grads": grads}, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("loss,normalize", CASES[:2])
def test_two_ddp_processes_give_one_batchs_loss_and_gradients(loss, normalize, tmp_path):
    """Two gloo processes, each with two micro-batches of unequal real-token counts: the ranks' shares
    sum to the whole batch's loss and DDP's averaged gradients are the whole batch's."""
    whole_loss, _, whole = gradients(_model(), split(rows(), 1), loss, normalize)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank, args=(2, init, 2, loss, normalize, str(tmp_path / "got")), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"got.{rank}", weights_only=True)
        assert got["loss"].item() == pytest.approx(whole_loss.item(), rel=1e-5)
        for k in whole:
            torch.testing.assert_close(got["grads"][k], whole[k], rtol=1e-4, atol=1e-7)


def test_a_run_with_accumulation_logs_one_batchs_loss(weighted_dir, tmp_path):
    """The loop end to end: --batch-size 2 --grad-accum 2 reads the rows of --batch-size 4 (the reader's
    order does not depend on the batch size) and logs the same first-step loss and plain CE."""
    batches = iter(WeightedTokens(str(weighted_dir), batch_size=2, seed=3, shuffle_buffer=64))
    counts = {int(next(batches)["mask"][:, 1:].sum()) for _ in range(2)}
    assert len(counts) == 2  # the step's two micro-batches hold unequal real-token counts

    def first_row(out, **kw):
        base = dict(data=str(weighted_dir), out=str(out), model_config=TINY, steps=1, lr=3e-3, quiet=True)
        train(TrainConfig(**base, loss="weighted_ce", seed=3, shuffle_buffer=64, **kw))
        return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])

    whole = first_row(tmp_path / "one", batch_size=4)
    accumulated = first_row(tmp_path / "two", batch_size=2, grad_accum=2)
    assert accumulated["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert accumulated["ce"] == pytest.approx(whole["ce"], rel=1e-5)
    assert accumulated["loss"] != pytest.approx(accumulated["ce"], rel=1e-3)  # weighted beside plain
