"""Estimator-based scorers on tiny real estimators and real C4 shards: occlusion (l1, cosine),
decomposition, two_model, grad_input, excess_loss; engine parity; the CLI."""

from __future__ import annotations

import gzip

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from entroweight.models.checkpoint import save_checkpoint
from entroweight.models.estimator import EntropyEstimator
from entroweight.pipelines import StageError, run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.schemas import read_file_metadata
from entroweight.scorers import ScorerError, make_scorer
from entroweight.workflows.cli.main import main

N_CTX = 32
VOCAB = 1024
PAD = 0


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread is faster than two fighting over a loaded machine."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def tiny_estimator(seed=0, n_ctx=N_CTX, injection="token", encoder="mixer", decoder="llama", **kw):
    torch.manual_seed(seed)
    cfg = EntropyEstimator.Config(
        vocab_size=VOCAB,
        n_ctx=n_ctx,
        injection=injection,
        encoder=encoder,
        decoder=decoder,
        encoder_config={"d_model": 32, "n_layers": 1},
        decoder_config={"d_model": 32, "n_layers": 2, "n_heads": 2}
        if decoder == "llama"
        else {"d_model": 32, "n_layers": 2},
        embed_dim=8,
        noise="none",
        init_std=0.2,  # random init with visible dependence on the embedding
        **kw,
    )
    return EntropyEstimator(cfg).eval()


def save(model, path, sha, kind="estimator"):
    return save_checkpoint(model, kind, path, tokenizer_sha256=sha, n_ctx=model.config.n_ctx, pad_id=PAD)


def tiny_causal(seed=0):
    """A llama as small as the estimators: what excess_loss's two sides read (a causal model)."""
    from entroweight.models.llama import Llama

    torch.manual_seed(seed)
    cfg = Llama.Config(
        vocab_size=VOCAB, n_ctx=N_CTX, d_model=32, n_layers=2, n_heads=2, d_ff=64, init_std=0.2
    )
    return Llama(cfg).eval()


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, c4_path, tokenizer_dir):
    """24 C4 documents, n_ctx 32, left-padded, 2 shards of 12."""
    src = tmp_path_factory.mktemp("src") / "c4.jsonl.gz"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(24)]
    # some short documents, so that rows have left padding
    with gzip.open(src, "wt", encoding="utf-8") as f:
        for i, line in enumerate(lines):
            if i % 3 == 0:
                import json

                d = json.loads(line)
                d["text"] = " ".join(d["text"].split()[: 5 + i])
                line = json.dumps(d) + "\n"
            f.write(line)
    out = tmp_path_factory.mktemp("est_tokens")
    run_stage(
        TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX, shard_docs=12, overflow="truncate"),
        out,
        progress=False,
    )
    return out


@pytest.fixture(scope="module")
def sha(small_data):
    return read_file_metadata(next(small_data.glob("part-*.parquet")))["tokenizer_sha256"]


@pytest.fixture(scope="module")
def rows(small_data):
    t = pq.read_table(sorted(small_data.glob("part-*.parquet"))[0])
    ids = np.stack(t.column("input_ids").to_numpy(zero_copy_only=False)).astype(np.int64)
    return ids, t.column("n_pad").to_numpy().astype(np.int64)


@pytest.fixture(scope="module")
def est_ckpt(tmp_path_factory, sha):
    return save(tiny_estimator(), tmp_path_factory.mktemp("est"), sha)


@pytest.fixture(scope="module")
def causal_ckpt(tmp_path_factory, sha):
    return save(tiny_causal(), tmp_path_factory.mktemp("causal"), sha, "llama")


def scorer(name, ckpt, **kw):
    s = make_scorer(name, checkpoint=str(ckpt), dtype="fp32", batch_size=8, **kw)
    s.setup()
    return s


def real(n_pad, width):
    return np.arange(width)[None, :] >= n_pad[:, None]


# -- occlusion


