"""Hugging Face `transformers.Trainer` on entroweight's weighted data, computing our trainer's loss.

    from entroweight.trainers.hf import WeightedExamples, WeightedCollator, WeightedTrainer
    ds = WeightedExamples("weighted/")  # a directory, files or a URL; or its `export-data --format hf`
    trainer = WeightedTrainer(model=model, args=args, train_dataset=ds,
                              data_collator=WeightedCollator(ds.pad_id), normalize="tokens")

- `WeightedExamples` yields `input_ids`, `labels` (the token, or −100 where no loss is taken: the
  pads) and `weight` (float32 in [0, 1], decoded by schemas/weighted.py through our reader): value i
  of `weight` weighs the loss of predicting token i, as `labels[i]` is its target.
- `weighted_lm_loss` is `weighted_ce` (trainers/losses.py) over a causal LM's logits and labels,
  divided by the Trainer's `num_items_in_batch` where it passes one: our trainer's loss.
- `WeightedTrainer` is a stock Trainer with that loss as its `compute_loss_func` (the Trainer then
  treats the loss as normalised over the whole accumulated batch: no division by the accumulation
  steps), fed each micro-batch's weights. `num_items_in_batch` is then our normaliser, counted by
  `WeightedTrainer.get_batch_samples` over the accumulation window and every process
  (`average_tokens_across_devices`, on by default): the targets that take a loss for
  `normalize="tokens"`, their Σ w for "weight". (The Trainer's own count skips each row's first
  label only for a model whose `loss_type` it knows shifts them; our loss always does.) So a step of
  micro-batches of unequal real-token counts, on one process or several, gives the loss and
  gradients of one batch of its rows. Each logged row has the plain `ce` beside the weighted `loss`.

Under several processes each reads the same stream (the reader's own rank sharding is off) and
accelerate hands each its share of the batches, with or without `dispatch_batches`.
"""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset
from transformers import Trainer

from .data import WeightedTokens
from .losses import floor, per_token_ce, weight_normaliser, weighted_ce

IGNORE = -100  # the label of a position that takes no loss (transformers' and torch's ignore_index)


class WeightedExamples(IterableDataset):
    """One example per row of our weighted output (`paths`: what `WeightedTokens` reads, local or a
    URL, an `export-data --format hf` output among them: its rows left-padded back to n_ctx, the
    examples of the data it was exported from): `input_ids` int64, `labels` (−100 on pads), `weight`
    float32. Seeded shuffle, `epochs=None` loops (each epoch reshuffled): the same rows in the same
    order as our trainer's reader with the same seed and shuffle buffer on one process."""

    def __init__(self, paths, seed: int = 0, shuffle: bool = True, shuffle_buffer: int = 4096, epochs=None):
        super().__init__()
        # the whole stream on every process: accelerate shards or dispatches the Trainer's batches
        self.reader = WeightedTokens(
            paths,
            shuffle=shuffle,
            shuffle_buffer=shuffle_buffer,
            seed=seed,
            epochs=epochs,
            rank=0,
            world_size=1,
            columns=("weight",),
            require=("weight",),
        )
        self.info = self.reader.info
        self.pad_id = max(self.reader.pad_id, 0)

    def __iter__(self):
        for row in self.reader:
            ids = row["input_ids"]
            yield {"input_ids": ids, "labels": ids.masked_fill(~row["mask"], IGNORE), "weight": row["weight"]}


class WeightedCollator:
    """Stacks examples into a batch, left-padding rows of other lengths (as our data is laid out: the
    pad `pad_id`, label −100, weight 0). `attention_mask=True` adds the mask of real tokens (a model
    that skips the pads, as our `mask_pads`); off, the model attends to the pads as our trainer's
    default llama does, so the losses compare."""

    def __init__(self, pad_id: int = 0, attention_mask: bool = False):
        self.pad_id, self.attention_mask = pad_id, attention_mask

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(e["input_ids"]) for e in examples)

        def stack(key, fill, dtype):
            rows = []
            for e in examples:
                v = torch.as_tensor(e[key], dtype=dtype)
                rows.append(torch.cat([torch.full((width - len(v),), fill, dtype=dtype), v]))
            return torch.stack(rows)

        batch = {
            "input_ids": stack("input_ids", self.pad_id, torch.int64),
            "labels": stack("labels", IGNORE, torch.int64),
            "weight": stack("weight", 0.0, torch.float32),
        }
        if self.attention_mask:
            batch["attention_mask"] = (batch["labels"] != IGNORE).long()
        return batch


