"""Training checkpoints: the model checkpoint (models/checkpoint.py) plus optimizer state and data position.

Layout of a checkpoint directory:
  model.safetensors, config.json   weights + kind/model config/provenance (loadable alone)
  optimizer.safetensors            AdamW moments, tensors only (no pickle)
  trainer_state.json               step, data position, param groups, sha256 of both weight files
  tokenizer.json                   the run's tokenizer (--tokenizer, or the copy its data carries):
                                   eval-bpb and export-hf read it, no --tokenizer needed
  metrics.jsonl                    one JSON line per logged step

A save writes everything into `.staging/` first and moves trainer_state.json into place last, so a
run killed mid-save leaves either the previous state or a mismatch that resume detects by sha256.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from entroweight.models.checkpoint import WEIGHTS, CheckpointError, plain_mode, save_checkpoint, sha256_file
from entroweight.schemas.tokenizer import TOKENIZER_FILE

STATE, OPTIM, METRICS = "trainer_state.json", "optimizer.safetensors", "metrics.jsonl"
# the sha256 that trainer_state.json records of each file a save wrote beside it
SHA256_KEYS = {WEIGHTS: "weights_sha256", OPTIM: "optimizer_sha256"}
TOKENIZER = TOKENIZER_FILE  # found by schemas.tokenizer.resolve_tokenizer_path, as every tokenizer is


def is_the_file_saved(ckpt: Path, name: str, state: dict) -> bool:
    """Whether `ckpt/name` is there with the sha256 its `state` (trainer_state.json) records."""
    path = Path(ckpt) / name
    return path.is_file() and sha256_file(path) == state.get(SHA256_KEYS[name])


def save_training_checkpoint(out, model, kind: str, optimizer, state: dict, meta: dict) -> None:
    out = Path(out)
    staging = out / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        save_checkpoint(model, kind, staging, **meta)
        tensors, groups = _flatten_optimizer(optimizer.state_dict())
        save_file(tensors, str(staging / OPTIM))
        plain_mode(staging / OPTIM)
        weights = (staging / WEIGHTS).stat()  # kept by the rename: the file as saved, told without
        # hashing it (a workflow's rerun asks whether its finished checkpoint was touched since)
        state = {
            **state,
            "param_groups": groups,
            "weights_sha256": sha256_file(staging / WEIGHTS),
            "optimizer_sha256": sha256_file(staging / OPTIM),
            "weights_bytes": weights.st_size,
            "weights_mtime_ns": weights.st_mtime_ns,
        }
        (staging / STATE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        for name in (WEIGHTS, "config.json", OPTIM, STATE):  # state last: it commits the save
            os.replace(staging / name, out / name)
    finally:  # a failed save (disk full) leaves no partial files behind
        shutil.rmtree(staging, ignore_errors=True)


def load_training_state(ckpt) -> tuple[dict, dict]:
    """(trainer state, optimizer state dict) of a checkpoint; refuses a half-written one."""
    ckpt = Path(ckpt)
    path = ckpt / STATE
    if not path.is_file():
        raise CheckpointError(f"{ckpt} has no {STATE}: nothing to resume; drop --resume to start a new run")
    state = json.loads(path.read_text())
    for name in SHA256_KEYS:
        if not is_the_file_saved(ckpt, name, state):
            raise CheckpointError(
                f"{ckpt / name} does not match {STATE} (a save was interrupted or the files were edited); "
                "restore the checkpoint directory from a copy or start a new run"
            )
    tensors = load_file(str(ckpt / OPTIM))
    return state, _unflatten_optimizer(tensors, state["param_groups"])


def _flatten_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], list]:
    tensors = {}
    for idx, per_param in sd["state"].items():
        for k, v in per_param.items():
            t = v if torch.is_tensor(v) else torch.tensor(v)
            tensors[f"{idx}.{k}"] = t.detach().contiguous().cpu()
    return tensors, sd["param_groups"]


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list) -> dict:
    state: dict[int, dict] = {}
    for key, t in tensors.items():
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = t
    return {"state": state, "param_groups": groups}
