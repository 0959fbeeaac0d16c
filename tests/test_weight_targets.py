# ruff: noqa: F811 - pytest fixtures imported from other test modules
"""One contract for what a weight means, held over every target (docs/export.md): on one fixed batch
of our weighted data, the loss each target computes with the weights as its own library reads them
back equals our trainer's loss, to floating-point tolerance. A new target is one entry in TARGETS.

The model is a bigram table (logits from the current token alone), so a target that lays the same
tokens out otherwise (without pads, or Megatron's documents joined into samples) predicts each
target token from the same evidence and the losses compare exactly.

The batch is left-padded rows of unequal real lengths (documents cut short) and one whole row: the
exports hold each row's real tokens only, and a collator that pads to the batch's widest row lays
them out again as our data does (the first real token of a padded row is a target, predicted from a
pad, in ours and in each of them). Megatron joins documents without pads: its own treatment below."""

from __future__ import annotations

import gzip
import json
import shutil
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import C4
from test_export_data import expected, export, score
from test_score_stage import tiny_llama  # noqa: F401 - fixture
from test_trainer_fixtures import one_thread  # noqa: F401 - fixture

from entroweight.pipelines import run_stage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.schemas.weighted import decode_weights
from entroweight.trainers import LOSSES, DataError, WeightedTokens
from entroweight.trainers.hf import IGNORE, WeightedCollator, WeightedExamples, weighted_lm_loss

pytestmark = pytest.mark.filterwarnings("ignore:Transformer Engine:UserWarning")
# the fixed batch: rows of the scored data, in file order (`scored`: row 0 whole, the others padded)
PICK = [0, 2, 3, 5, 7, 8, 10, 11]
CUTS = [None, *range(6, 61, 5)]  # each document's first characters (None: all, past n_ctx)


@pytest.fixture(scope="module")
def scored(tmp_path_factory, tokenizer_dir, tiny_llama):  # noqa: F811
    """12 C4 documents cut to CUTS, one left-padded row each (n_ctx 64), scored by the tiny llama."""
    src = tmp_path_factory.mktemp("src_cut") / "c4.jsonl.gz"
    with gzip.open(C4, "rt", encoding="utf-8") as f, gzip.open(src, "wt", encoding="utf-8") as out:
        for cut in CUTS:
            doc = json.loads(next(f))
            out.write(json.dumps({**doc, "text": doc["text"][:cut]}) + "\n")
    tokens = tmp_path_factory.mktemp("tokens_cut")
    stage = TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=64, overflow="truncate")
    run_stage(stage, tokens, progress=False)
    return score(tokens, tiny_llama, tmp_path_factory.mktemp("scored_cut"))


class Bigram(torch.nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, ids):
        return self.table(ids)


def ours(scored, tmp_path, model, normalize):
    """Our trainer's loss (LOSSES["weighted_ce"] as trainers/loop.py calls it) on the batch."""
    b = _picked(WeightedTokens(str(scored), shuffle=False))
    ids = b["input_ids"]
    fn = LOSSES["weighted_ce"].fn
    return fn(model(ids)[:, :-1], ids[:, 1:], b["mask"][:, 1:], b["weight"][:, 1:], normalize=normalize)


def hf_trainer(scored, tmp_path, model, normalize):
    """The loss WeightedTrainer computes (trainers/hf.py), on WeightedExamples through its collator."""
    ds = WeightedExamples(str(scored), shuffle=False, epochs=1)
    batch = WeightedCollator(ds.pad_id)(_picked(ds, stack=False))
    return weighted_lm_loss(model(batch["input_ids"]), batch["labels"], batch["weight"], normalize=normalize)


