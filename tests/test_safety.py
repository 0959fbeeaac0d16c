"""Safe by default: safetensors only (pickles refused unless --allow-pickle, then weights_only), recorded
sha256 enforced, no remote code unless asked, YAML through the safe loader, outputs confined to the run
directory, hub ids validated. Hostile files here try to leave a marker file: the marker must not appear.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from entroweight.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from entroweight.models.llama import Llama
from entroweight.workflows.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "transforms", "models", "scorers", "pipelines", "trainers", "workflows", "benchmarks")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


class Marker:
    """Unpickling this runs code: it would create the marker file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer_dir):
    torch.manual_seed(0)
    model = Llama(Llama.Config(vocab_size=1024, d_model=32, n_layers=1, n_heads=2, d_ff=64, n_ctx=64))
    out = save_checkpoint(model, "llama", tmp_path_factory.mktemp("ckpt"), n_ctx=64)
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    return out


def pickle_ckpt(ckpt, dst, suffix=".pt", payload=None):
    """The same checkpoint with its weights as a pickle (what torch.save writes) instead of safetensors."""
    shutil.copytree(ckpt, dst)
    model, _ = load_checkpoint(ckpt)
    (dst / "model.safetensors").unlink()
    torch.save(payload if payload is not None else model.state_dict(), dst / f"model{suffix}")
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("weights_sha256")  # a foreign checkpoint records no sha256 of ours
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_whose_sha256_differs_is_refused(ckpt, tmp_path):
    d = shutil.copytree(ckpt, tmp_path / "c")
    blob = bytearray((d / "model.safetensors").read_bytes())
    blob[-3] ^= 0x01  # one bit of one weight: still a valid safetensors file
    (d / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="does not match the sha256 recorded"):
        load_checkpoint(d)
    res = cli("eval-bpb", d, "--max-bytes", 2000, "--device", "cpu")
    assert res.exit_code == 2 and "sha256" in res.output
    res = cli("export-hf", d, "--out", tmp_path / "hf")
    assert (
        res.exit_code == 2 and "sha256" in res.output and not (tmp_path / "hf" / "model.safetensors").exists()
    )


@pytest.mark.parametrize("suffix", [".pt", ".bin", ".pth"])
def test_pickle_checkpoints_are_refused_by_default(ckpt, tmp_path, suffix):
    d = pickle_ckpt(ckpt, tmp_path / "p", suffix)
    with pytest.raises(CheckpointError, match="pickle files.*--allow-pickle"):
        load_checkpoint(d)
    res = cli("eval-bpb", d, "--max-bytes", 2000, "--device", "cpu")
    assert res.exit_code == 2 and "--allow-pickle" in res.output


def test_allow_pickle_loads_with_weights_only(ckpt, tmp_path):
    d = pickle_ckpt(ckpt, tmp_path / "p")
    model, _ = load_checkpoint(d, allow_pickle=True)
    ref, _ = load_checkpoint(ckpt)
    ids = torch.randint(3, 1024, (2, 16))
    torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=0)
    res = cli("eval-bpb", d, "--max-bytes", 2000, "--device", "cpu", "--allow-pickle", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["bpb"] > 0
    res = cli("export-hf", d, "--out", tmp_path / "hf", "--allow-pickle")
    assert res.exit_code == 0 and (tmp_path / "hf" / "model.safetensors").exists()


def test_allow_pickle_still_refuses_code(ckpt, tmp_path):
    marker = tmp_path / "PWNED"
    d = pickle_ckpt(ckpt, tmp_path / "p", payload={"x": Marker(marker)})
    with pytest.raises(CheckpointError, match="weights_only"):
        load_checkpoint(d, allow_pickle=True)
    assert not marker.exists()


def test_score_checkpoint_pickle_needs_the_flag(ckpt, tmp_path, tokenizer_dir):
    """Through `entroweight score --checkpoint`: refused (the shard names why), then loaded with the flag."""
    from entroweight.pipelines import run_stage
    from entroweight.pipelines.tokenize import TokenizeStage

    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"text": f"Doc {i} is short."}) + "\n" for i in range(4))
    )
    tokens = tmp_path / "tokens"
    run_stage(
        TokenizeStage([str(tmp_path / "in.jsonl")], str(tokenizer_dir), n_ctx=64), tokens, progress=False
    )
    d = pickle_ckpt(ckpt, tmp_path / "p")
    cfg = json.loads((d / "config.json").read_text())
    cfg["tokenizer_sha256"] = json.loads((tokens / ".stage.json").read_text())["config"]["tokenizer_sha256"]
    (d / "config.json").write_text(json.dumps(cfg))
    args = ["score", tokens, "--scorer", "causal_loss", "--checkpoint", d, "--dtype", "fp32"]
    res = cli(*args, "--out", tmp_path / "s1")
    assert res.exit_code == 2 and "--allow-pickle" in res.output
    res = cli(*args, "--out", tmp_path / "s2", "--allow-pickle")
    assert res.exit_code == 0, res.output


