"""Token-budget batches over the whole shard (`score --batch-tokens`): every scorer that runs a model
over rows gives the values of the per-row path (one row per forward) to 1e-5 relative in fp32, on
real C4 rows of mixed lengths (cross_tokenizer: one window of model tokens per forward); the plan
keeps its budget; the stage reports the pad fraction."""

from __future__ import annotations

import gzip
import itertools
import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from entroweight.models.checkpoint import save_checkpoint
from entroweight.models.estimator import EntropyEstimator
from entroweight.models.llama import Llama
from entroweight.pipelines import run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.stage import read_manifests
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.schemas import read_file_metadata
from entroweight.scorers import Batching, make_scorer
from entroweight.scorers.base import BATCH_COST, Later, Scored, plan_batches, score_rows
from entroweight.scorers.forward import HostCopy
from entroweight.scorers.packing import pack_rows
from entroweight.transforms.tokenizer import load_tokenizer
from entroweight.workflows.cli.main import main

N_CTX = 32
VOCAB = 1024
PAD = 0
BUDGET = 100  # tokens per forward: 3 full rows, more short ones


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def data(tmp_path_factory, c4_path, tokenizer_dir):
    """16 C4 documents, n_ctx 32, left-padded, one shard; every other one cut short (mixed lengths)."""
    src = tmp_path_factory.mktemp("src") / "c4.jsonl.gz"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        docs = [json.loads(next(f)) for _ in range(16)]
    with gzip.open(src, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            if i % 2 == 0:
                d["text"] = " ".join(d["text"].split()[: 2 + i])
            f.write(json.dumps(d) + "\n")
    out = tmp_path_factory.mktemp("tokens")
    run_stage(
        TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX, shard_docs=16, overflow="truncate"),
        out,
        progress=False,
    )
    return out


@pytest.fixture(scope="module")
def rows(data):
    t = pq.read_table(next(data.glob("part-*.parquet")))
    ids = np.stack(t.column("input_ids").to_numpy(zero_copy_only=False)).astype(np.int64)
    n_pad = t.column("n_pad").to_numpy().astype(np.int64)
    assert len(set(n_pad.tolist())) > 4 and (n_pad == 0).any()  # mixed lengths, some full rows
    return ids, n_pad


@pytest.fixture(scope="module")
def sha(data):
    return read_file_metadata(next(data.glob("part-*.parquet")))["tokenizer_sha256"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, sha, tokenizer_dir):
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)

    def estimator(n_ctx):
        cfg = EntropyEstimator.Config(
            vocab_size=VOCAB, n_ctx=n_ctx, injection="token", encoder="mixer", decoder="llama",
            encoder_config={"d_model": 32, "n_layers": 1},
            decoder_config={"d_model": 32, "n_layers": 2, "n_heads": 2},
            embed_dim=8, noise="none", init_std=0.2,
        )  # fmt: skip
        return EntropyEstimator(cfg).eval()

    def save(model, name, kind):
        n_ctx = model.config.n_ctx
        return str(save_checkpoint(model, kind, root / name, tokenizer_sha256=sha, n_ctx=n_ctx, pad_id=PAD))

    llama = Llama(Llama.Config(vocab_size=VOCAB, n_ctx=N_CTX, d_model=32, n_layers=2, n_heads=2, d_ff=64))
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    hf_dir = root / "hf"
    LlamaForCausalLM(hf_cfg).save_pretrained(hf_dir)
    shutil.copy(tokenizer_dir / "tokenizer.json", hf_dir / "tokenizer.json")
    return {
        "est": save(estimator(N_CTX), "est", "estimator"),
        "short": save(estimator(N_CTX - 1), "short", "estimator"),
        "llama": save(llama.eval(), "llama", "llama"),
        "hf": str(hf_dir),
    }


# every scorer that runs a model over the data's rows (cross_tokenizer reads text: its own test below)
CASES = {
    "causal_loss_hf": ("causal_loss", lambda c: {"model": c["hf"]}),
    "causal_loss_ours": ("causal_loss", lambda c: {"checkpoint": c["llama"]}),
    "occlusion_l1": ("occlusion", lambda c: {"checkpoint": c["est"]}),
    "occlusion_cosine": ("occlusion", lambda c: {"checkpoint": c["est"], "metric": "cosine"}),
    "decomposition": ("decomposition", lambda c: {"checkpoint": c["est"]}),
    "two_model": ("two_model", lambda c: {"checkpoint": c["est"], "checkpoint_short": c["short"]}),
    "grad_input": ("grad_input", lambda c: {"checkpoint": c["est"]}),
    "excess_loss": ("excess_loss", lambda c: {"checkpoint": c["llama"], "reference": c["hf"]}),
}


