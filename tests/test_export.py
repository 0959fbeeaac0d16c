# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""HF export parity (logits within 1e-4) and eval-bpb against an independent computation with the
exported LlamaForCausalLM; the acceptance run (BPB below the unigram baseline) is slow-marked."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner
from test_trainer_fixtures import TINY, one_thread, tiny_ckpt, weighted_dir  # noqa: F401 - fixtures

from entroweight.models.checkpoint import load_checkpoint, save_checkpoint
from entroweight.models.llama import Llama
from entroweight.trainers.bpb import eval_bpb, unigram_bpb, windows
from entroweight.trainers.export import export_hf

MAX_BYTES = 12_000


@pytest.fixture(scope="module")
def hf_dir(tiny_ckpt, tmp_path_factory):
    return export_hf(tiny_ckpt, tmp_path_factory.mktemp("hf"))


def test_export_logits_match(tiny_ckpt, hf_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    ours, _ = load_checkpoint(tiny_ckpt)
    hf = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    x = torch.randint(0, 1024, (3, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max().item() < 1e-4
    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|eos|>" and tok.pad_token_id == 0
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 2


@pytest.mark.parametrize("extra", [{"tie_embeddings": True, "n_kv_heads": 1, "rope_theta": 500000.0}])
def test_export_tied_gqa_variant(tiny_ckpt, tmp_path, extra):
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    model = Llama(Llama.Config(vocab_size=1024, n_ctx=128, **TINY, **extra))
    ck = tmp_path / "ck"
    save_checkpoint(model, "llama", ck)
    shutil.copy(tiny_ckpt / "tokenizer.json", ck / "tokenizer.json")
    hf = LlamaForCausalLM.from_pretrained(export_hf(ck, tmp_path / "hf")).eval()
    x = torch.randint(0, 1024, (2, 100))
    with torch.no_grad():
        assert (model.eval()(x) - hf(x).logits).abs().max().item() < 1e-4


def test_windows_score_every_target_once():
    for n, ctx, stride in [(1, 8, 4), (2, 8, 4), (8, 8, 4), (9, 8, 4), (50, 8, 3), (50, 8, 8), (17, 8, 1)]:
        scored = [t for b, e, first in windows(n, ctx, stride) for t in range(first, e) if e - b <= ctx]
        assert scored == list(range(1, n)), (n, ctx, stride)


def test_eval_bpb_equals_hf_computation(tiny_ckpt, hf_dir, wikitext_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    n_ctx, stride = 128, 48
    res = eval_bpb(tiny_ckpt, wikitext_path, n_ctx=n_ctx, stride=stride, max_bytes=MAX_BYTES)
    text = wikitext_path.read_bytes()[:MAX_BYTES].decode("utf-8", errors="ignore")
    assert res["bytes"] == len(text.encode("utf-8"))

    # independently: the HF perplexity recipe (labels -100 on context) with the exported model
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.tensor([[tok.eos_token_id, *tok(text, add_special_tokens=False).input_ids]])
    nats, prev_end, n = 0.0, 0, ids.shape[1]
    for begin in range(0, n, stride):
        end = min(begin + n_ctx, n)
        trg = end - prev_end
        x = ids[:, begin:end]
        labels = x.clone()
        labels[:, :-trg] = -100
        with torch.no_grad():
            out = model(x, labels=labels)
        k = (labels[:, 1:] != -100).sum().item()
        nats += out.loss.item() * k
        prev_end = end
        if end == n:
            break
    assert res["tokens"] == n - 1
    assert res["nats"] == pytest.approx(nats, rel=1e-5)
    assert res["bpb"] == pytest.approx(nats / (math.log(2) * len(text.encode("utf-8"))), rel=1e-5)


def test_cli_eval_bpb_and_export(tiny_ckpt, weighted_dir, tmp_path):
    from entroweight.workflows.cli.main import main

    r = CliRunner().invoke(main, ["eval-bpb", str(tiny_ckpt), "--max-bytes", "4000", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["bytes"] == 4000 and 0 < res["bpb"] < 20 and res["n_ctx"] == 128 and res["stride"] == 64
    r = CliRunner().invoke(main, ["export-hf", str(tiny_ckpt), "--out", str(tmp_path / "hf")])
    assert r.exit_code == 0 and (tmp_path / "hf" / "model.safetensors").is_file(), r.output
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("model.safetensors", "config.json"):
        shutil.copy(tiny_ckpt / f, bare / f)
    r = CliRunner().invoke(main, ["eval-bpb", str(bare), "--max-bytes", "4000"])
    assert r.exit_code == 2 and "pass --tokenizer" in r.output


def test_the_unigram_baseline_refuses_data_of_another_tokenizer(tiny_ckpt, tokenized_dir, tmp_path):
    """`eval-bpb --unigram DATA` counts DATA's ids as tokens of the checkpoint's tokenizer: data of
    another tokenizer (its ids other tokens) is refused naming both, not counted into a wrong baseline."""
    from stagecopy import stage_subset

    from entroweight.schemas.arrow import METADATA_KEY
    from entroweight.workflows.cli.main import main

    def other_tokenizer(t):
        meta = json.loads(t.schema.metadata[METADATA_KEY])
        return t.replace_schema_metadata({METADATA_KEY: json.dumps({**meta, "tokenizer_sha256": "f" * 64})})

    other = stage_subset(tokenized_dir, tmp_path / "other", edit=other_tokenizer)
    args = ["eval-bpb", str(tiny_ckpt), "--max-bytes", "4000", "--json", "--unigram"]
    r = CliRunner().invoke(main, [*args, str(other)])
    assert r.exit_code == 2 and "ffffffffffff" in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(main, [*args, str(tokenized_dir)])
    assert r.exit_code == 0 and json.loads(r.output)["unigram_bpb"] > 0, r.output


@pytest.mark.slow
def test_acceptance_tiny_model_beats_unigram_on_wikitext(
    tokenized_dir, tokenizer_dir, wikitext_path, tmp_path
):
    """A few hundred steps on the bundled C4 sample: WikiText BPB clearly below the unigram baseline."""
    from entroweight.trainers import TrainConfig, train

    out = tmp_path / "accept"
    train(
        TrainConfig(
            data=str(tokenized_dir),
            out=str(out),
            # 2 layers: the same 3.36 BPB as 4 here (unigram 3.83), in 44 s against 79
            model_config={"d_model": 128, "n_layers": 2, "n_heads": 4, "d_ff": 384},
            tokenizer=str(tokenizer_dir),
            steps=300,
            batch_size=16,
            lr=3e-3,
            quiet=True,
        )
    )
    model_bpb = eval_bpb(out, wikitext_path, max_bytes=300_000)["bpb"]
    base = unigram_bpb(tokenized_dir, tokenizer_dir, wikitext_path, max_bytes=300_000)["bpb"]
    print(f"WikiText BPB: model {model_bpb:.4f}, unigram {base:.4f}")
    assert model_bpb < base - 0.3
