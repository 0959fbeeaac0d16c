"""Weighted cross-entropy over a LitData export, in a plain torch loop (any causal LM works).

    entroweight export-data SCORED --format litdata --out chunks/
    python examples/weighted_litdata_loop.py chunks/ --steps 100

LitData's own StreamingDataset streams the chunks (from a local directory, or from object storage:
pass an s3:// URL); each sample is one row: `doc_id`, `input_ids` (real tokens) and `weight`, value
i belonging to token i. The collate right-pads a batch; pads get mask False and weight 0.
Needs LitData: pip install 'entroweight[litdata]'.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from litdata import StreamingDataLoader, StreamingDataset

from entroweight.data import weighted_ce
from entroweight.models.llama import Llama
from entroweight.schemas.weighted import decode_weights


def collate(samples: list[dict], pad_id: int) -> dict:
    n = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), n), pad_id, dtype=torch.long)
    weight = torch.zeros((len(samples), n), dtype=torch.float32)
    mask = torch.zeros((len(samples), n), dtype=torch.bool)
    for row, s in enumerate(samples):
        k = len(s["input_ids"])
        ids[row, :k] = torch.from_numpy(s["input_ids"].astype("int64"))
        weight[row, :k] = torch.from_numpy(decode_weights(s["weight"]))  # uint8 or float16 -> w
        mask[row, :k] = True
    return {"input_ids": ids, "weight": weight, "mask": mask}


def main(data: str, steps: int = 100, batch_size: int = 16, lr: float = 3e-3):
    meta = json.loads((Path(data) / "export.json").read_text())["metadata"]  # written by export-data
    ds = StreamingDataset(data, shuffle=True, seed=0)
    loader = StreamingDataLoader(ds, batch_size=batch_size, collate_fn=lambda b: collate(b, meta["pad_id"]))
    torch.manual_seed(0)
    cfg = Llama.Config(
        vocab_size=meta["vocab_size"], n_ctx=meta["n_ctx"], d_model=64, n_layers=2, n_heads=2, d_ff=192
    )
    model = Llama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
    for _, batch in zip(range(steps), batches, strict=False):
        ids = batch["input_ids"]
        logits = model(ids)[:, :-1]
        # Σ w_i·CE_i over real tokens / their count; shifted by one: value i belongs to token i
        loss = weighted_ce(logits, ids[:, 1:], batch["mask"][:, 1:], batch["weight"][:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    _, losses = main(args.data, args.steps)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
