"""Train a Hugging Face model on entroweight's weighted parquet with `transformers.Trainer`.

    python examples/weighted_hf_trainer.py WEIGHTED_DIR --steps 100

The only change to a stock Trainer is `compute_loss`: per-token CE times the token's weight,
summed over real tokens and divided by their count. Under torchrun, keep the reader's rank
sharding and turn off accelerate's batch dispatching (`accelerator_config={"dispatch_batches": False}`),
or give the reader rank=0, world_size=1 and let accelerate dispatch.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from entroweight.data import WeightedTokens, per_token_ce


class WeightedTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids, mask, weight = inputs["input_ids"], inputs["mask"], inputs["weight"]
        out = model(input_ids=ids)
        ce = per_token_ce(out.logits[:, :-1], ids[:, 1:])  # nats per target token, fp32
        real = mask[:, 1:]
        loss = (ce * weight[:, 1:] * real).sum() / real.sum().clamp(min=1)
        return (loss, out) if return_outputs else loss


def main(data: str, out_dir: str, steps: int = 100, batch_size: int = 16, lr: float = 3e-3):
    ds = WeightedTokens(data, epochs=None, seed=0, require=("weight",))  # one sequence per item
    config = LlamaConfig(
        vocab_size=ds.info.vocab_size,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=ds.info.n_ctx,
        pad_token_id=ds.info.pad_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=lr,
        remove_unused_columns=False,  # keep weight and mask for compute_loss
        save_strategy="no",
        report_to=[],
        logging_steps=max(1, steps // 5),
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )
    trainer = WeightedTrainer(model=model, args=args, train_dataset=ds)
    result = trainer.train()
    return trainer, result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--out", default="runs/hf_weighted")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    _, result = main(args.data, args.out, args.steps)
    print(f"training loss {result.training_loss:.3f}")
