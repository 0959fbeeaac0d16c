# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""eval-bpb's sliding windows, for every stride in 1..n_ctx: each target after the first token is
scored exactly once, never as a window's first token (it has no context there), with as much left
context as a window allows; and BPB equals an independent per-target computation with the exported
Hugging Face model at stride = n_ctx, n_ctx/2 and 1."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from test_trainer_fixtures import one_thread, tiny_ckpt, weighted_dir  # noqa: F401 - fixtures

from entroweight.trainers.bpb import eval_bpb, windows
from entroweight.trainers.export import export_hf

N_CTX = 32
TEXT_BYTES = 1500  # ~500 tokens: a dozen windows at stride n_ctx, every target its own at stride 1


def context_start(t: int, n: int, n_ctx: int, stride: int) -> int:
    """Where target t's context begins, from the rule, not the window loop: targets 1..n_ctx-1 share
    the first window; later ones come in groups of min(stride, n_ctx-1), each group's window ending
    at its last target and spanning n_ctx tokens (so the last window reaches back n_ctx too)."""
    if t < n_ctx:
        return 0
    s = min(stride, n_ctx - 1)
    return min(s * math.ceil((t + 1 - n_ctx) / s), n - n_ctx)


@pytest.mark.parametrize("n_ctx", [2, 3, 8])
def test_windows_predict_every_target_once_with_context(n_ctx):
    for n in [1, 2, 3, n_ctx, n_ctx + 1, 5 * n_ctx + 3]:
        for stride in range(1, n_ctx + 1):
            scored = []
            for begin, end, first in windows(n, n_ctx, stride):
                assert end - begin == min(n_ctx, n) and begin < first < end  # never a window's first token
                for t in range(first, end):
                    assert begin == context_start(t, n, n_ctx, stride), (n, stride, t)
                    scored.append(t)
            assert scored == list(range(1, n)), (n, n_ctx, stride)


def test_windows_refuse_a_stride_outside_1_to_n_ctx():
    for n_ctx, stride in [(8, 0), (8, -1), (8, 9), (1, 1)]:
        with pytest.raises(ValueError, match="--stride must be in|--n-ctx must be at least 2"):
            list(windows(100, n_ctx, stride))


@pytest.fixture(scope="module")
def hf_dir(tiny_ckpt, tmp_path_factory):
    return export_hf(tiny_ckpt, tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def text(wikitext_path):
    raw = wikitext_path.read_bytes()[20_000 : 20_000 + TEXT_BYTES]  # real text, not the file's start
    text = raw.decode("utf-8", errors="ignore")
    return text


def hf_nats(hf_dir, text: str, n_ctx: int, stride: int) -> tuple[float, int]:
    """Σ CE of every target given exactly its context_start..t, with transformers' own tokenizer,
    model and log-softmax; one forward per distinct context start (a causal model's logits at t do
    not depend on tokens after t)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    ids = [tok.eos_token_id, *tok(text, add_special_tokens=False).input_ids]
    n = len(ids)
    by_start = defaultdict(list)
    for t in range(1, n):
        by_start[context_start(t, n, n_ctx, stride)].append(t)
    nats = 0.0
    with torch.no_grad():
        for start, targets in by_start.items():
            assert max(targets) - start < n_ctx  # the model never sees more than n_ctx tokens
            x = torch.tensor([ids[start : max(targets) + 1]])
            logp = model(x).logits[0].double().log_softmax(-1)
            nats -= sum(logp[t - start - 1, ids[t]].item() for t in targets)
    return nats, n


@pytest.mark.parametrize("stride", [N_CTX, N_CTX // 2, 1])
def test_eval_bpb_equals_hf_per_target_computation(tiny_ckpt, hf_dir, text, tmp_path, stride):
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    res = eval_bpb(tiny_ckpt, path, n_ctx=N_CTX, stride=stride, device="cpu")
    nats, n = hf_nats(hf_dir, text, N_CTX, stride)
    n_bytes = len(text.encode("utf-8"))
    assert res["tokens"] == n - 1 and res["bytes"] == n_bytes and n > 10 * N_CTX
    assert res["nats"] == pytest.approx(nats, rel=1e-5)
    assert res["bpb"] == pytest.approx(nats / (math.log(2) * n_bytes), rel=1e-5)
    # a sane per-token loss: the old stride = n_ctx bug scored ~1 target per window (BPB ≈ 0.1)
    assert 1.0 < res["nats"] / res["tokens"] < math.log(1024)
    assert res["stride"] == min(stride, N_CTX - 1)  # the step the windows took (it said n_ctx for n_ctx − 1)


def test_the_blocks_partition_the_text_and_its_nats(tiny_ckpt, wikitext_path, tmp_path):
    """The report's clusters: every byte in one block, every target's nats in the block its bytes end
    in (the first target's in the first block, the last's in the last)."""
    from entroweight.trainers.bpb import BLOCK_BYTES

    path = tmp_path / "text.txt"
    path.write_bytes(wikitext_path.read_bytes()[:7_000].decode("utf-8", errors="ignore").encode("utf-8"))
    res = eval_bpb(tiny_ckpt, path, n_ctx=N_CTX, stride=N_CTX // 2, device="cpu")
    b = res["blocks"]
    assert len(b["bytes"]) == -(-res["bytes"] // BLOCK_BYTES) > 1
    assert sum(b["bytes"]) == res["bytes"] and b["bytes"][0] == BLOCK_BYTES
    assert sum(b["nats"]) == pytest.approx(res["nats"], rel=1e-9)
    assert all(n > 0 for n in b["nats"])  # no block without its tokens' losses
    # per block, about the text's mean rate: no block holds another's tokens
    rates = np.array(b["nats"]) / np.array(b["bytes"])
    assert rates.max() < 3 * rates.mean()