@pytest.mark.parametrize("injection,decoder", [("combination", "llama"), ("token", "mixer")])
def test_occlusion_of_an_ignored_embedding_is_zero(injection, decoder, rows):
    from entroweight.scorers.occlusion import occlusion_values

    model = tiny_estimator(injection=injection, decoder=decoder)
    ids = torch.as_tensor(rows[0])
    assert occlusion_values(model, ids, PAD, "l1")[:, 1:].min() > 0  # the embedding matters...
    with torch.no_grad():
        model.up.weight.zero_()  # ... until the decoder receives nothing of it
    for metric in ("l1", "cosine"):
        np.testing.assert_allclose(occlusion_values(model, ids, PAD, metric), 0.0, atol=1e-6)


@pytest.mark.parametrize("baseline", ["empty", "remove"])
def test_occlusion_equals_explicit_logits(est_ckpt, rows, baseline):
    """The chunked/Gram computation equals L1 and 1 − cos of the two decoders' full logits: against
    the embedding of an all-pad row in its place (`empty`), or with it removed (`remove`)."""
    from entroweight.models.checkpoint import load_checkpoint
    from entroweight.scorers.occlusion import occlusion_values

    model, _ = load_checkpoint(est_ckpt)
    ids = torch.as_tensor(rows[0])
    with torch.no_grad():
        empty = model.encode(torch.full((1, N_CTX), PAD)).expand(len(ids), -1)
        a, b = model.decode(ids, model.encode(ids)), model.decode(ids, empty if baseline == "empty" else None)
    l1 = (a - b).abs().sum(-1)[:, :-1].numpy()
    cos = 1 - F.cosine_similarity(a, b, dim=-1)[:, :-1].numpy()
    got = {m: occlusion_values(model, ids, PAD, m, baseline=baseline)[:, 1:] for m in ("l1", "cosine")}
    np.testing.assert_allclose(got["l1"], l1, rtol=1e-4)
    np.testing.assert_allclose(got["cosine"], cos, atol=1e-5)


