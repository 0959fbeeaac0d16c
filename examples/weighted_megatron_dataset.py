"""Weighted cross-entropy from a Megatron export, through megatron-core's own dataset machinery.

    entroweight export-data SCORED --format megatron --out mcore/
    python examples/weighted_megatron_dataset.py mcore/ --steps 100

`WeightedGPTDataset` is Megatron's GPTDataset with the per-token weights in `loss_mask`, so
Megatron's loss, Σ loss·loss_mask / Σ loss_mask, is weighted cross-entropy (normalised by the
weight sum). In Megatron-LM itself, build it where pretrain_gpt.py builds GPTDataset:

    BlendedMegatronDatasetBuilder(WeightedGPTDataset, sizes, is_dataset_built_on_rank, config).build()

with `--data-path mcore/text_document`. Here a tiny model trains on CPU with the same loss formula.
Needs megatron-core: pip install 'entroweight[megatron]'.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

from entroweight.data import per_token_ce
from entroweight.models.llama import Llama
from entroweight.schemas.exports import MEGATRON_PREFIX
from entroweight.trainers.megatron import WeightedGPTDataset


class ExportTokenizer(MegatronLegacyTokenizer):
    """What GPTDataset asks of a tokenizer: vocabulary size, eod and pad ids (text is already ids)."""

    def __init__(self, vocab_size: int, eod: int, pad: int):
        super().__init__()
        self._ids = (vocab_size, eod, pad)

    def tokenize(self, text):
        raise NotImplementedError("the export is already tokenized")

    vocab = property(lambda self: {})
    inv_vocab = property(lambda self: {})
    vocab_size = property(lambda self: self._ids[0])
    eod = property(lambda self: self._ids[1])
    pad = property(lambda self: self._ids[2])


def build(export_dir: str, seq_length: int, seed: int = 0) -> WeightedGPTDataset:
    meta = json.loads((Path(export_dir) / "export.json").read_text())["metadata"]  # written by export-data
    eos = meta["eos_id"] if meta.get("eos_id") is not None else meta["pad_id"]
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([str(Path(export_dir) / MEGATRON_PREFIX)], None),
        split="1,0,0",
        tokenizer=ExportTokenizer(meta["vocab_size"], eos, meta["pad_id"]),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        WeightedGPTDataset, [None, None, None], lambda: True, config
    ).build()
    return train


def main(export_dir: str, steps: int = 100, batch_size: int = 16, seq_length: int = 64, lr: float = 3e-3):
    ds = build(export_dir, seq_length)
    meta = json.loads((Path(export_dir) / "export.json").read_text())["metadata"]
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False)
    torch.manual_seed(0)
    cfg = Llama.Config(
        vocab_size=meta["vocab_size"], n_ctx=seq_length, d_model=64, n_layers=2, n_heads=2, d_ff=192
    )
    model = Llama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    for _, batch in zip(range(steps), batches, strict=False):
        ce = per_token_ce(model(batch["tokens"]), batch["labels"])
        mask = batch["loss_mask"]
        loss = (ce * mask).sum() / mask.sum().clamp(min=1e-8)  # Megatron's loss with weights as mask
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("export_dir")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    _, losses = main(args.export_dir, args.steps)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
