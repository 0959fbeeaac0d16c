# ruff: noqa: F811 - pytest fixtures imported from other test modules
"""Packed scoring (scorers/packing.py, models/packing.py) gives the values of the per-row path to
1e-5 in fp32, for every scorer of the registry over every layout its models take: several rows in
one sequence (HF llama, our `mask_pads` llama), rows after a shared pad prefix (the write-up's
models, which attend to their padding: our llama and mixer, the estimators' encoders and their
baseline decoders), decomposition's windows. Real C4 rows of mixed lengths, some full."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_token_budget import BUDGET, N_CTX, PAD, VOCAB, data, one_thread, rows, sha  # noqa: F401
from test_token_budget import checkpoints as budget_checkpoints  # noqa: F401

from entroweight.models.checkpoint import save_checkpoint
from entroweight.models.estimator import EntropyEstimator
from entroweight.models.llama import Llama
from entroweight.models.mixer import MaskedMixer
from entroweight.models.packing import Layout, block_causal, flex_block_causal
from entroweight.scorers import Batching, hf, make_scorer
from entroweight.scorers.base import packs_shard_wide
from entroweight.scorers.forward import next_token_ce
from entroweight.scorers.packing import Packed, block_runs, pack_rows
from entroweight.scorers.registry import BUILTIN


@pytest.fixture(scope="module")
def checkpoints(budget_checkpoints, tmp_path_factory, sha):
    """The token-budget test's models, and one of each other layout: a `mask_pads` llama, a mixer, and
    estimators with a llama encoder and the other injections."""
    root = tmp_path_factory.mktemp("pack-models")
    torch.manual_seed(1)

    def save(model, name, kind):
        n_ctx = model.config.n_ctx
        return str(save_checkpoint(model, kind, root / name, tokenizer_sha256=sha, n_ctx=n_ctx, pad_id=PAD))

    def estimator(injection, encoder, decoder):
        cfg = EntropyEstimator.Config(
            vocab_size=VOCAB, n_ctx=N_CTX, injection=injection, encoder=encoder, decoder=decoder,
            encoder_config={"d_model": 32, "n_layers": 1, "n_heads": 2},
            decoder_config={"d_model": 32, "n_layers": 2, "n_heads": 2}, embed_dim=8, noise="none",
            init_std=0.2,
        )  # fmt: skip
        return EntropyEstimator(cfg).eval()

    small = dict(vocab_size=VOCAB, n_ctx=N_CTX, d_model=32, n_layers=2)
    return {
        **budget_checkpoints,
        "masked": save(Llama(Llama.Config(**small, n_heads=2, d_ff=64, mask_pads=True)).eval(), "m", "llama"),
        "mixer": save(MaskedMixer(MaskedMixer.Config(**small, n_heads=2, kernel=3)).eval(), "mixer", "mixer"),
        "est_llama": save(estimator("token", "llama", "llama"), "est_llama", "estimator"),
        "est_emb": save(estimator("embedding", "llama", "mixer"), "est_emb", "estimator"),
        "est_comb": save(estimator("combination", "mixer", "llama"), "est_comb", "estimator"),
    }


# every built-in scorer, each over the layouts its models take
CASES = {
    "causal_loss": [
        {"model": "hf"},
        {"checkpoint": "llama"},
        {"checkpoint": "masked"},
        {"checkpoint": "mixer"},
    ],
    "cross_tokenizer": [{"model": "hf", "context": 16}, {"model": "hf", "context": 16, "aggregate": "sum"}],
    "occlusion": [
        {"checkpoint": "est"},
        {"checkpoint": "est", "metric": "cosine"},
        {"checkpoint": "est", "baseline": "remove"},
        {"checkpoint": "est_llama"},
        {"checkpoint": "est_emb"},
        {"checkpoint": "est_comb", "baseline": "remove"},
    ],
    "decomposition": [{"checkpoint": "est"}, {"checkpoint": "llama"}],
    "two_model": [{"checkpoint": "est", "checkpoint_short": "short"}],
    "grad_input": [{"checkpoint": "est"}, {"checkpoint": "est_llama"}],
    "excess_loss": [{"checkpoint": "llama", "reference": "hf"}],
}
PARAMS = [(name, i) for name, cases in CASES.items() for i in range(len(cases))]


def test_every_builtin_scorer_has_packing_cases():
    assert set(CASES) == set(BUILTIN)


def scorer(name, options, checkpoints, tokenizer_dir, packed: bool):
    from entroweight.transforms.tokenizer import load_tokenizer

    opts = {k: checkpoints.get(v, v) if isinstance(v, str) else v for k, v in options.items()}
    s = make_scorer(name, dtype="fp32", **opts)
    s.pack = packed
    s.setup(load_tokenizer(tokenizer_dir))
    return s


@pytest.mark.parametrize("name,i", PARAMS, ids=[f"{n}-{i}" for n, i in PARAMS])
def test_packed_values_equal_the_per_row_path(name, i, checkpoints, rows, tokenizer_dir):
    ids, n_pad = rows
    if name in ("grad_input", "decomposition", "two_model"):  # one pass per position: fewer rows
        ids, n_pad = ids[:6], n_pad[:6]
    options = CASES[name][i]
    want = scorer(name, options, checkpoints, tokenizer_dir, False).score(ids, n_pad, Batching(batch_size=1))
    got = scorer(name, options, checkpoints, tokenizer_dir, True).score(
        ids, n_pad, Batching(batch_tokens=BUDGET)
    )
    assert np.abs(want.values).max() > 0
    # min-max normalised values are divided by a row's range: 1e-5 of that range
    np.testing.assert_allclose(got.values, want.values, rtol=1e-5, atol=1e-5)
    assert got.real == want.real


@pytest.mark.parametrize("name,i", PARAMS, ids=[f"{n}-{i}" for n, i in PARAMS])
def test_rows_without_tokens_score_zero_and_leave_the_others_alone(name, i, checkpoints, rows, tokenizer_dir):
    """An empty document tokenizes to a row of pads alone. Every scorer, packed or per row (a batch
    of such rows alone included), gives those rows 0 and the other rows the values they get without
    them."""
    ids, n_pad = rows
    ids, n_pad = ids[:4], n_pad[:4]
    T = ids.shape[1]
    empty = np.full((3, T), PAD, dtype=ids.dtype)
    with_empty = np.concatenate([empty[:2], ids, empty[2:]]), np.concatenate([[T, T], n_pad, [T]])
    for packed, batching in ((False, Batching(batch_size=1)), (True, Batching(batch_tokens=BUDGET))):
        s = scorer(name, CASES[name][i], checkpoints, tokenizer_dir, packed)
        alone = s.score(ids, n_pad, batching).values
        got = s.score(*with_empty, batching)
        assert (got.values[[0, 1, 6]] == 0).all()
        np.testing.assert_allclose(got.values[2:6], alone, rtol=1e-5, atol=1e-5)
        assert got.real == s.score(ids, n_pad, batching).real


PACKING = [
    ("causal_loss", {"model": "hf"}),
    ("causal_loss", {"checkpoint": "masked"}),
    ("cross_tokenizer", {"model": "hf", "context": 16}),
]


@pytest.mark.parametrize("wide", [True, False], ids=["shard-wide", "cut"])
@pytest.mark.parametrize(("name", "options"), PACKING, ids=["hf", "mask_pads", "cross"])
def test_both_plans_and_one_row_batches_give_the_per_row_values(
    name, options, wide, checkpoints, rows, tokenizer_dir, monkeypatch
):
    """The rows a model packs, planned either way (`base.packs_shard_wide`: over the whole shard, as
    where the attention skips what lies outside each row, or cut to each batch's longest), give the
    per-row values. Shard-wide, the
    full rows come first and make batches of one row a sequence, read with plain causal attention (no
    layout, no `position_ids`), and the other batches are packed: both kinds occur."""
    import entroweight.scorers.base as base
    import entroweight.scorers.cross_tokenizer as cross

    for module in (base, cross):
        monkeypatch.setattr(module, "packs_shard_wide", lambda scorer: wide)
    ids, n_pad = rows
    kinds = []
    real = Packed.one_row_each
    monkeypatch.setattr(Packed, "one_row_each", property(lambda p: kinds.append(real.fget(p)) or kinds[-1]))
    want = scorer(name, options, checkpoints, tokenizer_dir, False).score(ids, n_pad, Batching(batch_size=1))
    got = scorer(name, options, checkpoints, tokenizer_dir, True).score(
        ids, n_pad, Batching(batch_tokens=BUDGET)
    )
    assert True in kinds
    if wide and name == "causal_loss":
        assert False in kinds
    np.testing.assert_allclose(got.values, want.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "options"), PACKING, ids=["hf", "mask_pads", "cross"])
def test_rows_are_packed_over_the_shard_where_the_attention_skips_the_fill(
    name, options, checkpoints, tokenizer_dir
):
    """`base.packs_shard_wide`: over the shard where the model's attention over packed rows skips what
    lies outside each row (our models' FlexAttention on CUDA; an HF model's flash or flex attention),
    cut where it computes each sequence's whole causal square under a mask (SDPA: off CUDA, and the
    HF models as `hf.load_causal_lm` loads them, on every device)."""
    s = scorer(name, options, checkpoints, tokenizer_dir, True)
    assert not packs_shard_wide(s)  # this CPU
    for device in ("cuda", "cuda:1"):  # what the rule answers there (nothing runs)
        s.device = device
        assert packs_shard_wide(s) == ("checkpoint" in options)
    if "model" in options:
        assert s._model.config._attn_implementation == "sdpa"
        for impl, skips in [
            ("sdpa", False),
            ("eager", False),
            ("flash_attention_2", True),
            ("flex_attention", True),
        ]:
            model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=impl))
            assert hf.attention_skips_fill(model) == skips


def test_packing_computes_no_pads_for_the_models_that_allow_it(checkpoints, rows, tokenizer_dir):
    """A model that reads packed rows or a pad prefix computes about its real tokens, not the rows'
    padding (the per-row path computes every pad of the data)."""
    ids, n_pad = rows
    real = int((ids.shape[1] - n_pad).sum())
    for options, most in (
        ({"model": "hf"}, 1.05),
        ({"checkpoint": "llama"}, 1.3),  # on a CPU: rows after the pad prefix, cut to the batch's widest
        ({"checkpoint": "masked"}, 1.05),
        ({"checkpoint": "mixer"}, 1.3),  # per-position weights: rows cut to the batch's widest
    ):
        got = scorer("causal_loss", options, checkpoints, tokenizer_dir, True).score(
            ids, n_pad, Batching(batch_tokens=BUDGET)
        )
        assert got.computed <= most * real + len(ids), options


def test_next_token_ce_forms_logits_for_the_read_slots_alone():
    """Packed rows with fill, and left-padded windows: the head sees one row per slot whose CE a value
    reads (each slot of a row but its first), and those values are the full CE's."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 32, bias=False)
    seen = []
    head.register_forward_hook(lambda m, args, out: seen.append(len(args[0])))
    rng = np.random.default_rng(0)
    p = pack_rows([rng.integers(1, 32, size=n) for n in (9, 1, 17, 4, 0, 30)], 32)
    window = np.where(np.arange(12)[None, :] >= np.array([[11], [3], [0], [-1]]), 0, -1)  # 0, 8, 11, 12 real
    for segments in (p.segments, window):
        ids = torch.as_tensor(rng.integers(0, 32, size=segments.shape))
        h = torch.randn(*segments.shape, 8)
        seen.clear()
        with torch.no_grad():
            got = next_token_ce(h, ids, segments, head)
            full = torch.nn.functional.cross_entropy(
                head(h[:, :-1]).transpose(1, 2), ids[:, 1:], reduction="none"
            )
        read = np.zeros(segments.shape, dtype=bool)
        read[:, 1:] = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] >= 0)
        assert sum(seen[:-1]) == read.sum() < segments.size - len(segments)
        torch.testing.assert_close(got[:, 1:], torch.where(torch.as_tensor(read[:, 1:]), full, 0.0))
        assert (got[:, 0] == 0).all()


