"""Megatron-LM / NeMo: a GPTDataset whose `loss_mask` carries entroweight's per-token weights.

Megatron's GPT loss is Σ loss·loss_mask / Σ loss_mask, so with the weights in `loss_mask` its
trainer computes weighted cross-entropy (normalised by the weight sum) with no change. Use it
wherever GPTDataset is named, e.g.

    BlendedMegatronDatasetBuilder(WeightedGPTDataset, sizes, is_built_on_rank, config).build()

with `blend` naming the export's `OUT/text_document`; the weights are read from the sidecar
`OUT/text_document_weight` written beside it by `entroweight export-data --format megatron`.
Needs megatron-core: pip install 'entroweight[megatron]'.
"""

from __future__ import annotations

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset

from entroweight.schemas.exports import megatron_weight_prefix
from entroweight.schemas.weighted import decode_weights


class WeightedGPTDataset(GPTDataset):
    """GPTDataset plus the weight sidecar: `loss_mask[j]` = Megatron's mask × the weight of `labels[j]`."""

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config):
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        prefix = megatron_weight_prefix(dataset_path or indexed_dataset.path_prefix)
        self.weights = IndexedDataset(prefix, mmap=config.mmap_bin_files)
        if not (
            np.array_equal(self.weights.sequence_lengths, indexed_dataset.sequence_lengths)
            and np.array_equal(self.weights.document_indices, indexed_dataset.document_indices)
        ):
            raise ValueError(f"{prefix} does not align with {indexed_dataset.path_prefix} (other documents)")

    def __getitem__(self, idx):
        sample = super().__getitem__(idx)  # Megatron's mask: 0 on pads (and eod when asked)
        sample["loss_mask"] = sample["loss_mask"] * self.sample_weights(0 if idx is None else idx)
        return sample

    def sample_weights(self, idx: int) -> torch.Tensor:
        """The weights of sample `idx`'s labels: the same document walk as GPTDataset's tokens."""
        extra = self.config.add_extra_token_to_sequence
        i = self.shuffle_index[idx]
        beg, beg_offset = self.sample_index[i]
        end, end_offset = self.sample_index[i + 1]
        parts = []
        for d in range(beg, end + 1):
            offset = beg_offset if d == beg else 0
            length = end_offset - offset + extra if d == end else None
            parts.append(
                self.weights.get(
                    self.document_index[d], offset=int(offset), length=None if length is None else int(length)
                )
            )
        w = np.zeros(self.config.sequence_length + extra, dtype=np.float32)
        flat = decode_weights(np.concatenate(parts))  # the stored form (uint8 or float) -> w
        w[: len(flat)] = flat
        # label j is token j + 1: its weight is the weight of that token (the last label is a pad
        # without the extra token: 0)
        return torch.from_numpy(w[1:] if extra else np.r_[w[1:], np.float32(0)])
