"""Hugging Face causal LMs for scoring: a hub id, a local directory, or a `.gguf` file.

A GGUF file is converted once into a plain HF directory (safetensors + tokenizer.json) in a cache
keyed by the file's sha256, so later loads take seconds and the rest of the code sees one format.
Nothing is loaded with `trust_remote_code` unless asked (--trust-remote-code), and model weights are
read from safetensors only unless asked (--allow-pickle). Hub ids are checked (OWNER/NAME) first.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import NamedTuple

from filelock import FileLock
from safetensors import SafetensorError

from entroweight import storage
from entroweight.models.checkpoint import plain_mode
from entroweight.schemas.tokenizer import TOKENIZER_FILE
from entroweight.transforms.tokenizer import LoadedTokenizer, load_tokenizer
from entroweight.transforms.writer import TMP_MARK, sha256_file, write_text_atomic

# The write-up's large model; downloads need the hub (not available on air-gapped machines).
LLAMA_32_1B = "meta-llama/Llama-3.2-1B"
# what the hub accepts as a model id: OWNER/NAME, no '..' or '--' (so never a path outside the cache)
HUB_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


class ModelLoadError(ValueError):
    """A model that cannot be loaded for scoring; the message says what to do."""


# what a GGUF conversion records of itself: the file, its sha256, and the files written (name -> size)
SOURCE_FILE = "entroweight_source.json"


def cache_dir() -> Path:
    """Converted GGUF models (~500 MB each) and model tokenizers: $ENTROWEIGHT_CACHE, else
    ~/.cache/entroweight (docs/models.md)."""
    root = os.environ.get("ENTROWEIGHT_CACHE") or Path.home() / ".cache" / "entroweight"
    return Path(root)


def gguf_file(spec: str) -> Path | None:
    """The .gguf file a model spec names (the file, or a directory holding one and no config.json)."""
    p = Path(spec)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").exists():
        ggufs = sorted(p.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None


@functools.lru_cache(maxsize=16)
def _gguf_sha256(path: Path, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def gguf_sha256(path: Path) -> str:
    """The sha256 of a GGUF file (its identity in the stage config and the conversion's cache key),
    hashed once per process while the file is unchanged."""
    st = path.stat()
    return _gguf_sha256(path.resolve(), st.st_size, st.st_mtime_ns)


def gguf_conversion(path: Path) -> Path | None:
    """The HF directory this GGUF was already converted into, or None (nothing is converted here)."""
    out = cache_dir() / "gguf" / gguf_sha256(path)[:16]
    return out if _converted(out) else None


def gguf_tokenizer(path: Path) -> Path:
    """The tokenizer.json of a GGUF model: its conversion's when there is one, else read from the
    file's metadata alone (no tensor is dequantized; the same bytes the conversion writes)."""
    done = gguf_conversion(path)
    if done is not None:
        return done / TOKENIZER_FILE
    out = cache_dir() / "gguf-tokenizers" / gguf_sha256(path)[:16] / TOKENIZER_FILE
    if not out.exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        write_text_atomic(tok.backend_tokenizer.to_str(pretty=True), out)  # parallel runs: whole or absent
    return out


def gguf_vocab_size(path: Path) -> int | None:
    """The vocabulary of a GGUF model, from its conversion's config or the file's metadata."""
    from transformers import AutoConfig

    done = gguf_conversion(path)
    if done is not None:
        return json.loads((done / "config.json").read_text()).get("vocab_size")
    return getattr(AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name), "vocab_size", None)


def resolve_model(spec: str) -> Path | str:
    """A local HF directory (GGUF converted first), or the hub id unchanged."""
    if storage.blank(spec):
        raise ModelLoadError(
            "the model is empty (an unset variable?): give a Hugging Face model directory, a .gguf file, or a hub id"
        )
    p = Path(spec)
    gguf = gguf_file(spec)
    if gguf is not None:
        return convert_gguf(gguf)
    if p.is_dir():
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


def _converted(out: Path) -> bool:
    """Whether `out` holds a whole conversion: its files as `_convert` recorded them (a file cut or
    removed since, by a full disk or by hand, makes it convert again, not fail to load)."""
    if not ((out / "config.json").exists() and (out / TOKENIZER_FILE).exists()):
        return False
    try:
        files = json.loads((out / SOURCE_FILE).read_text()).get("files", {})
    except (OSError, ValueError):
        return False
    return all((out / name).is_file() and (out / name).stat().st_size == size for name, size in files.items())