@pytest.mark.parametrize("metric", ["l1", "cosine"])
def test_occlusion_forms_values_for_the_real_tokens_alone(est_ckpt, rows, metric, monkeypatch):
    """Told each row's real tokens (`lengths`), occlusion runs the head and the metric over their
    predictions alone: the same values there, 0 at the pads, and (l1) the head sees no other row."""
    import entroweight.scorers.occlusion as occlusion
    from entroweight.models.checkpoint import load_checkpoint

    model, _ = load_checkpoint(est_ckpt)
    ids, n_pad = rows
    lengths = ids.shape[1] - n_pad
    assert lengths.min() < lengths.max() - 1  # rows of several lengths: pads inside the batch's width
    seen = []
    l1_rows = occlusion.l1_rows
    monkeypatch.setattr(occlusion, "l1_rows", lambda x: seen.append(len(x)) or l1_rows(x))
    every = occlusion.occlusion_values(model, torch.as_tensor(ids), PAD, metric)
    seen.clear()
    got = occlusion.occlusion_values(model, torch.as_tensor(ids), PAD, metric, lengths=lengths)
    real = np.arange(ids.shape[1])[None, :] >= np.maximum(n_pad, 1)[:, None]  # value 0 has no prediction
    np.testing.assert_allclose(got[real], every[real], rtol=1e-5, atol=1e-6)
    assert (got[~real] == 0).all()
    if metric == "l1":
        assert sum(seen) == int(np.minimum(lengths, ids.shape[1] - 1).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l1_rows_is_the_fp32_l1_norm(dtype):
    """occlusion's per-row L1 (|x| in x's dtype, summed in fp32 on a CPU) = the fp32 norm of x."""
    from entroweight.scorers.occlusion import l1_rows

    x = torch.randn(37, 8000, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = l1_rows(x.clone())  # it may overwrite its input
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.linalg.vector_norm(x.float(), ord=1, dim=-1), rtol=1e-5, atol=0)


def test_occlusion_scorer_values(est_ckpt, rows):
    ids, n_pad = rows
    assert (n_pad > 0).any() and (n_pad == 0).any()
    mask = real(n_pad, N_CTX)
    l1 = scorer("occlusion", est_ckpt).score(ids, n_pad).values
    cos = scorer("occlusion", est_ckpt, metric="cosine").score(ids, n_pad).values
    for v in (l1, cos):
        assert v.dtype == np.float32 and (v[~mask] == 0).all()
    # l1: min-max per row over real tokens
    for r in range(len(ids)):
        x = l1[r, n_pad[r] :]
        if len(x) > 1:
            assert x.min() == pytest.approx(0.0, abs=1e-6) and x.max() == pytest.approx(1.0, abs=1e-6)
    assert (cos[mask] >= 0).all() and (cos[mask] <= 2).all() and cos[mask].max() > 0
    # the first real token of a padded row is predicted from the pad before it (a real value);
    # an unpadded row's first token gets the mean of its other values (scorers/base.py)
    from entroweight.models.checkpoint import load_checkpoint
    from entroweight.scorers.occlusion import occlusion_values

    raw = occlusion_values(load_checkpoint(est_ckpt)[0], torch.as_tensor(ids), PAD, "cosine")
    r = int(np.flatnonzero(n_pad > 0)[0])
    assert cos[r, n_pad[r]] == pytest.approx(raw[r, n_pad[r]], rel=1e-5)
    r = int(np.flatnonzero(n_pad == 0)[0])
    assert cos[r, 0] == pytest.approx(raw[r, 1:].mean(), rel=1e-5)


def test_occlusion_pads_narrow_data_to_the_model_width(tmp_path, est_ckpt, rows, sha):
    """Rows narrower than the checkpoint's n_ctx are left-padded to it (how the model was trained)."""
    ids, n_pad = rows
    s = scorer("occlusion", est_ckpt, metric="cosine")
    cut = ids[:, 8:]
    narrow = s.score(cut, np.maximum(n_pad - 8, 0)).values
    keep = n_pad >= 8  # rows whose real tokens survive the cut
    np.testing.assert_allclose(narrow[keep], s.score(ids, n_pad).values[keep][:, 8:], atol=1e-6)
    wide = save(tiny_estimator(n_ctx=16), tmp_path / "short", sha)
    with pytest.raises(ScorerError, match="n_ctx 16"):
        scorer("occlusion", wide).score(ids, n_pad)


def test_occlusion_refusals(tmp_path, est_ckpt, sha):
    from entroweight.models.llama import Llama

    with pytest.raises(ScorerError, match="--metric"):
        make_scorer("occlusion", checkpoint=str(est_ckpt), metric="l2")
    with pytest.raises(ScorerError, match="--baseline"):
        make_scorer("occlusion", checkpoint=str(est_ckpt), baseline="zero")
    with pytest.raises(ScorerError, match="--checkpoint"):
        make_scorer("occlusion")
    plain = Llama(Llama.Config(vocab_size=VOCAB, n_ctx=N_CTX, d_model=32, n_layers=1, n_heads=2, d_ff=64))
    with pytest.raises(ScorerError, match="embedding-augmented"):
        make_scorer("occlusion", checkpoint=str(save(plain, tmp_path / "llama", sha, kind="llama")))
    s = make_scorer("occlusion", checkpoint=str(est_ckpt))
    with pytest.raises(ScorerError, match="retokenize"):
        s.check_data_tokenizer("0" * 64)


@pytest.fixture(scope="module")
def occlusion_local(tmp_path_factory, small_data, est_ckpt):
    out = tmp_path_factory.mktemp("occ_local")
    stage = ScoreStage(
        small_data, "occlusion", {"checkpoint": str(est_ckpt), "dtype": "fp32", "batch_size": 8}
    )
    summary = run_stage(stage, out, progress=False)
    assert summary.shards_run == 2 and summary.rows_out == 24
    return out


def _column(out, name):
    tables = [pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))]
    return np.concatenate([np.stack(t.column(name).to_numpy(zero_copy_only=False)) for t in tables])


