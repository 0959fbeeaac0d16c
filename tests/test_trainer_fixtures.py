"""Shared helpers of the trainer tests: weighted parquet built from `tokenized_dir`, a tiny model.

Imported by test_trainer*.py, test_reader.py, test_export.py (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from entroweight.schemas import METADATA_KEY

TINY = {"d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 192}


def make_weighted(
    src: Path, dst: Path, weight_dtype: str = "float16", seed: int = 0, files=None, edit=None
) -> Path:
    """Copy token parquet adding random `entropy` (nats) and `weight` (0 on pads), keeping the metadata.

    `edit(table, ids, weight, entropy)` may change the arrays before writing (for refusal tests).
    """
    dst.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for f in sorted(Path(src).glob("*.parquet"))[: files or None]:
        t = pq.read_table(f)
        meta = dict(pq.read_schema(f).metadata)
        # the random entropy is in nats (what `--loss rescaled` requires of the file metadata)
        meta[METADATA_KEY] = json.dumps({**json.loads(meta[METADATA_KEY]), "unit": "nats"}).encode()
        ids = np.array(t.column("input_ids").to_pylist())
        w = rng.random(ids.shape).astype(np.float32)
        w[ids == 0] = 0.0
        e = (rng.random(ids.shape) * 6).astype(np.float32)
        if edit:
            ids, w, e = edit(ids, w, e)
        if weight_dtype == "uint8":
            wcol = pa.array([np.round(r * 255).astype(np.uint8) for r in w], pa.list_(pa.uint8()))
        else:
            wcol = pa.array([r.astype(np.float16) for r in w], pa.list_(pa.float16()))
        t = t.append_column("entropy", pa.array(list(e), pa.list_(pa.float32()))).append_column(
            "weight", wcol
        )
        pq.write_table(t.replace_schema_metadata(meta), dst / f.name)
    return dst


@pytest.fixture(scope="session")
def weighted_dir(tokenized_dir, tmp_path_factory) -> Path:
    return make_weighted(tokenized_dir, tmp_path_factory.mktemp("weighted16"))


@pytest.fixture(scope="session")
def tiny_ckpt(weighted_dir, tokenizer_dir, tmp_path_factory) -> Path:
    """A tiny llama trained 30 steps with weighted_ce (tokenizer stored): for BPB and export tests."""
    import torch

    from entroweight.trainers import TrainConfig, train

    out = tmp_path_factory.mktemp("tiny_ckpt")
    before = torch.get_num_threads()  # session fixtures run before the module's one_thread
    torch.set_num_threads(1)
    train(
        TrainConfig(
            data=str(weighted_dir),
            out=str(out),
            model_config=TINY,
            loss="weighted_ce",
            tokenizer=str(tokenizer_dir),
            steps=30,
            batch_size=8,
            lr=3e-3,
            overwrite=True,
            quiet=True,
        )
    )
    torch.set_num_threads(before)
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core box: one intra-op thread is ~10× faster than two under load
    (OpenMP threads spin waiting for each other). Restored after the module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
