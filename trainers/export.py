"""Export a llama checkpoint as a Hugging Face `LlamaForCausalLM` directory (for lm-eval and friends).

Our Llama uses HF's parameter names under `model.` and the same rotate-half RoPE, so the weights
copy over unchanged; the test holds the logits to 1e-4.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from entroweight import __version__
from entroweight.models.checkpoint import (
    CheckpointError,
    a_model_of,
    load_checkpoint,
    made_from,
    plain_mode,
)
from entroweight.schemas.tokenizer import BOS_CANDIDATES, EOS_CANDIDATES, PAD_CANDIDATES

from .bpb import checkpoint_tokenizer
from .outputs import EXPORT_HF_MARK

# each HF special role, found by the names tokenize finds it by (its pad and eos are the data's)
SPECIALS = {"pad_token": PAD_CANDIDATES, "bos_token": BOS_CANDIDATES, "eos_token": EOS_CANDIDATES}


def hf_config(c, specials: dict[str, int]):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.d_ff,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads or c.n_heads,
        head_dim=c.d_model // c.n_heads,
        max_position_embeddings=c.n_ctx,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        pad_token_id=specials.get("pad_token"),
        bos_token_id=specials.get("bos_token"),
        eos_token_id=specials.get("eos_token"),
    )


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        out[k if k.startswith("lm_head.") else f"model.{k}"] = v
    return out


def export_hf(ckpt_dir, out_dir, tokenizer=None, allow_pickle: bool = False) -> Path:
    """Write config.json, model.safetensors and tokenizer files of a LlamaForCausalLM to `out_dir`."""
    return write_hf(HFExport(ckpt_dir, tokenizer, allow_pickle), out_dir)


class HFExport:
    """A checkpoint read, checked and mapped onto a LlamaForCausalLM, before anything is written
    (CheckpointError, ValueError: not llama, weights or a tokenizer that do not fit): a command
    clears its --out only for an export that can be made. `tokenizer_sha256`: the tokenizer written."""

    def __init__(self, ckpt_dir, tokenizer=None, allow_pickle: bool = False):
        from transformers import LlamaForCausalLM

        self.ckpt_dir = ckpt_dir
        model, config = load_checkpoint(ckpt_dir, allow_pickle=allow_pickle)
        if config["kind"] != "llama":
            raise CheckpointError(
                f"{ckpt_dir} holds {a_model_of(config['kind'])}; only llama checkpoints export to LlamaForCausalLM"
            )
        self.tok = checkpoint_tokenizer(ckpt_dir, tokenizer, config.get("tokenizer_sha256"))
        self.tokenizer_sha256 = hashlib.sha256(self.tok.to_str().encode()).hexdigest()
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.specials = {}
        for role, names in SPECIALS.items():
            name = next((n for n in names if n in vocab), None)
            if name is not None:
                self.specials[role] = name
        self.n_ctx = model.config.n_ctx
        self.hf = LlamaForCausalLM(hf_config(model.config, {k: vocab[v] for k, v in self.specials.items()}))
        missing, unexpected = self.hf.load_state_dict(hf_state_dict(model), strict=False)
        missing = [k for k in missing if not (model.config.tie_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise CheckpointError(
                f"weights do not map onto LlamaForCausalLM: missing {missing}, unexpected {unexpected}"
            )


def write_hf(export: HFExport, out_dir) -> Path:
    """Write the checked export's files into `out_dir`: config.json, model.safetensors, the tokenizer."""
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mark = {**made_from(export.ckpt_dir), "code_version": __version__}
    (out / EXPORT_HF_MARK).write_text(json.dumps(mark, indent=2) + "\n")  # first: a stopped export is ours
    export.hf.eval().save_pretrained(out, safe_serialization=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=export.tok, model_max_length=export.n_ctx, **export.specials
    )
    fast.save_pretrained(out)
    for f in out.iterdir():
        if f.is_file():
            plain_mode(f)  # safetensors leaves 0600: lm-eval may run as another user of the group
    return out
