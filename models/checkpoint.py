"""Checkpoints on disk: `model.safetensors` + `config.json` (kind, model config, data provenance).

Only safetensors are read: a pickle cannot run code here. Training state (optimizer, data position)
is the trainer's business and lives beside these files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import build_model

WEIGHTS, CONFIG = "model.safetensors", "config.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says what to do."""


def save_checkpoint(model: torch.nn.Module, kind: str, out_dir: str | Path, **meta) -> Path:
    """Write weights and config; `meta` holds e.g. tokenizer_sha256, vocab_size, n_ctx, step."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # tied weights share storage: safetensors wants each tensor once, contiguous
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    seen, unique = {}, {}
    for k, v in state.items():
        ptr = v.data_ptr() if v.numel() else id(v)
        if ptr in seen:
            continue
        seen[ptr] = k
        unique[k] = v
    tmp = out / (WEIGHTS + ".tmp")
    save_file(unique, str(tmp))
    tmp.replace(out / WEIGHTS)
    config = {"kind": kind, "model": dataclasses.asdict(model.config), **meta}
    config["weights_sha256"] = sha256_file(out / WEIGHTS)
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def read_checkpoint_config(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / CONFIG
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not an entroweight checkpoint (no {CONFIG}); train one with `entroweight train`"
        )
    return json.loads(path.read_text())


def load_checkpoint(ckpt_dir: str | Path, map_location: str = "cpu", verify: bool = True):
    """(model in eval mode, config dict). Refuses weights whose sha256 differs from the recorded one."""
    ckpt = Path(ckpt_dir)
    config = read_checkpoint_config(ckpt)
    weights = ckpt / WEIGHTS
    if not weights.is_file():
        pickles = [p.name for p in ckpt.glob("*.pt")] + [p.name for p in ckpt.glob("*.bin")]
        hint = f" (found {', '.join(pickles)}: pickle files are not loaded)" if pickles else ""
        raise CheckpointError(f"{ckpt} has no {WEIGHTS}{hint}")
    if verify and config.get("weights_sha256") and sha256_file(weights) != config["weights_sha256"]:
        raise CheckpointError(
            f"{weights} does not match the sha256 recorded in {CONFIG}: the file changed or is corrupt; "
            "re-copy the checkpoint or retrain it"
        )
    model = build_model(config["kind"], config["model"])
    state = load_file(str(weights), device=map_location)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # tied weights were saved once; anything else missing is an error
    missing = [k for k in missing if not _is_tied(model, k)]
    if missing or unexpected:
        raise CheckpointError(
            f"{weights} does not fit a {config['kind']} model: missing {missing}, unexpected {unexpected}"
        )
    return model.to(map_location).eval(), config


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(key)
    return target is not None and any(p is target and k != key for k, p in params.items())