def _rows_loss(rows, pad_id, model, normalize):
    """Rows of real tokens and their weights (an export read back) as a Hugging Face batch: labels
    the tokens, weights as read (float16 or uint8 decoded), left-padded as our data is laid out."""
    examples = [
        {
            "input_ids": torch.as_tensor(np.asarray(ids, dtype=np.int64)),
            "labels": torch.as_tensor(np.asarray(ids, dtype=np.int64)),
            "weight": torch.as_tensor(decode_weights(np.asarray(w))),
        }
        for ids, w in rows
    ]
    batch = WeightedCollator(pad_id)(examples)
    return weighted_lm_loss(model(batch["input_ids"]), batch["labels"], batch["weight"], normalize=normalize)


def hf_export(scored, tmp_path, model, normalize):
    """`export-data --format hf` read back by WeightedExamples through its collator, as in hf_trainer."""
    assert export(scored, tmp_path / "hub", "hf").exit_code == 0
    return hf_trainer(tmp_path / "hub", tmp_path, model, normalize)


def hub(scored, tmp_path, model, normalize):
    """`export-data --format hf` read back by `datasets.load_dataset`."""
    import datasets

    assert export(scored, tmp_path / "hub", "hf").exit_code == 0
    ds = datasets.load_dataset(str(tmp_path / "hub"), split="train")
    rows = [(r["input_ids"], r["weight"]) for r in ds.select(PICK)]
    return _rows_loss(rows, _pad(scored), model, normalize)


def litdata(scored, tmp_path, model, normalize):
    """`export-data --format litdata` read back by LitData's StreamingDataset."""
    from litdata import StreamingDataset

    assert export(scored, tmp_path / "lit", "litdata").exit_code == 0
    ds = StreamingDataset(str(tmp_path / "lit"))
    return _rows_loss([(ds[i]["input_ids"], ds[i]["weight"]) for i in PICK], _pad(scored), model, normalize)


def megatron(scored, tmp_path, model, normalize):
    """`export-data --format megatron` read by WeightedGPTDataset: Megatron's loss, Σ CE·loss_mask /
    Σ loss_mask, over one epoch of samples. Its normaliser is Σ loss_mask = Σ w: ours with
    `normalize="weight"` (our "tokens" is not reached through loss_mask alone: None). Ours is then
    taken over the same stream, since Megatron joins the documents and drops the tail that fills no
    sample: our trainer's loss on the samples' tokens with the weights our parquet holds for them."""
    if normalize != "weight":
        return None
    from test_export_data import example

    out = tmp_path / "m"
    assert export(scored, out, "megatron").exit_code == 0
    ds = example("weighted_megatron_dataset").build(str(out), seq_length=48)
    numerator = denominator = 0.0
    for j in range(len(ds)):
        s = ds[j]
        ce = torch.nn.functional.cross_entropy(
            model(s["tokens"].long()), s["labels"].long(), reduction="none"
        )
        numerator, denominator = numerator + (ce * s["loss_mask"]).sum(), denominator + s["loss_mask"].sum()
    return numerator / denominator


def _picked(rows, stack=True):
    """The PICK rows of a reader's rows (one per item, in file order), stacked into a batch."""
    chosen = [r for i, r in zip(range(max(PICK) + 1), rows, strict=False) if i in PICK]
    return {k: torch.stack([r[k] for r in chosen]) for k in chosen[0]} if stack else chosen


def _pad(scored) -> int:
    return max(WeightedTokens(str(scored)).pad_id, 0)


TARGETS = [ours, hf_trainer, hf_export, hub, litdata, megatron]


