"""Names inside `export-data` outputs that the writer and the readers (trainers/megatron.py) share."""

from __future__ import annotations

# Megatron-LM's preprocess_data.py names its output `<prefix>_text_document.{bin,idx}`.
MEGATRON_PREFIX = "text_document"
EXPORT_RECORD = "export.json"  # provenance and counts, in every export but the hub layout's card
#: the hub layout's data files: its card's `data_files`, what `datasets` reads and our reader reads
HF_DATA_FILES = "data/train-*"


def hf_data_file(i: int, n: int) -> str:
    """The hub layout's `i`th data file of `n` (one per weighted shard), matched by HF_DATA_FILES."""
    return f"data/train-{i:05d}-of-{n:05d}.parquet"


def megatron_weight_prefix(tokens_prefix: str) -> str:
    """The sidecar indexed dataset of per-token weights beside a token indexed dataset."""
    return f"{tokens_prefix}_weight"
