# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""entroweight.data.WeightedTokens: values, sharding, shuffling, exact resume, refusals, and the two
documented downstream examples (plain torch loop, Hugging Face Trainer)."""

from __future__ import annotations

import base64
import collections
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_trainer_fixtures import make_weighted, one_thread, weighted_dir  # noqa: F401 - fixtures
from test_weighted_inputs import model, scored, tokens  # noqa: F401 - fixtures

from entroweight.data import DataError, WeightedTokens
from entroweight.schemas import METADATA_KEY

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def rows_of(ds) -> list[tuple]:
    out = []
    for item in ds:
        ids = item["input_ids"]
        out += [tuple(r.tolist()) for r in (ids if ids.dim() == 2 else ids[None])]
    return out


def test_values_match_the_file_and_pads_are_masked(weighted_dir):
    f = sorted(weighted_dir.glob("*.parquet"))[0]
    t = pq.read_table(f)
    want = {
        tuple(i): np.array(w, dtype=np.float32)
        for i, w in zip(t["input_ids"].to_pylist(), t["weight"].to_pylist(), strict=True)
    }
    ds = WeightedTokens(f, shuffle=False)
    n = 0
    for item in ds:
        assert set(item) == {"input_ids", "mask", "weight", "entropy"}
        assert item["input_ids"].dtype == torch.int64 and item["weight"].dtype == torch.float32
        ids = tuple(item["input_ids"].tolist())
        np.testing.assert_array_equal(item["weight"].numpy(), want[ids])
        assert torch.equal(item["mask"], item["input_ids"] != 0)  # pad id 0
        assert (item["weight"][~item["mask"]] == 0).all()
        n += 1
    assert n == t.num_rows


def test_uint8_weights_read_as_w_over_255(tokenized_dir, tmp_path):
    d16 = make_weighted(tokenized_dir, tmp_path / "f16", "float16", files=1)
    d8 = make_weighted(tokenized_dir, tmp_path / "u8", "uint8", files=1)
    raw = np.array(pq.read_table(sorted(d8.glob("*.parquet"))[0])["weight"].to_pylist()[0], dtype=np.float32)
    a = next(iter(WeightedTokens(d8, shuffle=False)))
    b = next(iter(WeightedTokens(d16, shuffle=False)))
    np.testing.assert_allclose(a["weight"].numpy(), raw / 255.0, rtol=1e-6)
    np.testing.assert_allclose(a["weight"].numpy(), b["weight"].numpy(), atol=1 / 255)


def test_ranks_split_the_data_disjointly_and_completely(weighted_dir):
    everything = collections.Counter(rows_of(WeightedTokens(weighted_dir, shuffle=False)))
    parts = [
        collections.Counter(rows_of(WeightedTokens(weighted_dir, rank=r, world_size=3, seed=1)))
        for r in range(3)
    ]
    assert sum(parts, collections.Counter()) == everything
    assert all(sum(p.values()) > 200 for p in parts)


def test_a_world_size_without_a_rank_is_refused_outside_torchrun(weighted_dir, monkeypatch):
    """world_size=2 alone read rank 0's share in every process: half the rows lost, half read twice.
    Refused unless the environment says the rank (torchrun sets RANK)."""
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="world_size 2 without rank"):
        WeightedTokens(weighted_dir, world_size=2)
    monkeypatch.setenv("RANK", "1")
    assert WeightedTokens(weighted_dir, world_size=2).rank == 1


def test_dataloader_workers_split_a_rank_and_resume_exactly(weighted_dir):
    def loader(start):
        ds = WeightedTokens(weighted_dir, batch_size=4, epochs=None, seed=3, start=start, shuffle_buffer=64)
        return iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))

    it = loader(0)
    first = [next(it)["input_ids"] for _ in range(7)]
    again = loader(5)
    for want in first[5:]:
        assert torch.equal(next(again)["input_ids"], want)
    # one epoch through 2 workers covers the data once
    ds = WeightedTokens(weighted_dir, epochs=1, seed=3)
    got = collections.Counter(rows_of(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)))
    assert got == collections.Counter(rows_of(WeightedTokens(weighted_dir, shuffle=False)))


def test_shuffle_is_seeded_and_changes_each_epoch(weighted_dir):
    def first(seed, epochs=1, n=300):
        ds = WeightedTokens(weighted_dir, seed=seed, epochs=epochs, shuffle_buffer=128)
        return [r for r, _ in zip(rows_of(ds), range(n), strict=False)]

    assert first(0) == first(0)
    assert first(0) != first(1)
    two = rows_of(WeightedTokens(weighted_dir, seed=0, epochs=2, shuffle_buffer=128))
    half = len(two) // 2
    assert collections.Counter(two[:half]) == collections.Counter(two[half:]) and two[:half] != two[half:]


def test_resume_position_in_process(weighted_dir):
    ds = WeightedTokens(weighted_dir, batch_size=8, epochs=None, seed=2, shuffle_buffer=100)
    it = iter(ds)
    for _ in range(40):  # past an epoch (1000 rows / 8 = 125 batches? no: past several blocks)
        next(it)
    state = ds.state_dict()
    want = [next(it)["input_ids"] for _ in range(3)]
    ds2 = WeightedTokens(weighted_dir, batch_size=8, epochs=None, seed=2, shuffle_buffer=100)
    ds2.load_state_dict(state)
    it2 = iter(ds2)
    for w in want:
        assert torch.equal(next(it2)["input_ids"], w)
    with pytest.raises(DataError, match="same number of processes"):
        WeightedTokens(weighted_dir, rank=0, world_size=2, seed=2).load_state_dict(state)


@pytest.mark.parametrize(
    "workers, loader_batch, before",
    [
        (2, None, 7),  # the reader makes the batches; an odd count: the workers' turn mid-cycle
        (2, 4, 5),  # the loader collates the reader's rows: each worker's place counts rows
        (2, None, 131),  # past each worker's first epoch (~63 batches each)
        (0, None, 7),
    ],
    ids=lambda v: str(v),
)
def test_stateful_dataloader_resumes_exactly_under_workers(weighted_dir, workers, loader_batch, before):
    """A plain DataLoader's workers iterate copies of the reader, so its state_dict counted nothing;
    torchdata's StatefulDataLoader saves each worker's own place (its stream, items made) and gives
    it back to that worker: a resumed loader yields exactly the batches a never-stopped one would."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        ds = WeightedTokens(
            weighted_dir, batch_size=None if loader_batch else 4, epochs=None, seed=3, shuffle_buffer=64
        )
        return StatefulDataLoader(ds, batch_size=loader_batch, num_workers=workers)

    after = 6
    it = iter(loader())
    never_stopped = [next(it)["input_ids"] for _ in range(before + after)]
    del it
    first = loader()
    it = iter(first)
    for _ in range(before):
        next(it)
    state = first.state_dict()
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    got = [b["input_ids"] for _, b in zip(range(after), resumed, strict=False)]
    assert len(got) == after
    for want, batch in zip(never_stopped[before:], got, strict=True):
        assert torch.equal(batch, want)