@pytest.fixture(scope="module")
def ray_session():
    from entroweight.pipelines.ray import start_ray

    ray, _ = start_ray(None)
    yield ray
    ray.shutdown()


@pytest.mark.parametrize(
    "engine,workers",
    [("beam", None), pytest.param("ray", 2, marks=pytest.mark.slow)],  # Ray's start costs ~20 s on 2 cores
)
def test_occlusion_engine_parity(engine, workers, request, tmp_path, small_data, est_ckpt, occlusion_local):
    if engine == "ray":
        request.getfixturevalue("ray_session")
    stage = ScoreStage(
        small_data, "occlusion", {"checkpoint": str(est_ckpt), "dtype": "fp32", "batch_size": 8}
    )
    summary = run_stage(stage, tmp_path, engine=engine, progress=False, workers=workers)
    assert summary.shards_run == 2
    np.testing.assert_array_equal(_column(tmp_path, "input_ids"), _column(occlusion_local, "input_ids"))
    np.testing.assert_allclose(_column(tmp_path, "entropy"), _column(occlusion_local, "entropy"), atol=1e-5)
    meta = read_file_metadata(next(tmp_path.glob("part-*.parquet")))
    assert meta["scorer"] == "occlusion" and meta["metric"] == "l1" and len(meta["checkpoint_sha256"]) == 64


def test_cli_occlusion_cosine(tmp_path, small_data, est_ckpt):
    out = tmp_path / "cos"
    args = ["score", str(small_data), "--scorer", "occlusion", "--checkpoint", str(est_ckpt), "--metric", "cosine",
            "--dtype", "fp32", "--out", str(out)]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert read_file_metadata(next(out.glob("part-*.parquet")))["metric"] == "cosine"
    e = _column(out, "entropy")
    assert (e >= 0).all() and (e <= 2).all()
    r = CliRunner().invoke(main, [*args[:-1], str(tmp_path / "x"), "--metric", "l7"])
    assert r.exit_code == 2


# -- decomposition and two_model


def window_loss(model, tokens, width, n_targets=None):
    """Σ CE over the last `n_targets` tokens of `tokens` left-padded to `width` (default: every token
    with a position before it), one forward: the brute force."""
    if len(tokens) == 0:
        return 0.0
    x = torch.full((1, width), PAD, dtype=torch.long)
    x[0, width - len(tokens) :] = torch.as_tensor(tokens)
    with torch.no_grad():
        logits = model(x)[0, :-1]
    ce = F.cross_entropy(logits.double(), x[0, 1:], reduction="none")
    n = min(len(tokens), width - 1) if n_targets is None else n_targets
    return float(ce[width - 1 - n :].sum()) if n else 0.0


def brute_force(long, short, ids, n_pad, n_long, n_short):
    """The chain rule per token: both windows start at the same token and sum CE over the same
    targets but the last token (a full long window's first token is context in both)."""
    out = np.zeros(ids.shape)
    for r in range(len(ids)):
        tokens = list(ids[r, n_pad[r] :])
        for j in range(len(tokens)):
            a = tokens[max(0, j + 1 - n_long) : j + 1]
            b = tokens[max(0, j - (n_long - 1)) : j]
            n = min(len(a), n_long - 1)
            out[r, n_pad[r] + j] = window_loss(long, a, n_long, n) - window_loss(short, b, n_short, n - 1)
    return out


@pytest.fixture(scope="module")
def few_rows(rows):
    ids, n_pad = rows
    pick = [int(np.flatnonzero(n_pad > 0)[0]), int(np.flatnonzero(n_pad == 0)[0])]
    return ids[pick], n_pad[pick]


