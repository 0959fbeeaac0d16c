"""The public reader of entroweight's (weighted) token parquet, for your own trainer.

    from entroweight.data import WeightedTokens
    ds = WeightedTokens("weighted/", batch_size=32, epochs=None)   # rank-sharded under torchrun
    for batch in ds:   # input_ids (B, T) int64, mask, weight (B, T) float32 in [0, 1], entropy
        ...

See docs/trainer.md and examples/ for a plain torch loop and the Hugging Face Trainer.
"""

from entroweight.trainers.data import DataError, WeightedTokens, inspect_data, parquet_files
from entroweight.trainers.losses import per_token_ce, weighted_ce

__all__ = ["DataError", "WeightedTokens", "inspect_data", "parquet_files", "per_token_ce", "weighted_ce"]
