"""Train on entroweight's weighted parquet with a plain torch loop (any causal LM works).

    python examples/weighted_torch_loop.py WEIGHTED_DIR --steps 100

The reader yields batches of input_ids, mask (False on pads) and weight (float32 in [0, 1]);
value i belongs to token i, so shift by one against next-token logits. Resume: save
`ds.state_dict()` with your checkpoint and `load_state_dict` it before iterating again.
"""

from __future__ import annotations

import argparse

import torch

from entroweight.data import WeightedTokens, weighted_ce
from entroweight.models.llama import Llama


def main(data: str, steps: int = 100, batch_size: int = 16, lr: float = 3e-3, state: dict | None = None):
    ds = WeightedTokens(data, batch_size=batch_size, epochs=None, seed=0, require=("weight",))
    if state:
        ds.load_state_dict(state)
    torch.manual_seed(0)
    vocab, n_ctx = ds.info.vocab_size, ds.info.n_ctx
    model = Llama(Llama.Config(vocab_size=vocab, n_ctx=n_ctx, d_model=64, n_layers=2, n_heads=2, d_ff=192))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _, batch in zip(range(steps), ds, strict=False):
        ids = batch["input_ids"]
        logits = model(ids)[:, :-1]
        # Σ w_i·CE_i over real tokens / their count; pads have mask False (and weight 0)
        loss = weighted_ce(logits, ids[:, 1:], batch["mask"][:, 1:], batch["weight"][:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses, ds.state_dict()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    _, losses, _ = main(args.data, args.steps)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