def test_decomposition_equals_brute_force(est_ckpt, few_rows):
    from entroweight.models.checkpoint import load_checkpoint

    ids, n_pad = few_rows
    got = scorer("decomposition", est_ckpt).score(ids, n_pad).values
    model, _ = load_checkpoint(est_ckpt)
    want = brute_force(model, model, ids, n_pad, N_CTX, N_CTX)
    np.testing.assert_allclose(got, want, atol=2e-4)
    assert (got[~real(n_pad, N_CTX)] == 0).all()
    # the chain rule telescopes: an unpadded row's values sum to its full window's loss plus its first
    # token's loss given the pad (the first value; the full window has no position before that token)
    r = 1
    tokens = list(ids[r])
    total = (
        window_loss(model, tokens, N_CTX)
        + window_loss(model, tokens[:-1], N_CTX, N_CTX - 1)
        - window_loss(model, tokens[:-1], N_CTX, N_CTX - 2)
    )
    assert got[r].sum() == pytest.approx(total, rel=1e-4)


def test_decomposition_slides_over_wider_data(tmp_path, sha, few_rows):
    """Rows wider than the model's n_ctx: both windows slide (the shifted one keeps n_ctx − 1 tokens)."""
    model = tiny_estimator(seed=3, n_ctx=12)
    ckpt = save(model, tmp_path / "n12", sha)
    ids, n_pad = few_rows
    got = scorer("decomposition", ckpt).score(ids, n_pad).values
    np.testing.assert_allclose(got, brute_force(model, model, ids, n_pad, 12, 12), atol=2e-4)


@pytest.mark.parametrize("seed", range(5))
def test_read_slots_are_each_windows_last_targets(seed):
    """The slots whose CE window_loss_sums computes: row u's last min(need[u], width), and no other."""
    from entroweight.scorers.estimator_common import read_slots

    rng = np.random.default_rng(seed)
    need = rng.integers(0, 12, size=rng.integers(0, 9))
    width = int(rng.integers(1, 10))
    mask = np.arange(width)[None, :] >= width - need[:, None]
    np.testing.assert_array_equal(read_slots(need, width), np.flatnonzero(mask))


def test_two_model(tmp_path, sha, est_ckpt, few_rows):
    ids, n_pad = few_rows
    # identical checkpoints: exactly the one-model form
    same = scorer("two_model", est_ckpt, checkpoint_short=str(est_ckpt)).score(ids, n_pad).values
    np.testing.assert_allclose(same, scorer("decomposition", est_ckpt).score(ids, n_pad).values, atol=1e-6)
    # context N and N − 1: the long model's windows minus the short model's, sliding
    long, short = tiny_estimator(seed=1, n_ctx=12), tiny_estimator(seed=2, n_ctx=11)
    ck_long, ck_short = save(long, tmp_path / "long", sha), save(short, tmp_path / "short", sha)
    got = scorer("two_model", ck_long, checkpoint_short=str(ck_short)).score(ids, n_pad).values
    np.testing.assert_allclose(got, brute_force(long, short, ids, n_pad, 12, 11), atol=2e-4)
    with pytest.raises(ScorerError, match="n_ctx 10"):
        make_scorer(
            "two_model",
            checkpoint=str(ck_long),
            checkpoint_short=str(save(tiny_estimator(n_ctx=10), tmp_path / "s", sha)),
        )
    with pytest.raises(ScorerError, match="--checkpoint-short"):
        make_scorer("two_model", checkpoint=str(ck_long))


# -- grad_input


def test_grad_input_matches_finite_differences(rows):
    """Σ_k e_k ∂f/∂e_k is the derivative of f along e: (f(e(1+h)) − f(e(1−h))) / 2h, in float64
    (a mixer decoder: LayerNorm stays in float64, where the llama's RMSNorm computes in fp32)."""
    from entroweight.scorers.grad_input import grad_input_values

    model = tiny_estimator(seed=4, injection="token", decoder="mixer").double()
    ids = torch.as_tensor(rows[0][:3])
    got = grad_input_values(model, ids)
    h = 1e-5
    with torch.no_grad():
        e = model.encode(ids)
        plus = model.decode(ids, e * (1 + h)).abs().sum(-1)
        minus = model.decode(ids, e * (1 - h)).abs().sum(-1)
    fd = ((plus - minus) / (2 * h))[:, :-1].numpy()
    assert np.abs(fd).max() > 1e-3
    np.testing.assert_allclose(got[:, 1:], fd, rtol=1e-4, atol=1e-6)
    assert (got[:, 0] == 0).all()