def weighted_lm_loss(logits, labels, weight, num_items_in_batch=None, normalize: str = "tokens"):
    """Our trainer's `weighted_ce` over a causal LM's `logits` (B, T, V) and `labels` (B, T): logits
    at i predict labels[i+1], weighted by weight[i+1]; divided by `num_items_in_batch` (the
    normaliser of the whole accumulated batch: the label count for "tokens", Σ w for "weight") or,
    without it, by this batch's own."""
    targets = labels[:, 1:]
    mask = targets != IGNORE
    denominator = None if num_items_in_batch is None else floor(torch.as_tensor(num_items_in_batch).float())
    return weighted_ce(
        logits[:, :-1],
        targets.clamp(min=0),  # −100 is no index: its CE is taken, then weighed 0
        mask,
        weight[:, 1:].to(logits.device),
        normalize,
        denominator=None if denominator is None else denominator.to(logits.device),
    )


def normaliser(batch: dict, normalize: str) -> torch.Tensor:
    """What `weighted_lm_loss` divides a batch's sum by: its targets (labels[:, 1:]) that take a loss,
    counted ("tokens") or their Σ w ("weight")."""
    return weight_normaliser(batch["labels"][:, 1:] != IGNORE, batch["weight"][:, 1:], normalize)


class WeightedTrainer(Trainer):
    """A `transformers.Trainer` that trains with our weighted CE (`normalize`: "tokens" or "weight"),
    normalised over the whole accumulated batch across processes, and logs the plain `ce` beside it.
    Give it `WeightedExamples` (or any examples with `labels` and `weight`) and `WeightedCollator`."""

    def __init__(self, *args, normalize: str = "tokens", **kwargs):
        if normalize not in ("tokens", "weight"):
            raise ValueError(f"normalize must be 'tokens' or 'weight', not {normalize!r}")
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("WeightedTrainer computes the weighted loss itself: give no compute_loss_func")
        kwargs.setdefault("data_collator", WeightedCollator())
        super().__init__(*args, **kwargs)
        if self.args.remove_unused_columns:  # it would drop `weight` (no argument of the model's forward)
            raise ValueError(
                "WeightedTrainer needs TrainingArguments(remove_unused_columns=False): keep `weight`"
            )
        self.normalize = normalize
        self.compute_loss_func = self._loss  # the Trainer then counts num_items_in_batch for it
        self._weight = None
        self._ce = torch.zeros(2, dtype=torch.float64)  # the plain CE's (sum, count) since the last log

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batches:  # our normaliser of the window, in place of the Trainer's label count
            count = sum(normaliser(b, self.normalize) for b in batches).to(device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                count = self.accelerator.gather(count).sum()
        return batches, count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        self._weight = inputs.pop("weight")
        if not model.training:  # evaluation: each batch its own normaliser (the Trainer averages them)
            num_items_in_batch = None
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._weight = None

    def _loss(self, outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"]
        if self.model.training:
            with torch.no_grad():
                targets = labels[:, 1:]
                mask = targets != IGNORE
                ce = (per_token_ce(logits[:, :-1], targets.clamp(min=0)) * mask).sum()
                self._ce += torch.stack([ce.double().cpu(), mask.sum().double().cpu()])
        return weighted_lm_loss(logits, labels, self._weight, num_items_in_batch, self.normalize)

    def log(self, logs: dict, *args, **kwargs) -> None:
        """A training row gains `ce`, the plain CE over every real target since the last row (every
        process's): the model's quality beside the weighted loss, which is not."""
        if "loss" in logs:  # (on every process: the Trainer logs its loss on each)
            sums = self._ce.to(self.args.device)
            if self.args.world_size > 1:
                sums = self.accelerator.gather(sums.reshape(1, 2)).sum(0)
            if sums[1] > 0:
                logs = {**logs, "ce": float(sums[0] / sums[1])}
            self._ce.zero_()
        super().log(logs, *args, **kwargs)
