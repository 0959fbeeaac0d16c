"""causal_loss on a tiny randomly initialised HF Llama (real transformers code, fast on CPU)."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from entroweight.scorers import ScorerError, available, make_scorer
from entroweight.scorers.forward import chunked_ce, to_device, token_ce
from entroweight.transforms.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer_dir):
    """A 2-layer Llama with the data's 1k tokenizer file beside it: causal_loss scores directly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    out = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(out)
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def rows(tokenized_dir):
    table = pq.read_table(sorted(tokenized_dir.glob("part-*.parquet"))[0]).slice(0, 12)
    ids = np.stack(table.column("input_ids").to_numpy(zero_copy_only=False)).astype(np.int64)
    n_pad = table.column("n_pad").to_numpy()
    return ids, n_pad


def reference(model, ids_row: np.ndarray, start: int) -> np.ndarray:
    """Brute force: one unpadded row with the start token, full fp32 logits, log-softmax."""
    x = torch.as_tensor(np.concatenate([[start], ids_row]))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits[0].float(), -1)
    return (-logp[:-1].gather(1, x[0, 1:, None])[:, 0]).numpy()


def test_builtins_registered():
    assert {"causal_loss", "cross_tokenizer"} <= set(available())
    with pytest.raises(ScorerError, match="unknown scorer"):
        make_scorer("nope")


def test_causal_loss_matches_brute_force_and_pads_are_zero(tiny_llama, rows):
    ids, n_pad = rows
    scorer = make_scorer("causal_loss", model=str(tiny_llama), dtype="fp32", batch_size=4)
    scorer.setup()
    values = scorer.score(ids, n_pad).values
    assert values.dtype == np.float32 and values.shape == ids.shape
    T = ids.shape[1]
    for r in range(len(ids)):
        assert np.all(values[r, : n_pad[r]] == 0)
        ref = reference(scorer._model, ids[r, n_pad[r] :], scorer._start)
        # value i is about token i: the first real token is predicted from the start token
        np.testing.assert_allclose(values[r, n_pad[r] :], ref, rtol=1e-4, atol=1e-4)
    assert (values[np.arange(T)[None] >= n_pad[:, None]] > 0).all()


def test_bucketing_is_identical_to_unbucketed(tiny_llama, rows):
    ids, n_pad = rows
    scorer = make_scorer("causal_loss", model=str(tiny_llama), dtype="fp32", batch_size=len(ids))
    scorer.setup()
    whole = scorer.score(ids, n_pad).values  # one batch: only the shortest common padding is cut
    scorer.batch_size = 3  # bucketed by length, order restored
    bucketed = scorer.score(ids, n_pad).values
    scorer.batch_size = 1
    single = scorer.score(ids, n_pad).values
    np.testing.assert_allclose(bucketed, whole, atol=2e-5)
    np.testing.assert_allclose(single, whole, atol=2e-5)


def test_chunked_ce_equals_full_ce():
    torch.manual_seed(1)
    hidden, head = torch.randn(37, 16), torch.nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (37,))
    full = torch.nn.functional.cross_entropy(head(hidden), targets, reduction="none")
    with torch.no_grad():
        for chunk in (1, 5, 37, 100):
            torch.testing.assert_close(chunked_ce(hidden, targets, head, chunk_rows=chunk), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head", ["none", "identity", "linear"])
def test_chunked_ce_overwrites_only_logits_of_its_own(dtype, head):
    """On a CPU the CE runs log_softmax in place on fp32 logits it owns (a copy of low-precision
    ones, or those the head made); the caller's rows, logits or hidden states, are never written,
    and the values are F.cross_entropy's in fp32."""
    torch.manual_seed(3)
    rows = (torch.randn(29, 40) * 5).to(dtype)
    targets = torch.randint(0, 40, (29,))
    layer = {"none": None, "identity": torch.nn.Identity(), "linear": torch.nn.Linear(40, 40, bias=False)}[
        head
    ]
    if layer is not None:
        layer.to(dtype)
    before = rows.clone()
    with torch.inference_mode():
        logits = rows if layer is None else layer(rows)
        want = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")
        for chunk in (1, 7, 29):
            got = chunked_ce(rows, targets, layer, chunk_rows=chunk)  # (a chunked GEMM may round apart)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert torch.equal(rows, before)


def _logits(dtype):
    torch.manual_seed(2)
    x = torch.randn(41, 300) * torch.linspace(0.1, 30.0, 41)[:, None]  # flat to peaked rows
    return x.to(dtype), torch.randint(0, 300, (41,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_ce_is_the_fp32_cross_entropy_of_the_logits(dtype):
    """The CE CUDA compiles (`token_ce`: logsumexp − the target's logit, upcast inside the reduction)
    is `F.cross_entropy` of the logits in fp32, whatever their dtype."""
    x, y = _logits(dtype)
    want = torch.nn.functional.cross_entropy(x.float(), y, reduction="none")
    got = token_ce(x, y)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-5)


@pytest.mark.slow
def test_token_ce_compiled_gives_the_eager_values():
    """What `chunked_ce` runs on CUDA is `token_ce` through torch.compile; compiled here for the CPU
    (inductor, the same graph), it gives the eager values, for a bf16 and an fp32 chunk of another
    length (dynamic shapes, no recompile per chunk)."""
    fused = torch.compile(token_ce, dynamic=True)
    for dtype in (torch.bfloat16, torch.float32):
        x, y = _logits(dtype)
        for n in (41, 17):
            torch.testing.assert_close(fused(x[:n], y[:n]), token_ce(x[:n], y[:n]), rtol=1e-6, atol=2e-5)


def test_to_device_on_a_cpu_is_the_array_itself_never_pinned(monkeypatch, tiny_llama, rows):
    """Pinned memory and non-blocking copies are for CUDA only: on a CPU the host array is the tensor
    (no copy, nothing pinned), and a scorer's values are what they were."""
    ids, n_pad = rows
    s = make_scorer("causal_loss", model=str(tiny_llama), dtype="fp32")
    s.setup()
    want = s.score(ids, n_pad).values

    def refuse(self, *a, **k):
        raise AssertionError("pin_memory on the CPU path")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    t = to_device(a, "cpu")
    assert t.device.type == "cpu" and not t.is_pinned() and np.shares_memory(t.numpy(), a)
    np.testing.assert_array_equal(s.score(ids, n_pad).values, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_device_on_cuda_copies_from_pinned_memory(monkeypatch):
    pinned = []
    pin = torch.Tensor.pin_memory

    def spy(self, *a, **k):
        out = pin(self, *a, **k)
        pinned.append(out)
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", spy)
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    t = to_device(a, "cuda")
    assert t.is_cuda and len(pinned) == 1 and pinned[0].is_pinned()
    np.testing.assert_array_equal(t.cpu().numpy(), a)


def test_refuses_data_of_another_tokenizer(tiny_llama, llama3_tokenizer):
    scorer = make_scorer("causal_loss", model=str(tiny_llama), dtype="fp32")
    other = load_tokenizer(llama3_tokenizer)
    with pytest.raises(ScorerError, match="cross_tokenizer"):
        scorer.check_data_tokenizer(other.sha256, other)
    scorer.check_data_tokenizer(load_tokenizer(tiny_llama).sha256)  # same file: fine


def test_needs_exactly_one_model():
    with pytest.raises(ScorerError, match="exactly one"):
        make_scorer("causal_loss")