def test_grad_input_scorer(est_ckpt, few_rows):
    ids, n_pad = few_rows
    v = scorer("grad_input", est_ckpt).score(ids, n_pad).values
    mask = real(n_pad, N_CTX)
    assert (v[~mask] == 0).all() and v[mask].min() >= 0 and v[mask].max() <= 1
    for r in range(len(v)):
        x = v[r, n_pad[r] :]
        assert x.min() == pytest.approx(0.0, abs=1e-6) and x.max() == pytest.approx(1.0, abs=1e-6)


# -- excess_loss


def test_excess_loss_against_itself_is_zero(causal_ckpt, rows):
    ids, n_pad = rows
    s = scorer("excess_loss", causal_ckpt, reference=str(causal_ckpt))
    np.testing.assert_array_equal(s.score(ids, n_pad).values, 0.0)
    assert s.config()["scorer"] == "excess_loss" and len(s.config()["reference"]["checkpoint_sha256"]) == 64


def test_excess_loss_is_the_difference_of_losses(tmp_path, sha, causal_ckpt, rows):
    ids, n_pad = rows
    other = save(tiny_causal(seed=7), tmp_path / "other", sha, "llama")
    got = scorer("excess_loss", causal_ckpt, reference=str(other)).score(ids, n_pad).values
    want = (
        scorer("causal_loss", causal_ckpt).score(ids, n_pad).values
        - scorer("causal_loss", other).score(ids, n_pad).values
    )
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.abs(got).max() > 0.1


def test_excess_loss_refuses_another_tokenizer(
    tmp_path, small_data, causal_ckpt, tokenizer_dir, llama3_tokenizer
):
    other = save(tiny_causal(), tmp_path / "o", "e" * 64, "llama")
    with pytest.raises(ScorerError, match="different tokenizers"):
        make_scorer("excess_loss", checkpoint=str(causal_ckpt), reference=str(other))
    with pytest.raises(ScorerError, match="--reference"):
        make_scorer("excess_loss", checkpoint=str(causal_ckpt))
    # an HF reference with another tokenizer (its weights never load): refused before any work
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    hf_dir = tmp_path / "hf"
    LlamaForCausalLM(cfg).save_pretrained(hf_dir)
    import shutil

    shutil.copy(llama3_tokenizer, hf_dir / "tokenizer.json")
    with pytest.raises(StageError, match="excess_loss reference: .*pass --cross-tokenizer"):  # not --scorer
        ScoreStage(small_data, "excess_loss", {"checkpoint": str(causal_ckpt), "reference": str(hf_dir)},
                   tokenizer=str(tokenizer_dir)).plan_inputs()  # fmt: skip


def test_cli_excess_loss_inverted(tmp_path, small_data, causal_ckpt, sha):
    other = save(tiny_causal(seed=9), tmp_path / "ref", sha, "llama")
    out = tmp_path / "rho"
    args = ["score", str(small_data), "--scorer", "excess_loss", "--checkpoint", str(causal_ckpt),
            "--reference", str(other), "--invert", "--dtype", "fp32", "--out", str(out)]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    meta = read_file_metadata(next(out.glob("part-*.parquet")))
    assert meta["scorer"] == "excess_loss" and meta["weighting"]["invert"] is True
    e, w = _column(out, "entropy"), _column(out, "weight").astype(np.float32)
    # inverted: the highest excess of a row weighs 1
    for er, wr in zip(e, w, strict=True):
        nz = wr > 0
        if nz.sum() > 1:
            assert wr[np.argmax(np.where(nz, er, -np.inf))] == pytest.approx(1.0, abs=1e-3)