def make(case, checkpoints, **kw):
    name, options = CASES[case]
    s = make_scorer(name, dtype="fp32", **options(checkpoints), **kw)
    s.setup()
    return s


@pytest.mark.parametrize("case", list(CASES))
def test_token_budget_equals_the_per_row_path(case, checkpoints, rows):
    ids, n_pad = rows
    if case == "grad_input":  # one backward per position: a few rows of each kind suffice
        ids, n_pad = ids[:6], n_pad[:6]
    per_row = make(case, checkpoints, batch_size=1)
    want = np.concatenate([per_row.score(ids[i : i + 1], n_pad[i : i + 1]).values for i in range(len(ids))])
    s = make(case, checkpoints)
    scored = s.score(ids, n_pad, Batching(batch_tokens=BUDGET))
    got = scored.values
    assert np.abs(want).max() > 0
    # min-max normalised scorers: values in [0, 1] per row, so 1e-5 of the row's range (the batch's
    # float rounding, ~1e-7 of a raw value, is divided by a row's max − min); excess_loss: a difference
    # of two CEs of a few nats each, so it carries both CEs' rounding (seen: 1.9e-6 on a value of 0.09)
    # decomposition/two_model: a difference of two sums of ~n_ctx CEs (hundreds of nats), whose rounding
    # moves with the windows' sub-batches (seen: 3.8e-6 on a value of 0.058, 2e-8 of the sums)
    loose = ("grad_input", "occlusion_l1", "excess_loss", "decomposition", "two_model")
    atol = 1e-5 if case in loose else 1e-6
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)
    computed, real = scored.computed, scored.real
    assert real == int((N_CTX - n_pad).sum()) * (2 if case == "excess_loss" else 1)
    assert computed >= real