def test_the_reader_does_not_import_torchdata():
    """torchdata is the user's choice (the dev extra only): the reader works without it."""
    import subprocess

    code = "import sys, entroweight.data; sys.exit('torchdata' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_worker_place_is_refused_outside_its_worker_and_under_other_workers(weighted_dir):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader(workers, **kw):
        ds = WeightedTokens(weighted_dir, batch_size=4, epochs=None, seed=3, **kw)
        return StatefulDataLoader(ds, batch_size=None, num_workers=workers)

    first = loader(2)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    del it
    worker_state = next(iter(state["_snapshot"]["_worker_snapshots"].values()))["dataset_state"]
    assert {"workers": 2, "consumed": 2}.items() <= worker_state.items()
    with pytest.raises(DataError, match="a DataLoader worker's: give the loader's state_dict to"):
        WeightedTokens(weighted_dir, batch_size=4, seed=3).load_state_dict(worker_state)
    wider = loader(3)
    wider.load_state_dict(state)
    with pytest.raises(DataError, match="for 2 DataLoader workers, not 3; resume with the same num_workers"):
        next(iter(wider))
    other = loader(2, shuffle_buffer=64)
    other.load_state_dict(state)
    with pytest.raises(
        DataError, match="for shuffle_buffer 4096, not 64; resume with the same shuffle_buffer"
    ):
        next(iter(other))


# -- refusals, each with a message that says what to do