def convert_gguf(path: Path, out: Path | None = None) -> Path:
    """Dequantize a GGUF causal LM into an HF directory (once; cached by sha256 under ENTROWEIGHT_CACHE).

    Concurrent conversions of one file (workers, parallel runs) are safe: one converts under a file
    lock while the others wait and then find it done; the directory is built under a unique temp
    name and renamed into place whole, so no reader ever sees half of it."""
    sha = gguf_sha256(path)
    out = out or cache_dir() / "gguf" / sha[:16]
    if _converted(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.with_name(out.name + ".lock"))):
        if _converted(out):  # another process converted it while this one waited
            return out
        for stale in out.parent.glob(f"{out.name}{TMP_MARK}*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out.with_name(f"{out.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
        try:
            _convert(path, sha, tmp)
            shutil.rmtree(out, ignore_errors=True)  # a partial directory of an older, unlocked version
            tmp.replace(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(path: Path, sha: str, tmp: Path) -> None:
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
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
    record = {"gguf": str(path), "sha256": sha, "files": files}
    (tmp / SOURCE_FILE).write_text(json.dumps(record) + "\n")
    for f in tmp.rglob("*"):
        if f.is_file():
            plain_mode(f)  # safetensors leaves 0600


def hub_revision(repo_id: str) -> str | None:
    """The commit sha a hub model's main ref points at (the hub's, else the local cache's when offline),
    pinned in the stage config so that a new upstream revision cannot silently change the scores."""
    from huggingface_hub import HfApi, constants

    try:
        return HfApi().model_info(repo_id).sha
    # offline, or not reachable (the hub client's HTTP errors are its own, not OSError): what this
    # machine's cache holds; with nothing cached, loading the model says so
    except Exception:
        ref = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "refs" / "main"
        return ref.read_text().strip() if ref.is_file() else None


def model_sha256(resolved: Path | str) -> str | None:
    """sha256 over a local directory's weight files (names and bytes); None for a hub id."""
    if not isinstance(resolved, Path):
        return None
    src = resolved / SOURCE_FILE
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
        why = " ".join(str(e).split())  # transformers' reasons run over several lines: the refusal is one
        raise ModelLoadError(
            f"cannot load {resolved} ({why}); for a hub id, log in and download it first "
            "(e.g. `hf download meta-llama/Llama-3.2-1B`), or pass a local directory or .gguf file"
        ) from e
    except SafetensorError as e:  # a weight file cut short or overwritten
        converted = isinstance(resolved, Path) and (resolved / SOURCE_FILE).exists()
        again = "remove this conversion of a .gguf file: it is made again" if converted else "copy it again"
        raise ModelLoadError(f"cannot load {resolved}: a weight file is damaged ({e}); {again}") from e
    return model.to(device).eval()


def load_options(options: dict) -> dict:
    """The safety switches a scorer's options may carry (both off unless the user asked)."""
    return {k: bool(options.get(k, False)) for k in ("allow_pickle", "trust_remote_code")}


class StartToken(NamedTuple):
    """The token a model reads before the first text token, and where that choice came from."""

    id: int | None
    token: str | None
    source: str  # post_processor | add_bos_token | fallback: ...

    def as_dict(self) -> dict:
        return {"id": self.id, "token": self.token, "source": self.source}


def load_model_tokenizer(
    resolved: Path | str, revision: str | None = None
) -> tuple[LoadedTokenizer, int | None]:
    """The model's tokenizer as a LoadedTokenizer (exact token bytes) and its start token id
    (`start_token`)."""
    tok = model_tokenizer(resolved, revision)
    return tok, start_token(resolved, tok).id


# What a model directory's tokenizer is saved as (transformers' file names): a fast tokenizer's JSON,
# a SentencePiece model, or a BPE's vocabulary and merges.
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def require_tokenizer_file(resolved: Path | str) -> None:
    """Refuse a local model directory that holds none of TOKENIZER_FILES, before transformers tries
    (and asks to install sentencepiece). A hub id (str) is left to the hub."""
    if not isinstance(resolved, Path) or not resolved.is_dir():
        return
    if any(all((resolved / f).is_file() for f in group) for group in TOKENIZER_FILES):
        return
    expects = ", or ".join(" + ".join(group) for group in TOKENIZER_FILES)
    raise ModelLoadError(
        f"{resolved} has no tokenizer file (expects {expects}); save the model's tokenizer beside it "
        "(tokenizer.save_pretrained(DIR))"
    )


def model_tokenizer(resolved: Path | str, revision: str | None = None) -> LoadedTokenizer:
    """The model's fast tokenizer; a hub model's at `revision` (the commit its weights are pinned to,
    so a new upstream tokenizer cannot change the alignment either)."""
    if isinstance(resolved, Path) and (resolved / TOKENIZER_FILE).exists():
        path = resolved / TOKENIZER_FILE
    else:
        require_tokenizer_file(resolved)
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(resolved), revision=revision)
        if not getattr(hf, "is_fast", False):
            raise ModelLoadError(f"{resolved} has no fast tokenizer (tokenizer.json): byte offsets need one")
        key = hashlib.sha256(f"{resolved}@{revision}".encode()).hexdigest()[:16]
        path = cache_dir() / "tokenizers" / key / TOKENIZER_FILE
        write_text_atomic(
            hf.backend_tokenizer.to_str(pretty=True), path
        )  # parallel workers: never half a file
    return load_tokenizer(path)


def start_token(resolved: Path | str | None, tok: LoadedTokenizer) -> StartToken:
    """What the model reads before a text, from what the model declares, in this order:

    1. its tokenizer's post-processor inserts a special token before the text (Llama 3's
       `<|begin_of_text|>` in the hub's tokenizer.json): that token;
    2. its tokenizer_config.json says `add_bos_token: true`: its `bos_token` (or config.json's
       `bos_token_id`);
    3. it declares none (no such post-processor, no `add_bos_token`, e.g. a bare tokenizer.json or
       SmolLM2, whose `bos_token_id` is the chat turn's `<|im_start|>` and is never added to text):
       the documented fallback, the vocabulary's begin-of-text token by name (`<|begin_of_text|>`,
       `<s>`, ...: schemas/tokenizer.py BOS_CANDIDATES) if it has one, else its end-of-text token
       (`<|endoftext|>`, `</s>`, ...), which separates documents in such models' pretraining data.
    None when the vocabulary has neither.
    """
    vocab = tok.tokenizer.get_vocab(with_added_tokens=True)
    name = tok.tokenizer.id_to_token
    enc = tok.tokenizer.encode("a", add_special_tokens=True)
    if len(enc.ids) > 1 and enc.special_tokens_mask[0] == 1:
        return StartToken(enc.ids[0], name(enc.ids[0]), "post_processor")
    cfg, model_cfg = {}, {}
    if isinstance(resolved, Path):
        for file, into in (("tokenizer_config.json", cfg), ("config.json", model_cfg)):
            if (resolved / file).exists():
                into.update(json.loads((resolved / file).read_text()))
    if cfg.get("add_bos_token"):
        bos = cfg.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        bos_id = vocab.get(bos) if bos is not None else model_cfg.get("bos_token_id")
        if isinstance(bos_id, int):
            return StartToken(bos_id, name(bos_id), "add_bos_token")
    if tok.bos_id is not None:
        return StartToken(tok.bos_id, name(tok.bos_id), "fallback: begin-of-text token by name")
    if tok.eos_id is not None:
        return StartToken(tok.eos_id, name(tok.eos_id), "fallback: end-of-text token by name")
    return StartToken(None, None, "fallback: none in the vocabulary")


# model types whose attention reads packed rows from `position_ids` alone (transformers' masking
# utilities turn restarting positions into block-diagonal attention); others are scored row by row
PACKING_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def packs(model) -> bool:
    """Whether `model` may be handed several rows in one sequence (scorers/forward.py
    `hf_packed_losses`): one of transformers' own models of a type known to read them, with a
    transformers that infers the rows from `position_ids`."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return False
    own = type(model).__module__.startswith("transformers.models.")
    return own and getattr(model.config, "model_type", None) in PACKING_MODEL_TYPES


def attention_skips_fill(model) -> bool:
    """Whether `model`'s attention over packed rows skips what lies outside each row: a varlen flash
    kernel or FlexAttention's block mask. SDPA, which `load_causal_lm` asks for, computes a sequence's
    whole causal square under transformers' block-diagonal mask (`base.packs_shard_wide`)."""
    impl = getattr(model.config, "_attn_implementation", None) or ""
    return "flash" in impl or impl == "flex_attention"
