"""Hugging Face causal LMs for scoring: a hub id, a local directory, or a `.gguf` file.

A GGUF file is converted once into a plain HF directory (safetensors + tokenizer.json) in a cache
keyed by the file's sha256, so later loads take seconds and the rest of the code sees one format.
Nothing is loaded with `trust_remote_code` unless asked (--trust-remote-code), and model weights are
read from safetensors only unless asked (--allow-pickle). Hub ids are checked (OWNER/NAME) first.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from entroweight.transforms.tokenizer import LoadedTokenizer, load_tokenizer
from entroweight.transforms.writer import sha256_file

# The write-up's large model; downloads need the hub (not available on air-gapped machines).
LLAMA_32_1B = "meta-llama/Llama-3.2-1B"
# what the hub accepts as a model id: OWNER/NAME, no '..' or '--' (so never a path outside the cache)
HUB_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


class ModelLoadError(ValueError):
    """A model that cannot be loaded for scoring; the message says what to do."""


def cache_dir() -> Path:
    root = os.environ.get("ENTROWEIGHT_CACHE") or Path.home() / ".cache" / "entroweight"
    return Path(root)


def resolve_model(spec: str) -> Path | str:
    """A local HF directory (GGUF converted first), or the hub id unchanged."""
    p = Path(spec)
    if p.is_file() and p.suffix == ".gguf":
        return convert_gguf(p)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").exists() and len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        if not (p / "config.json").exists():
            raise ModelLoadError(
                f"{spec} has no config.json; give a Hugging Face model directory, a .gguf file, or a hub id"
            )
        return p
    if p.exists() or spec.startswith((".", "/")):
        raise ModelLoadError(f"{spec} is neither a model directory nor a .gguf file")
    if not HUB_MODEL_RE.match(spec) or ".." in spec or "--" in spec:
        raise ModelLoadError(
            f"{spec!r} is not a model directory, a .gguf file, or a hub id (OWNER/NAME, e.g. {LLAMA_32_1B})"
        )
    return spec  # a hub id such as meta-llama/Llama-3.2-1B


def convert_gguf(path: Path, out: Path | None = None) -> Path:
    """Dequantize a GGUF causal LM into an HF directory (once; cached by sha256)."""
    sha = sha256_file(path)
    out = out or cache_dir() / "gguf" / sha[:16]
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    d, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(d, gguf_file=name)
    # `from_pretrained(gguf_file=...)` needs accelerate; building the model and loading the
    # dequantized tensors ourselves does not.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelLoadError(
            f"{path}: GGUF tensors do not fit the model (missing {missing}, unexpected {unexpected})"
        )
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "entroweight_source.json").write_text(json.dumps({"gguf": str(path), "sha256": sha}) + "\n")
    tmp.replace(out) if not out.exists() else None
    return out


def hub_revision(repo_id: str) -> str | None:
    """The commit sha a hub model's main ref points at (the hub's, else the local cache's when offline),
    pinned in the stage config so that a new upstream revision cannot silently change the scores."""
    from huggingface_hub import HfApi, constants

    try:
        return HfApi().model_info(repo_id).sha
    except (OSError, ValueError):  # offline, or not reachable: what this machine's cache holds
        ref = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "refs" / "main"
        return ref.read_text().strip() if ref.is_file() else None


def model_sha256(resolved: Path | str) -> str | None:
    """sha256 over a local directory's weight files (names and bytes); None for a hub id."""
    if not isinstance(resolved, Path):
        return None
    src = resolved / "entroweight_source.json"
    if src.exists():
        return json.loads(src.read_text())["sha256"]
    h = hashlib.sha256()
    files = sorted(resolved.glob("*.safetensors")) + sorted(resolved.glob("*.bin"))
    for f in files:
        h.update(f.name.encode())
        h.update(bytes.fromhex(sha256_file(f)))
    return h.hexdigest() if files else None


def load_causal_lm(
    resolved: Path | str,
    device: str = "cpu",
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    dtype: str = "fp32",
    revision: str | None = None,
):
    """The model in eval mode, weights in the compute `dtype` (bf16/fp16/fp32: no per-forward re-cast),
    SDPA attention where the model has it. Safetensors only unless `allow_pickle`; a repository's own
    modelling code runs only with `trust_remote_code`."""
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(resolved, Path) and not allow_pickle and not list(resolved.glob("*.safetensors")):
        pickles = [p.name for p in resolved.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        if pickles:
            raise ModelLoadError(
                f"{resolved} holds pickle weights only ({', '.join(sorted(pickles))}), which can run code when "
                "loaded; convert them to safetensors, or pass --allow-pickle if you trust their source"
            )
    try:
        kw = dict(
            dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32),
            use_safetensors=None if allow_pickle else True,
            trust_remote_code=trust_remote_code,
            revision=revision,
        )
        try:
            model = AutoModelForCausalLM.from_pretrained(str(resolved), attn_implementation="sdpa", **kw)
        except ValueError:  # a model without SDPA support: its default attention
            model = AutoModelForCausalLM.from_pretrained(str(resolved), **kw)
    except OSError as e:
        raise ModelLoadError(
            f"cannot load {resolved} ({e}); for a hub id, log in and download it first "
            "(e.g. `hf download meta-llama/Llama-3.2-1B`), or pass a local directory or .gguf file"
        ) from e
    return model.to(device).eval()


def load_options(options: dict) -> dict:
    """The safety switches a scorer's options may carry (both off unless the user asked)."""
    return {k: bool(options.get(k, False)) for k in ("allow_pickle", "trust_remote_code")}


def load_model_tokenizer(resolved: Path | str) -> tuple[LoadedTokenizer, int | None]:
    """The model's tokenizer as a LoadedTokenizer (exact token bytes) and its start token id.

    The start token is what the model sees before the first text token: BOS when the tokenizer
    adds one (Llama 3), else EOS (SmolLM2, GPT-2: their documents are separated by it), as lm-eval does.
    """
    if isinstance(resolved, Path) and (resolved / "tokenizer.json").exists():
        path = resolved / "tokenizer.json"
    else:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(resolved))
        if not getattr(hf, "is_fast", False):
            raise ModelLoadError(f"{resolved} has no fast tokenizer (tokenizer.json): byte offsets need one")
        key = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
        path = cache_dir() / "tokenizers" / key / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        hf.backend_tokenizer.save(str(path))
    tok = load_tokenizer(path)
    return tok, _start_token(resolved, tok)


def _start_token(resolved, tok: LoadedTokenizer) -> int | None:
    cfg = {}
    if isinstance(resolved, Path) and (resolved / "tokenizer_config.json").exists():
        cfg = json.loads((resolved / "tokenizer_config.json").read_text())
    bos = cfg.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    vocab = tok.tokenizer.get_vocab(with_added_tokens=True)
    adds_bos = cfg.get("add_bos_token")
    if adds_bos is None:  # no config: a post-processor that inserts a special means BOS
        enc = tok.tokenizer.encode("a", add_special_tokens=True)
        adds_bos = len(enc.ids) > 1 and enc.special_tokens_mask[0] == 1
        if adds_bos:
            return enc.ids[0]
    if adds_bos and bos in vocab:
        return vocab[bos]
    if tok.bos_id is not None and adds_bos:
        return tok.bos_id
    return tok.eos_id if tok.eos_id is not None else tok.bos_id