def test_refuses_wrong_tokenizer_and_vocab(weighted_dir):
    with pytest.raises(DataError, match="re-tokenize") as e:
        WeightedTokens(weighted_dir, tokenizer_sha256="0" * 64)
    # a reader that trains nothing (eval-bpb's unigram, eval-quant) gives no training advice; train
    # words its own (tests/test_bad_input.py)
    assert "--resume" not in str(e.value) and "train" not in str(e.value), e.value
    with pytest.raises(DataError, match="vocabulary has 1024 tokens but the model's has 2048"):
        WeightedTokens(weighted_dir, vocab_size=2048)


def test_refuses_missing_columns(tokenized_dir):
    with pytest.raises(DataError, match="no 'weight' column.*score it first"):
        WeightedTokens(tokenized_dir, require=("weight",))
    ds = WeightedTokens(tokenized_dir, shuffle=False)  # token-only data still reads, without weights
    assert set(next(iter(ds))) == {"input_ids", "mask"}


def _rewrite(src: Path, dst: Path, weight_rows) -> Path:
    dst.mkdir()
    f = sorted(src.glob("*.parquet"))[0]
    t = pq.read_table(f)
    i = t.schema.get_field_index("weight")
    t = t.set_column(i, "weight", pa.array(weight_rows(t), pa.list_(pa.float16())))
    pq.write_table(t.replace_schema_metadata(pq.read_schema(f).metadata), dst / f.name)
    return dst


@pytest.mark.parametrize(
    "case,match",
    [
        ("short", "differ in length from input_ids"),
        ("nan", r"\[0, 1\] \(found NaN\)"),
        ("big", r"\[0, 1\] \(found 0\.\.1\.5\)"),
    ],
)
def test_refuses_bad_weights(weighted_dir, tmp_path, case, match):
    def rows(t):
        out = [np.array(w, dtype=np.float16) for w in t["weight"].to_pylist()]
        if case == "short":
            out[3] = out[3][:-1]
        elif case == "nan":
            out[3][5] = np.nan
        else:
            out[3][5] = 1.5
        return out

    d = _rewrite(weighted_dir, tmp_path / case, rows)
    with pytest.raises(DataError, match=match):
        list(WeightedTokens(d, shuffle=False))


# -- the documented examples


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_example_plain_torch_loop(weighted_dir):
    ex = _example("weighted_torch_loop")
    _, losses, state = ex.main(str(weighted_dir), steps=12, batch_size=8)
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    assert state["position"] == 12


def test_example_hf_trainer_compute_loss(weighted_dir, tmp_path):
    from entroweight.trainers.hf import WeightedCollator, WeightedExamples

    ex = _example("weighted_hf_trainer")
    trainer, result = ex.main(str(weighted_dir), str(tmp_path / "hf"), steps=4, batch_size=4, grad_accum=2)
    assert result.global_step == 4 and np.isfinite(result.training_loss)
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert rows and all(r["ce"] > r["loss"] for r in rows)  # the plain CE logged beside the weighted loss
    # compute_loss applies the weights: zero weights give zero loss, doubled weights double it
    examples = iter(WeightedExamples(weighted_dir, shuffle=False))
    batch = WeightedCollator()([next(examples) for _ in range(4)])
    model = trainer.model.eval()
    with torch.no_grad():
        base = trainer.compute_loss(model, dict(batch)).item()
        zero = trainer.compute_loss(model, {**batch, "weight": batch["weight"] * 0}).item()
        double = trainer.compute_loss(model, {**batch, "weight": batch["weight"] * 2}).item()
    assert zero == 0.0 and double == pytest.approx(2 * base, rel=1e-5) and base > 0


@pytest.mark.parametrize(
    "kw",
    [
        {"batch_size": 0},  # was: one batch of every row (a real dataset: all of it in memory)
        {"batch_size": -3},
        {"batch_size": 2.5},
        {"batch_size": True},
        {"epochs": 0},  # was: nothing, silently
        {"start": -1},
        {"shuffle_buffer": -5},  # was: taken as 1, silently
        {"seed": "x"},  # was: numpy's "unrecognized seed string"
        {"seed": -1},
    ],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()),
)
def test_the_reader_refuses_counts_that_are_not_counts(weighted_dir, kw):
    with pytest.raises(ValueError, match=f"{next(iter(kw))} must be an integer"):
        WeightedTokens(weighted_dir, **kw)
    assert next(iter(WeightedTokens(weighted_dir, batch_size=np.int64(4))))["input_ids"].shape[0] == 4