def test_pack_fills_each_sequence_and_keeps_rows_whole():
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, 50, size=n) for n in rng.integers(0, 33, size=40)]
    p = pack_rows(rows, 32)
    for r, (n, s) in enumerate(p.starts):
        np.testing.assert_array_equal(p.ids[n, s : s + len(rows[r])], rows[r])
        np.testing.assert_array_equal(p.positions[n, s : s + len(rows[r])], np.arange(len(rows[r])))
        assert (p.segments[n, s : s + len(rows[r])] == r).all()
    assert (p.segments >= 0).sum() == sum(map(len, rows))
    # best-fit decreasing: each row over half the width alone, the rest close to full sequences
    assert len(p.ids) <= max(sum(len(r) > 16 for r in rows), -(-sum(map(len, rows)) // 32)) + 2


@pytest.mark.filterwarnings("ignore::UserWarning")  # eager FlexAttention on a CPU (CUDA compiles it)
def test_every_block_causal_attention_gives_each_rows_own_states():
    """The three forms of block-diagonal causal attention over packed rows (the bool mask, the CUDA
    layout's FlexAttention block mask, the CPU's `Runs`: one causal SDPA per row) give each row the
    states it has alone."""
    torch.manual_seed(0)
    model = Llama(Llama.Config(vocab_size=64, n_ctx=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2))
    rows = [torch.randint(1, 64, (n,)) for n in (9, 17, 4, 30)]
    p = pack_rows([r.numpy() for r in rows], 32)
    x, seg, pos = (torch.as_tensor(a) for a in (p.ids, p.segments, p.positions))
    with torch.no_grad():
        want = [model.forward_hidden(model.embed(r[None]))[0] for r in rows]
        for mask in (block_causal(seg), flex_block_causal(seg), block_runs(p.segments)):
            h = model.forward_hidden(model.embed(x), layout=Layout(positions=pos, mask=mask))
            for r, (n, s) in enumerate(p.starts):
                torch.testing.assert_close(h[n, s : s + len(rows[r])], want[r], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["causal_loss", "excess_loss"])
def test_a_loss_given_the_tokens_before_reads_causal_models_alone(name, checkpoints, rows, tmp_path, sha):
    """causal_loss and excess_loss give token t's CE given the tokens before it: over every model kind,
    a causal one (llama, mixer) is read and its values before the last token do not move when the last
    token changes; one whose embedding saw the whole row (estimator, autoencoder) is refused up front.
    An estimator's values moved by up to 0.13 nats, and an autoencoder's too, exit 0 (hostile audit)."""
    from entroweight.models import REGISTRY, is_causal
    from entroweight.models.autoencoder import Autoencoder
    from entroweight.models.checkpoint import read_checkpoint_config
    from entroweight.scorers import ScorerError

    ae = Autoencoder(Autoencoder.Config(vocab_size=VOCAB, n_ctx=N_CTX, encoder_config={"d_model": 16, "n_layers": 1},
                                        decoder_config={"d_model": 16, "n_layers": 1})).eval()  # fmt: skip
    models = {**checkpoints, "ae": str(save_checkpoint(ae, "autoencoder", tmp_path / "ae", tokenizer_sha256=sha,
                                                         n_ctx=N_CTX, pad_id=PAD))}  # fmt: skip
    ours = {k: v for k, v in models.items() if k != "hf"}
    kinds = {key: read_checkpoint_config(path)["kind"] for key, path in ours.items()}
    assert set(kinds.values()) >= set(REGISTRY) - {"tfree"}  # every kind a scorer may be handed here
    ids, n_pad = rows
    ids, n_pad = ids[:4], n_pad[:4]
    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB  # the last token of every row
    for key, path in ours.items():
        options = {"checkpoint": path, **({"reference": models["hf"]} if name == "excess_loss" else {})}
        if not is_causal(kinds[key]):
            with pytest.raises(ScorerError, match="needs a causal model"):
                make_scorer(name, dtype="fp32", **options)
            continue
        s = make_scorer(name, dtype="fp32", **options)
        s.setup()
        before, after = s.score(ids, n_pad).values, s.score(changed, n_pad).values
        # (column 0 of a full row is the mean of its other values, as documented: scorers/base.py)
        np.testing.assert_allclose(after[:, 1:-1], before[:, 1:-1], rtol=0, atol=1e-6, err_msg=key)
        assert not np.allclose(after[:, -1], before[:, -1])


def _model_cases():
    """Every model kind a scorer runs, in each layout its forward takes (None: plain causal)."""
    torch.manual_seed(0)
    small = dict(vocab_size=64, n_ctx=32, d_model=32, n_layers=2)
    llamas = [
        Llama(Llama.Config(**small, n_heads=4)),
        Llama(Llama.Config(**small, n_heads=4, n_kv_heads=2)),
        Llama(Llama.Config(**small, n_heads=2, mask_pads=True)),
    ]
    mixers = [
        MaskedMixer(MaskedMixer.Config(**small, **c))
        for c in ({}, {"n_heads": 2}, {"n_heads": 2, "kernel": 3})
    ]
    return [m.eval() for m in llamas + mixers]


@pytest.mark.parametrize("i", range(6))
def test_the_states_of_the_last_columns_alone_equal_those_of_the_whole_forward(i):
    """`forward_hidden(..., last=n)`, whose last block computes only the keys of the other columns,
    gives the states of the whole forward's last n columns, in every layout a scorer uses: plain,
    after a shared pad prefix, packed rows (a bool mask; FlexAttention's block mask and `Runs`,
    which are not cut: every column computed), a `mask_pads` llama's attention mask; gradients too."""
    from entroweight.models.packing import after_prefix

    model = _model_cases()[i]
    x = model.embed(torch.randint(1, 64, (3, 20))).detach()
    layouts = {
        "plain": {},
        "prefix": {
            "layout": after_prefix(
                model.prefix_of(model.embed(torch.zeros(1, 32, dtype=torch.long))), 12, 20, "cpu"
            )
        },
    }
    if isinstance(model, Llama):
        p = pack_rows([np.arange(1, n + 1) for n in (9, 6, 5, 13, 7)], 20)
        seg, pos = torch.as_tensor(p.segments), torch.as_tensor(p.positions)
        x = model.embed(torch.as_tensor(p.ids)).detach()
        layouts = {
            **layouts,
            "packed": {"layout": Layout(positions=pos, mask=block_causal(seg))},
            "flex": {"layout": Layout(positions=pos, mask=flex_block_causal(seg))},
            "runs": {"layout": Layout(positions=pos, mask=block_runs(p.segments))},
        }
        if model.config.mask_pads:
            real = torch.ones(x.shape[:2], dtype=torch.long)
            real[:, :5] = 0
            layouts = {"mask_pads": {"attention_mask": real}}
    for name, kw in layouts.items():
        with torch.no_grad():
            whole = model.forward_hidden(x, **kw)
            for n in (1, 7, x.shape[1]):
                got = model.forward_hidden(x, **kw, last=n)
                torch.testing.assert_close(got, whole[:, -n:], rtol=1e-5, atol=1e-5, msg=f"{name}, last={n}")
    # the gradients of training (the encoder's last state) too, in float64: the same sums, no rounding
    model, x = model.double(), x.double()
    y = x.clone().requires_grad_()
    model.forward_hidden(y, last=1)[:, -1].square().sum().backward()
    z = x.clone().requires_grad_()
    model.forward_hidden(z)[:, -1].square().sum().backward()
    torch.testing.assert_close(y.grad, z.grad, rtol=1e-9, atol=1e-12)
    for bad in (0, x.shape[1] + 1):
        with pytest.raises(ValueError, match="last columns"):
            model.forward_hidden(x, last=bad)


@pytest.mark.parametrize(
    "injection,decoder",
    [("token", "llama"), ("token", "mixer"), ("embedding", "mixer"), ("combination", "llama")],
)
def test_an_estimators_last_logits_alone_equal_those_of_the_whole_decode(injection, decoder):
    """`decode(..., last=n)` (occlusion's decoders) and the encoder's last state computed alone give
    the whole forward's, with the row's embedding and occluded (`emb=None`)."""
    torch.manual_seed(0)
    cfg = EntropyEstimator.Config(
        vocab_size=64, n_ctx=24, injection=injection, encoder="mixer", decoder=decoder,
        encoder_config={"d_model": 32, "n_layers": 2}, decoder_config={"d_model": 32, "n_layers": 2, "n_heads": 2},
        embed_dim=8, noise="none", init_std=0.2,
    )  # fmt: skip
    model = EntropyEstimator(cfg).eval()
    ids = torch.randint(1, 64, (3, 24))
    with torch.no_grad():
        whole_state = model.encoder.forward_hidden(model.encoder.embed(ids))[:, -1]
        from entroweight.models.estimator import last_state

        torch.testing.assert_close(last_state(model.encoder, ids), whole_state, rtol=1e-5, atol=1e-5)
        e = model.encode(ids)
        for emb in (e, None):
            whole = model.decode(ids, emb)
            for n in (1, 9, 24):
                torch.testing.assert_close(
                    model.decode(ids, emb, last=n), whole[:, -n:], rtol=1e-5, atol=1e-5
                )