def test_hf_pickle_weights_refused_and_remote_code_off(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from entroweight.scorers.hf import ModelLoadError, load_causal_lm

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    d = tmp_path / "hf"
    LlamaForCausalLM(cfg).save_pretrained(d)
    sd = {k: v for k, v in LlamaForCausalLM.from_pretrained(d).state_dict().items()}
    (d / "model.safetensors").unlink()
    torch.save(sd, d / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle weights only.*--allow-pickle"):
        load_causal_lm(d)
    assert load_causal_lm(d, allow_pickle=True).config.vocab_size == 64

    # a repository that ships its own modelling code: not run unless trust_remote_code
    remote = tmp_path / "remote"
    remote.mkdir()
    marker = tmp_path / "PWNED"
    (remote / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (remote / "config.json").write_text(
        json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "modeling_evil.EvilConfig"}})
    )
    (remote / "model.safetensors").write_bytes(b"")
    with pytest.raises((ValueError, OSError)):
        load_causal_lm(remote)
    assert not marker.exists()


def test_no_unsafe_loading_in_the_code():
    """A grep guard: no pickle loads, no torch.load without weights_only=True, no unsafe YAML,
    no trust_remote_code=True hard-coded anywhere in the package."""
    bad = []
    patterns = [
        (r"\bpickle\.loads?\(", "pickle.load"),
        (r"\byaml\.(load|unsafe_load|full_load|load_all)\(", "unsafe yaml"),
        (r"trust_remote_code\s*=\s*True", "trust_remote_code=True"),
        (r"\btorch\.load\((?![^)]*weights_only=True)", "torch.load without weights_only=True"),
    ]
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            text = f.read_text()
            for pat, what in patterns:
                if re.search(pat, text):
                    bad.append(f"{f.relative_to(ROOT)}: {what}")
    assert bad == []


# ---------------------------------------------------------------- YAML, output paths, hub ids


def test_yaml_python_tags_are_refused(tmp_path):
    from entroweight.workflows.spec import SpecError, load_workflow

    marker = tmp_path / "PWNED"
    evil = f"run_dir: !!python/object/apply:os.system ['touch {marker}']\nsources: [a.jsonl]\n"
    (tmp_path / "wf.yaml").write_text(evil)
    with pytest.raises(SpecError, match="not valid YAML"):
        load_workflow(tmp_path / "wf.yaml")
    (tmp_path / "model.yaml").write_text(f"d_model: !!python/object/apply:os.system ['touch {marker}']\n")
    res = cli("train", tmp_path, "--model-config", tmp_path / "model.yaml", "--out", tmp_path / "o")
    assert res.exit_code == 2
    assert not marker.exists()


@pytest.mark.parametrize(
    "section, out",
    [
        ("tokenize", "../escape"),
        ("tokenize", "/etc/entroweight"),
        ("tokenize", "a/../../b"),
        ("tokenize", "~/x"),
        ("report", "../report.html"),
    ],
)
def test_output_paths_stay_inside_the_run_directory(section, out):
    from entroweight.workflows.spec import SpecError, parse_workflow

    wf = {"run_dir": "runs/x", "sources": ["a.jsonl"], "tokenizer": {"train": {"vocab_size": 300}}}
    wf[section] = {"out": out}
    with pytest.raises(SpecError, match=f"{section}.out"):
        parse_workflow(wf, "wf.yaml")


@pytest.mark.parametrize(
    "bad", ["hf:../etc", "hf:a/..", "hf:a/b/c", "hf:a--b/c", "hf:owner/name;rm", "hf:/x"]
)
def test_hub_dataset_ids_are_validated(bad):
    from entroweight.transforms.sources import SourceError, parse_hub_id

    with pytest.raises(SourceError, match="not a hub dataset id"):
        parse_hub_id(bad)


@pytest.mark.parametrize(
    "bad", ["owner/name/extra", "owner/na..me", "a--b/c", "owner/name;rm -rf", "x", "~/m"]
)
def test_hub_model_ids_are_validated(bad):
    from entroweight.scorers.hf import ModelLoadError, resolve_model

    with pytest.raises(ModelLoadError):
        resolve_model(bad)
    assert resolve_model("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"


def test_score_refuses_a_bad_model_id_before_any_work(tmp_path, tokenized_dir):
    res = cli(
        "score", tokenized_dir, "--scorer", "causal_loss", "--model", "a/b/../../c", "--out", tmp_path / "o"
    )
    assert res.exit_code == 2 and "hub id" in res.output
    assert not (tmp_path / "o").exists()
    assert os.listdir(tmp_path) == []
