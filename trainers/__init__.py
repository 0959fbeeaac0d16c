"""Training: weighted-CE losses, the streaming parquet reader, the loop, checkpoints, BPB, HF export.

Imports models and schemas only (never transforms): what it needs of a tokenizer it reads from the
tokenizer.json with the `tokenizers` library itself.

The config and the loss registry load without torch (the CLI builds its options from them at
start-up); the rest loads on first use.
"""

import importlib

from .config import LossSettings, TrainConfig, TrainError, TrainSettings
from .losses import LOSSES, compute_loss, per_token_ce

_LAZY = {
    "DataError": ".data",
    "WeightedTokens": ".data",
    "inspect_data": ".data",
    "TrainFailed": ".loop",
    "TrainResult": ".loop",
    "train": ".loop",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name], __name__)
    return getattr(module, name)


__all__ = [
    "LOSSES",
    "DataError",
    "LossSettings",
    "TrainConfig",
    "TrainError",
    "TrainFailed",
    "TrainResult",
    "TrainSettings",
    "WeightedTokens",
    "compute_loss",
    "inspect_data",
    "per_token_ce",
    "train",
]
