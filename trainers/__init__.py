"""Training: weighted-CE losses, the streaming parquet reader, the loop, checkpoints, BPB, HF export.

Imports models and schemas only (never transforms): what it needs of a tokenizer it reads from the
tokenizer.json with the `tokenizers` library itself.
"""

from .data import DataError, WeightedTokens, inspect_data
from .losses import LOSSES, compute_loss, per_token_ce
from .train import TrainConfig, TrainError, TrainFailed, TrainResult, train

__all__ = [
    "LOSSES",
    "DataError",
    "TrainConfig",
    "TrainError",
    "TrainFailed",
    "TrainResult",
    "WeightedTokens",
    "compute_loss",
    "inspect_data",
    "per_token_ce",
    "train",
]
