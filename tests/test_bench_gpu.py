"""`make bench-gpu` does not rot: benchmarks/gpu.py end to end with tiny models on the CPU (the real score
stage, the packed limits, the FLOP counts and the host sampler), and its pieces that need no model."""

from __future__ import annotations

import json
import sys
import threading
from types import SimpleNamespace

import pytest

from benchmarks import gpu


def test_tiny_end_to_end_on_cpu(tmp_path):
    """Three scorers of different shapes (rows, windows of text, windows per token) through the stage."""
    out = tmp_path / "out"
    rc = gpu.main(
        ["--tiny", "--device", "cpu", "--dtypes", "fp32", "--out", str(out), "--work", str(tmp_path / "work")]
        + ["--only", "causal_ours", "cross_tokenizer", "decomposition"]
    )
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["machine"]["size"] == "tiny" and results["machine"]["device"] == "cpu"
    records = {r["case"]: r for r in results["records"]}
    assert set(records) == {"causal_ours", "cross_tokenizer", "decomposition"}
    for r in records.values():
        assert "error" not in r, r
        assert r["tok_s"] > 0 and r["limit_tok_s"] > 0 and r["ratio"] > 0
        assert r["flops"] > 0 and r["mfu"] is None  # no peak for a CPU
        assert r["path"]["device_busy"] is None  # no accelerator: no device split
        assert r["ratio_in_span"] is None  # nor a device span to take the shard's fixed costs out of
        assert 0 < sum(v for k, v in r["path"]["host"].items() if k in gpu.MAIN_CATEGORIES) <= 1.01
    assert records["cross_tokenizer"]["model_tokens"] > 0
    assert 0 <= records["causal_ours"]["pad_fraction"] < 1
    md = (out / "results.md").read_text()
    assert "| causal_loss, our llama (attends to pads) | fp32 |" in md and "device busy" in md
    assert "| ratio | ratio in span |" in md


def test_refuses_the_1b_run_without_an_accelerator(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--out", str(tmp_path)]) == 2


def test_llama_flops_is_two_params_plus_attention():
    """2·P + 2·L·W·d per token; for Llama-3.2-1B P ≈ 1.236 B matmul weights (head included)."""
    c, vocab = gpu.LLAMA_1B, 128256
    no_attn = gpu.llama_flops(c, vocab, 0)
    assert no_attn / 2 == pytest.approx(1.2359e9, rel=1e-3)
    assert gpu.llama_flops(c, vocab, 512) - no_attn == 2 * c["n_layers"] * 512 * c["d_model"]
    assert gpu.llama_flops(c, vocab, 0, head=False) == no_attn - 2 * c["d_model"] * vocab


def test_llama32_tokenizer_has_a_pad(tmp_path):
    from entroweight.transforms.tokenizer import load_tokenizer

    tok = load_tokenizer(gpu.llama32_tokenizer(tmp_path))
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (128256, 128004, 128000, 128001)


def test_documents_are_distinct():
    docs = gpu.documents(2100)
    assert len(set(docs)) == 2100 and docs[:1000] == gpu.c4_texts()


def test_host_sampler_sees_a_waiting_main_thread():
    """The sampler classifies the main thread (sync lines, waits) and counts busy helper threads."""
    done = threading.Event()

    def busy():
        while not done.is_set():
            sum(range(1000))

    helper = threading.Thread(target=busy)
    with gpu.HostSampler(every=0.001) as s:
        helper.start()
        done.wait(0.2)
        done.set()
        helper.join()
    shares = s.shares()
    assert s.samples > 10 and shares["other"] > 0.5  # the test's own frames: no entroweight code
    assert shares["other_thread_busy"] > 0
    assert gpu.classify_main(sys._getframe()) == "other"


def test_the_cut_layout_plans_as_off_cuda_and_restores_the_rule():
    """`--layouts cut`: the A/B of the CUDA plan (packed over the shard) against the CPU's (cut batches)."""
    import entroweight.scorers.base as base
    import entroweight.scorers.cross_tokenizer as cross

    skips = SimpleNamespace(attention_skips_fill=lambda: True)  # a scorer planned over the shard
    with gpu.planned("cut"):
        assert not base.packs_shard_wide(skips) and not cross.packs_shard_wide(skips)
    with gpu.planned("packed"):
        assert base.packs_shard_wide(skips) and cross.packs_shard_wide(skips)
    assert base.packs_shard_wide(skips) and cross.packs_shard_wide(skips)
