"""Train a Hugging Face model on entroweight's weighted parquet with `transformers.Trainer`.

    python examples/weighted_hf_trainer.py WEIGHTED_DIR --steps 100 [--grad-accum 2] [--normalize weight]

The library's `WeightedTrainer` (entroweight/trainers/hf.py) is a stock Trainer whose loss is our
trainer's weighted CE, normalised over the whole accumulated batch across processes (the real
targets' count, or their Σ w with `normalize="weight"`), and whose log rows hold the plain `ce`
beside the weighted `loss`. `WeightedExamples` reads our output (a directory or a URL) as
`input_ids`, `labels` (−100 on pads) and float32 `weight`. Under torchrun every process reads the
same stream and accelerate hands each its share of the batches.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from entroweight.trainers.hf import WeightedCollator, WeightedExamples, WeightedTrainer


def main(
    data: str,
    out_dir: str,
    steps: int = 100,
    batch_size: int = 16,
    lr: float = 3e-3,
    grad_accum: int = 1,
    normalize: str = "tokens",
):
    ds = WeightedExamples(data, seed=0)  # one sequence per example, shuffled, looping
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
        gradient_accumulation_steps=grad_accum,
        learning_rate=lr,
        remove_unused_columns=False,  # keep `weight` for the loss
        save_strategy="no",
        report_to=[],
        logging_steps=max(1, steps // 5),
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )
    trainer = WeightedTrainer(
        model=model,
        args=args,
        train_dataset=ds,
        data_collator=WeightedCollator(ds.pad_id),
        normalize=normalize,
    )
    result = trainer.train()
    return trainer, result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--out", default="runs/hf_weighted")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--normalize", choices=["tokens", "weight"], default="tokens")
    args = ap.parse_args()
    trainer, result = main(
        args.data, args.out, args.steps, grad_accum=args.grad_accum, normalize=args.normalize
    )
    last = [r for r in trainer.state.log_history if "ce" in r][-1]
    print(f"weighted loss {last['loss']:.3f}, plain CE {last['ce']:.3f} (the model's quality)")