@pytest.mark.parametrize("case", ["causal_loss_hf", "causal_loss_ours", "occlusion_l1", "decomposition"])
def test_a_budget_below_the_row_width_changes_no_value(case, checkpoints, rows):
    """--batch-tokens under the data's width (packed rows: one sequence as wide as a row a forward;
    cut rows: one row): speed and memory, never values."""
    ids, n_pad = rows
    want = make(case, checkpoints).score(ids, n_pad, Batching(batch_tokens=BUDGET)).values
    got = make(case, checkpoints).score(ids, n_pad, Batching(batch_tokens=N_CTX // 3)).values
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def per_window_losses(scorer, texts_ids: list[np.ndarray]) -> list[np.ndarray]:
    """cross_tokenizer's per-row path: each window of model tokens alone in its forward (no padding,
    no mask), CE from the model's full logits."""
    out = []
    for ids in texts_ids:
        losses = np.zeros(len(ids))
        for c, a, e in scorer.windows(len(ids)):
            seq = [scorer._start] + ids[c:e].tolist()
            with torch.no_grad():
                logits = scorer._model(input_ids=torch.tensor([seq])).logits[0, :-1]
            ce = F.cross_entropy(logits.float(), torch.tensor(seq[1:]), reduction="none").numpy()
            losses[a:e] = ce[len(ce) - (e - a) :]
        out.append(losses)
    return out


@pytest.mark.parametrize("aggregate", ["sum", "mean"])
def test_cross_tokenizer_token_budget_equals_the_per_window_path(aggregate, checkpoints, rows, tokenizer_dir):
    """Windows of model tokens sorted by length into token-budget forwards, left-padded to each
    batch's longest: the values of one unpadded window per forward, to 1e-5 relative in fp32."""
    ids, n_pad = rows
    s = make_scorer("cross_tokenizer", model=checkpoints["hf"], dtype="fp32", aggregate=aggregate, context=16)
    s.setup(load_tokenizer(tokenizer_dir))
    assert s._start is not None and s.context == 16 and s.stride == 8  # long rows take several windows
    batched = s._model_losses
    s._model_losses = lambda texts_ids, batching: (per_window_losses(s, texts_ids), 0, 0)
    want = s.score(ids, n_pad).values
    s._model_losses = batched
    scored = s.score(ids, n_pad, Batching(batch_tokens=BUDGET))
    got = scored.values
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    computed, real = scored.computed, scored.real
    assert computed >= real > 0  # fill only where windows of several lengths share a forward
    assert s.dtype == "fp32" and next(s._model.parameters()).dtype == torch.float32


def test_cross_tokenizer_loads_its_weights_in_the_compute_dtype(checkpoints, tokenizer_dir):
    """bf16 weights, not fp32 ones re-cast by autocast on every forward."""
    s = make_scorer("cross_tokenizer", model=checkpoints["hf"], dtype="bf16")
    s.setup(load_tokenizer(tokenizer_dir))
    assert {p.dtype for p in s._model.parameters()} == {torch.bfloat16}


def test_plan_keeps_the_budget_and_covers_every_row_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 513, size=3000)
    plan = plan_batches(lengths, lambda n: max(n, 1), 16, 4096)
    order = np.concatenate([idx for idx, _ in plan])
    assert sorted(order.tolist()) == np.flatnonzero(lengths).tolist()  # a row of pads alone: no batch
    assert (np.diff(lengths[order]) <= 0).all()  # longest first: each batch as wide as its first row
    for idx, width in plan:
        assert width == max(int(lengths[idx].max()), 1)
        assert len(idx) * width <= 4096 or len(idx) == 1
    # cut padding: the positions computed are within a few percent of the real ones
    computed = sum(len(idx) * w for idx, w in plan)
    assert computed / lengths.sum() < 1.02
    # one row longer than the budget still runs, alone
    assert [len(i) for i, _ in plan_batches(np.array([9000, 10]), lambda n: n, 16, 4096)] == [1, 1]


def test_cut_batches_are_the_cheapest_split_of_the_sorted_rows():
    """Of every way to cut the length-sorted rows into consecutive batches within the budget, the plan
    is one that computes the fewest positions, each batch counted as BATCH_COST of the budget more
    (brute force over all splits of small random shards): a batch of long rows does not take short
    ones whose padding would cost more than a batch."""
    rng = np.random.default_rng(3)
    budget = 64
    for _ in range(200):
        n = int(rng.integers(1, 11))
        lengths = rng.integers(1, 40, size=n)
        plan = plan_batches(lengths, lambda x: max(x, 1), 16, budget)
        widths = [max(int(x), 1) for x in sorted(lengths, reverse=True)]

        def cost(cuts, n=n, widths=widths):  # cuts: the start of every batch after the first
            edges = [0, *cuts, n]
            total = 0.0
            for a, b in zip(edges, edges[1:], strict=False):
                if (b - a) * widths[a] > budget and b - a > 1:
                    return np.inf
                total += (b - a) * widths[a] + budget * BATCH_COST
            return total

        best = min(cost(c) for k in range(n) for c in itertools.combinations(range(1, n), k))
        got = sum(len(idx) * w + budget * BATCH_COST for idx, w in plan)
        assert got == pytest.approx(best)
        assert sorted(np.concatenate([i for i, _ in plan]).tolist()) == list(range(n))


def test_packed_plan_fills_sequences_and_the_layout_keeps_its_grouping():
    """Packed rows: every row once, each batch within the budget in whole sequences of the widest
    row's width, short rows beside long ones (C4-like lengths: many full rows, a long tail of short
    ones), and `pack_rows` lays a batch out in exactly the sequences the plan counted."""
    rng = np.random.default_rng(0)
    lengths = np.concatenate([np.full(400, 512), rng.integers(1, 512, size=2600)])
    plan = plan_batches(lengths, lambda n: max(n, 1), 16, 16384, packed=True)
    order = np.concatenate([idx for idx, _ in plan])
    assert sorted(order.tolist()) == list(range(len(lengths)))
    computed = 0
    for idx, width in plan:
        assert width == 512
        packed = pack_rows([np.ones(n, dtype=np.int64) for n in lengths[idx]], width)
        assert packed.ids.size <= 16384  # the budget, in whole sequences
        computed += packed.ids.size
    assert computed / lengths.sum() < 1.02  # (C4 rows at n_ctx 512: 1.004; sorted batches gave 1.02-1.07)


def test_a_batch_is_placed_after_the_next_one_is_queued():
    """`Later`: the loop queues batch k + 1 before it waits for batch k's values (a device never idles
    between batches), and every row still gets its own values (the scorers' values are held to the
    one-row-per-forward reference by tests/test_packing.py)."""
    events = []

    class Recording:
        batch_size = 4

        def batch_width(self, n, T):
            return T

        def batch_columns(self, width, T):
            return T

        def packs_rows(self):
            return False

        def score_batch(self, ids, pads):
            k = len([e for e in events if e[0] == "queue"])
            events.append(("queue", k))

            def finish():
                events.append(("finish", k))
                return Scored(ids.astype(np.float32), computed=ids.size)

            return Later(finish)

    ids = np.arange(40, dtype=np.int64).reshape(10, 4) + 1
    got = score_rows(Recording(), ids, np.zeros(10, dtype=np.int64), Batching())
    np.testing.assert_array_equal(got.values, ids.astype(np.float32))
    assert events == [("queue", 0), ("queue", 1), ("finish", 0), ("queue", 2), ("finish", 1), ("finish", 2)]
    t = torch.arange(6.0).view(2, 3)
    np.testing.assert_array_equal(HostCopy(t, t + 1).arrays()[1], (t + 1).numpy())


def test_stage_with_a_token_budget_writes_the_per_row_values_and_the_pad_fraction(
    tmp_path, data, checkpoints, rows
):
    ids, n_pad = rows
    out = tmp_path / "scored"
    stage = ScoreStage(
        data, "causal_loss", {"model": checkpoints["hf"], "dtype": "fp32"}, batch_tokens=BUDGET
    )
    run_stage(stage, out, progress=False)
    t = pq.read_table(next(out.glob("part-*.parquet")))
    per_row = make("causal_loss_hf", checkpoints, batch_size=1)
    want = np.concatenate([per_row.score(ids[i : i + 1], n_pad[i : i + 1]).values for i in range(len(ids))])
    got = np.stack(t.column("entropy").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # the shard's row order
    np.testing.assert_array_equal(np.stack(t.column("input_ids").to_numpy(zero_copy_only=False)), ids)
    extra = read_manifests(out)[0].extra
    assert extra["batch_tokens"] == BUDGET
    # sorted, cut batches compute far fewer pads than the rows hold
    assert 0 <= extra["pad_fraction"] < 0.5 * float(n_pad.sum() / ids.size)


def test_cli_batch_tokens(tmp_path, data, checkpoints, rows):
    out = tmp_path / "cli"
    args = ["score", str(data), "--scorer", "occlusion", "--checkpoint", checkpoints["est"]]
    r = CliRunner().invoke(main, [*args, "--batch-tokens", "64", "--out", str(out)])
    assert r.exit_code == 0, r.output
    extra = read_manifests(out)[0].extra
    # the estimator reads its own left padding: rows are never cut, the pads are computed
    assert extra["batch_tokens"] == 64
    assert extra["pad_fraction"] == pytest.approx(rows[1].sum() / rows[0].size, abs=1e-4)
    r = CliRunner().invoke(main, [*args, "--batch-tokens", "0", "--out", str(tmp_path / "no")])
    assert r.exit_code == 2 and "--batch-tokens" in r.output and not (tmp_path / "no").exists()
    # both sizes: one is ignored, so both are refused (the help says "instead of --batch-size")
    r = CliRunner().invoke(
        main, [*args, "--batch-tokens", "64", "--batch-size", "4", "--out", str(tmp_path / "no")]
    )
    assert r.exit_code == 2 and "give one of them" in r.output and not (tmp_path / "no").exists()


def test_segments_scored_while_the_previous_one_is_written_keep_the_row_order(
    tmp_path, data, checkpoints, monkeypatch
):
    """A shard longer than a segment is scored segment by segment (the writer thread weighs and
    writes one while the next is scored): the same file as one segment."""
    from entroweight.pipelines import score as score_module

    options = {"model": checkpoints["hf"], "dtype": "fp32"}
    run_stage(ScoreStage(data, "causal_loss", options, batch_tokens=BUDGET), tmp_path / "one", progress=False)
    monkeypatch.setattr(score_module, "MIN_SEGMENT_ROWS", 1)
    monkeypatch.setattr(score_module, "SEGMENT_TOKENS", 5 * N_CTX)  # segments of 5 rows
    run_stage(ScoreStage(data, "causal_loss", options, batch_tokens=BUDGET), tmp_path / "seg", progress=False)
    one, seg = (pq.read_table(next((tmp_path / d).glob("part-*.parquet"))) for d in ("one", "seg"))
    assert one.num_rows == seg.num_rows == 16
    for name in ("input_ids", "n_pad", "weight"):
        assert one.column(name).to_pylist() == seg.column(name).to_pylist()
    np.testing.assert_allclose(
        np.stack(seg.column("entropy").to_numpy(zero_copy_only=False)),
        np.stack(one.column("entropy").to_numpy(zero_copy_only=False)),
        rtol=1e-5,
        atol=1e-6,
    )