@pytest.mark.parametrize("columns", ["weight", ("weights",), ("weight", "entrpy")])
def test_the_reader_refuses_columns_it_cannot_give(weighted_dir, columns):
    """A string (read letter by letter) or a misspelled name gave items without weights: a weighted
    trainer trained unweighted, no error."""
    with pytest.raises(ValueError, match="columns is a list of weight, entropy"):
        WeightedTokens(weighted_dir, columns=columns)
    assert "weight" in next(iter(WeightedTokens(weighted_dir, columns=["weight"])))


def test_a_saved_position_is_refused_under_another_seed(weighted_dir):
    ds = WeightedTokens(weighted_dir, batch_size=2, seed=1)
    with pytest.raises(DataError, match="for seed 0, not 1"):
        ds.load_state_dict(WeightedTokens(weighted_dir, batch_size=2).state_dict())


def test_a_saved_position_is_refused_on_other_data(weighted_dir):
    """The position counts items of a plan dealt from the files' row groups: on other files it
    resumed somewhere else, no error."""
    one = sorted(weighted_dir.glob("*.parquet"))[0]
    with pytest.raises(DataError, match="resume on the same data"):
        WeightedTokens(one, batch_size=2).load_state_dict(
            WeightedTokens(weighted_dir, batch_size=2).state_dict()
        )
    with pytest.raises(DataError, match="for batch_size 2, not 4"):
        WeightedTokens(weighted_dir, batch_size=4).load_state_dict(
            WeightedTokens(weighted_dir, batch_size=2).state_dict()
        )


def test_data_rewritten_while_it_is_read_is_refused(scored, tmp_path):  # noqa: F811
    """A stage rewriting the directory while a reader iterates it (`weigh --overwrite`) gave rows of two
    weightings and no error: each file is checked against what the reader planned as it is opened."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(scored, data)  # a stage's output: its parts have manifests to check against
    ds = WeightedTokens(data, batch_size=4, shuffle=False)
    it = iter(ds)
    next(it)
    for f in sorted(data.glob("part-*.parquet"))[1:]:  # the same rows, written otherwise
        pq.write_table(pq.read_table(f), f, compression="none")
    with pytest.raises(DataError, match="changed since the reader planned it"):
        for _ in it:
            pass


def _another_config_same_size(f: Path) -> None:
    """Rewrite a stage's shard as one of another configuration with the very same bytes but its config
    hash, in both places its footer holds it (the key-value metadata and the Arrow schema's copy)."""
    raw = f.read_bytes()
    meta = pq.read_metadata(f).metadata
    old = json.loads(meta[METADATA_KEY])["config_hash"].encode()
    new = old[::-1] if old[::-1] != old else b"0" * len(old)
    arrow = meta[b"ARROW:schema"]  # base64: a same-length edit keeps its length
    patched = base64.b64encode(base64.b64decode(arrow).replace(old, new))
    f.write_bytes(raw.replace(arrow, patched).replace(old, new))
    assert f.stat().st_size == len(raw)
    assert pq.ParquetFile(f).schema_arrow.metadata[METADATA_KEY] != meta[METADATA_KEY]


def test_a_same_size_rewrite_under_another_config_is_refused(scored, tmp_path):  # noqa: F811
    """The size alone let a rewrite of exactly the same size through (`weigh --overwrite` with
    another config): the footer's config hash must be the one the planned manifest records."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(scored, data)
    ds = WeightedTokens(data, batch_size=4, shuffle=False)
    it = iter(ds)
    next(it)
    for f in sorted(data.glob("part-*.parquet"))[1:]:
        _another_config_same_size(f)
    with pytest.raises(
        DataError, match=r"changed since the reader planned it \(.*config hash.*start the reader again"
    ):
        for _ in it:
            pass


def test_another_tools_file_rewritten_with_other_row_groups_is_refused(weighted_dir, tmp_path):
    """A file no stage wrote has no manifest to check against: its row groups are the ones planned
    (the reader would otherwise read row group i of another layout)."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(weighted_dir, data)
    ds = WeightedTokens(data, batch_size=4, shuffle=False)
    it = iter(ds)
    next(it)
    for f in sorted(data.glob("*.parquet"))[1:]:
        pq.write_table(pq.read_table(f), f, row_group_size=50)
    with pytest.raises(DataError, match=r"changed since the reader planned it \(rows per row group \[50, "):
        for _ in it:
            pass