def _megatron_ours(scored, tmp_path, model):
    """Our weighted_ce(normalize="weight") over the very tokens Megatron's samples hold (its shuffled
    documents joined: a document's first token follows the last of another, not a pad), with the
    weights our parquet holds for them: the samples of an export whose tokens are their positions
    in the documents (Megatron walks it alike: the same lengths) say which tokens those are."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from test_export_data import example, expected

    _, docs = expected(scored)
    flat_ids = np.concatenate([d[1] for d in docs]).astype(np.int64)
    flat_w = np.concatenate([d[2] for d in docs]).astype(np.float32)  # ours, from the parquet
    pos = tmp_path / "positions"
    pos.mkdir()
    shutil.copy(tmp_path / "m" / "export.json", pos)
    tokens = IndexedDatasetBuilder(str(pos / "text_document.bin"), dtype=np.int32)
    weights = IndexedDatasetBuilder(str(pos / "text_document_weight.bin"), dtype=np.float32)
    start = 0
    for _, ids, _ in docs:
        tokens.add_document(np.arange(start, start + len(ids)), [len(ids)])
        weights.add_document(np.zeros(len(ids), np.float32), [len(ids)])
        start += len(ids)
    tokens.finalize(str(pos / "text_document.idx"))
    weights.finalize(str(pos / "text_document_weight.idx"))
    ds = example("weighted_megatron_dataset").build(str(pos), seq_length=48)
    p_tok = np.stack([ds[j]["tokens"].numpy() for j in range(len(ds))])
    p_lab = np.stack([ds[j]["labels"].numpy() for j in range(len(ds))])
    ids, targets = torch.as_tensor(flat_ids[p_tok]), torch.as_tensor(flat_ids[p_lab])
    fn = LOSSES["weighted_ce"].fn
    mask = torch.ones_like(targets, dtype=torch.bool)
    return fn(model(ids), targets, mask, torch.as_tensor(flat_w[p_lab]), normalize="weight")


@pytest.mark.parametrize("normalize", ["tokens", "weight"])
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.__name__)
def test_every_target_computes_our_trainers_loss(scored, tmp_path, target, normalize):
    model = Bigram(WeightedTokens(str(scored)).info.vocab_size)
    with torch.no_grad():
        got = target(scored, tmp_path, model, normalize)
        if got is None:
            pytest.skip(
                f"{target.__name__} has no {normalize} normalisation (docs/export.md: how to get ours)"
            )
        want = (
            _megatron_ours(scored, tmp_path, model)
            if target is megatron
            else ours(scored, tmp_path, model, normalize)
        )
    assert got.item() == pytest.approx(want.item(), rel=1e-5)


def test_the_batch_holds_fractional_weights_and_the_normalisations_differ(scored):
    """What makes the property bite: left-padded rows of unequal real lengths beside a whole one, the
    normalisations differ, and fractional weights that an integer cast would lose."""
    b = _picked(WeightedTokens(str(scored), shuffle=False))
    lengths = b["mask"].sum(1).tolist()
    assert lengths[0] == b["mask"].shape[1] and len(set(lengths)) == len(PICK), lengths
    w = b["weight"][b["mask"]]
    assert ((w > 0) & (w < 1)).any()
    model = Bigram(WeightedTokens(str(scored)).info.vocab_size)
    with torch.no_grad():
        assert (
            abs(ours(scored, None, model, "tokens").item() - ours(scored, None, model, "weight").item())
            > 1e-3
        )


def _targets(batch) -> Counter:
    """Each target a collated batch takes a loss on: (its row's real tokens, its place among them,
    the token, its weight)."""
    found = Counter()
    for ids, labels, weight in zip(batch["input_ids"], batch["labels"], batch["weight"], strict=True):
        real = labels != IGNORE
        row, first = tuple(ids[real].tolist()), int(real.nonzero()[0])
        for j in (real[1:].nonzero()[:, 0] + 1).tolist():
            found[row, j - first, int(labels[j]), float(weight[j])] += 1
    return found


@pytest.mark.parametrize("named", ["export", "data directory", "file"])
def test_an_hf_export_reads_as_the_weighted_data_it_holds(scored, tmp_path, named):
    """WeightedExamples on `export-data --format hf`'s output (the directory, its data/ or a file in it:
    rows of real tokens, no pads) yields the examples of the weighted data itself, left-padded to
    n_ctx: every real token a target with its weight as our parquet holds it (the first of a padded
    row too, which a reader padding on the right loses), and the same loss for both normalisations."""
    out = tmp_path / "hub"
    assert export(scored, out, "hf").exit_code == 0
    given = {"export": out, "data directory": out / "data", "file": next((out / "data").glob("*.parquet"))}
    ours = list(WeightedExamples(str(scored), seed=1, epochs=1))
    theirs = list(WeightedExamples(str(given[named]), seed=1, epochs=1))

    def key(e):
        return tuple(tuple(e[k].tolist()) for k in ("input_ids", "labels", "weight"))

    assert sorted(map(key, theirs)) == sorted(map(key, ours))
    # the targets, from the parquet: each real token of a row but the first of a whole one
    rows, _ = expected(scored)
    n_ctx = WeightedTokens(str(scored)).info.n_ctx
    want = Counter(
        (tuple(ids.tolist()), k, int(ids[k]), float(w))
        for _, ids, stored in rows
        for k, w in enumerate(decode_weights(stored))
        if k or len(ids) < n_ctx
    )
    assert sum(len(ids) < n_ctx for _, ids, _ in rows) >= 10  # padded rows, each a target at stake
    batch, reference = WeightedCollator()(theirs), WeightedCollator()(ours)
    assert _targets(batch) == _targets(reference) == want
    model = Bigram(WeightedTokens(str(scored)).info.vocab_size)
    with torch.no_grad():
        for normalize in ("tokens", "weight"):
            got = weighted_lm_loss(
                model(batch["input_ids"]), batch["labels"], batch["weight"], normalize=normalize
            )
            loss = weighted_lm_loss(
                model(reference["input_ids"]), reference["labels"], reference["weight"], normalize=normalize
            )
            assert got.item() == pytest.approx(loss.item(), rel=1e-6)


REFUSED = {
    "megatron": ("--format megatron", "or its --format hf export"),
    "edited record": ("export.json is not the record export-data sealed", "--overwrite"),
    "edited file": ("a row is longer than its export's n_ctx 64", "export it again"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_an_export_it_cannot_read_as_ours_is_refused_naming_what_to_give(scored, tmp_path, case):
    out = tmp_path / "export"
    assert export(scored, out, "megatron" if case == "megatron" else "hf").exit_code == 0
    if case == "edited record":  # its n_ctx, pad id and tokenizer can no longer be trusted
        record = json.loads((out / "export.json").read_text())
        (out / "export.json").write_text(
            json.dumps({**record, "metadata": {**record["metadata"], "n_ctx": 256}})
        )
    if case == "edited file":  # a row past n_ctx: no left padding makes it one of ours
        f = next((out / "data").glob("*.parquet"))
        rows = pq.read_table(f).to_pylist()
        rows[0] = {**rows[0], "input_ids": rows[0]["input_ids"] * 2, "weight": rows[0]["weight"] * 2}
        pq.write_table(pa.Table.from_pylist(rows, pq.read_schema(f)), f)
    with pytest.raises(DataError) as e:
        list(WeightedExamples(str(out), epochs=1))
    said = str(e.value)
    assert "\n" not in said and all(part in said for part in REFUSED[case])
    assert case != "megatron" or f"exported from ({scored})" in said


@pytest.mark.parametrize("beside", ["the data", "another export of it"])
def test_an_hf_export_beside_the_data_it_holds_is_refused_as_its_documents_twice(scored, tmp_path, beside):
    """An export's files have no manifests: the shards of the data it was exported from stand for
    them, so it and that data (or a second export of it) given together are its documents twice,
    refused as a stage's outputs of one shard are."""
    hub = tmp_path / "hub"
    assert export(scored, hub, "hf").exit_code == 0
    other = scored
    if beside == "another export of it":
        other = tmp_path / "hub2"
        assert export(scored, other, "hf").exit_code == 0
    with pytest.raises(DataError) as e:
        WeightedExamples([str(other), str(hub)], epochs=1)
    assert "hold the same documents" in str(e.value) and "\n" not in str(e.value)
    assert len(list(WeightedExamples(str(hub), epochs=1, shuffle=False))) == len(CUTS)  # alone: read
