"""`make bench-gpu`: every model-based scorer through the real score stage with a 1B-class model, on an
accelerator: real tokens/s, MFU, the ratio to its packed limit, and where the time goes (issue 29, item 4).

Usage, from the repository root (benchmarks/ is checkout-only):

    python -m benchmarks.gpu                      # CUDA: Llama-3.2-1B-shaped models, fp32 and bf16
    python -m benchmarks.gpu --tiny --device cpu  # the same flow with tiny models (the test runs this)
    python -m benchmarks.gpu --only causal_ours occlusion --dtypes bf16 --out bench-out/gpu

Nothing is downloaded and nothing is installed: the models are random-init (speed does not depend on the
weights), built here in the shapes of Llama-3.2-1B and saved as real checkpoints (ours through
models/checkpoint.py, the HF one with `save_pretrained`); the text is the bundled C4 sample, repeated
with each copy rotated so that no two documents are equal (decomposition dedups equal windows).

For every scorer case and dtype, through the stage's public entry point (`ScoreStage` + `run_stage`,
the local engine, as `entroweight score` runs it; the model loaded and warmed on a small shard first):

- **real tok/s**: real (non-pad) data tokens of the shard / seconds of `run_stage` (read -> batch ->
  forward -> weigh -> write -> manifest);
- **limit tok/s**: the same model (loaded with the public loaders, same dtype and device) over the same
  real tokens packed into full rows of the data's width, no pads, batches of the same token budget,
  logits formed by the head in chunks, no loss. For occlusion, what it needs: encoder, the baseline's
  decoder and one head over the real tokens packed, and the decoder with each row's own embedding
  over the padded rows (the embedding enters before the pads: their states are the row's own, no
  layout shares them); decomposition: one full window per real token (its own
  limit); two_model: one long and one short window per real token; excess_loss: both models;
  cross_tokenizer: the model tokens its windows read (each text's, after its start token; a later
  window of a long text reads `context - stride` tokens again as context, by definition: the same
  tokens as `make bench`'s limit; until 2026-11-28 the text's tokens alone, which left that context
  out of the limit). **ratio** = real tok/s / limit tok/s;
- **MFU** = FLOPs of that limit / seconds / peak. FLOPs per token of a llama forward over rows of W
  tokens: 2·P + 2·L·W·d, P the matmul weights (attention, MLP and the head; not the embedding
  lookup), L layers, d the attention width (causal QKᵀ and AV: 2·W·d per layer per token on
  average). Peak: H100/H200 SXM dense, bf16 989 TFLOP/s, fp32 67 TFLOP/s (no TF32: torch's default
  `float32_matmul_precision` is "highest"); `--peak-bf16`/`--peak-fp32` for other devices;
- **where the time goes**: the device's busy time (the union of its kernels and copies, from
  torch.profiler's CUDA activity) over the wall time; and, sampled every 5 ms from the Python stacks,
  what the host's main thread was doing (reading/stage, batching/packing, decode-encode-align for
  cross_tokenizer, launching model kernels, waiting on a device sync, waiting on the writer) and how
  busy the writer and batch-prefetch threads were. A device busy far below 100 % with the main thread
  outside "sync" is a host bottleneck. In results.json also: the seconds outside the device's span
  (before its first kernel and after its last: a shard's fixed costs), device seconds by kernel kind
  (gemm, attention, reduce, elementwise, copy: `KERNEL_KINDS`) and the longest kernels, for the path
  and for its limit, so that what a path computes beyond its limit shows by kind.

Writes `<out>/results.json` (machine + every record, after each one, so a run cut short keeps what it
measured) and `<out>/results.md` (the tables).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import json
import linecache
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from .common import REPO, bench_threads, c4_texts

# -- sizes

LLAMA_1B = dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, rope_theta=500000.0)
LLAMA_TINY = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, rope_theta=10000.0)


@dataclass
class Size:
    name: str
    llama: dict  # our llama (and the HF model's shape)
    encoder: dict  # the estimator's encoder (a llama); its decoder is `llama`
    vocab: int | None  # None: the Llama 3.2 tokenizer (128,256 ids); else a BPE of this size trained here
    data_vocab: int  # the data tokenizer of cross_tokenizer (a BPE trained on C4, as `make bench`)
    n_ctx: int  # the data width (left-padded rows)
    n_win: int  # the window scorers' model width (decomposition, two_model, grad_input)
    budget: dict  # dtype -> --batch-tokens (fp32 runs ~15x slower: a quarter of the tokens keeps the
    # device as busy, and its small shard makes several batches, as a real shard does, not one)
    docs: dict  # dtype -> documents of the main shard (rows: more, long documents are split)
    win_docs: dict  # dtype -> documents of the window scorers' shard
    warm_docs: int  # the warm-up shard


SIZES = {
    "1b": Size(
        "1b",
        LLAMA_1B,
        dict(d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, d_ff=4096),
        None,
        8000,
        512,
        64,
        {"bf16": 65536, "fp32": 16384},
        {"bf16": 768, "fp32": 96},
        {"bf16": 4, "fp32": 1},
        32,
    ),
    "tiny": Size(
        "tiny",
        LLAMA_TINY,
        dict(d_model=32, n_layers=1, n_heads=2, d_ff=64),
        1024,
        512,
        128,
        16,
        {"bf16": 2048, "fp32": 2048},
        {"bf16": 6, "fp32": 6},
        {"bf16": 1, "fp32": 1},
        2,
    ),
}

# dense peak FLOP/s by device name: (bf16, fp32 without TF32)
PEAKS = {
    "H100 PCIe": (756e12, 51e12),
    "H100": (989e12, 67e12),
    "H200": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
}


# -- the cases


@dataclass
class Case:
    key: str
    label: str
    scorer: str
    options: dict  # option -> model key (a path is filled in), or a literal under "literal"
    data: str  # "main" (data width, model tokenizer), "cross" (data width, 8k BPE), "win" (window width)
    limit: str  # how its packed limit is run: llama | hf | estimator | windows | windows2 | both | none
    literal: dict = field(default_factory=dict)


CASES = [
    Case("causal_ours", "causal_loss, our llama (attends to pads)", "causal_loss", {"checkpoint": "ours"}, "main", "llama"),
    Case("causal_masked", "causal_loss, our llama, mask_pads", "causal_loss", {"checkpoint": "ours_masked"}, "main", "llama"),
    Case("causal_hf", "causal_loss, HF LlamaForCausalLM", "causal_loss", {"model": "hf"}, "main", "hf"),
    Case("cross_tokenizer", "cross_tokenizer, HF on 8k-BPE data", "cross_tokenizer", {"model": "hf"}, "cross", "hf_text"),
    Case("occlusion", "occlusion, estimator (1B decoder)", "occlusion", {"checkpoint": "est"}, "main", "estimator"),
    Case("decomposition", "decomposition, our llama", "decomposition", {"checkpoint": "ours_win"}, "win", "windows"),
    Case("excess_loss", "excess_loss, ours vs HF reference", "excess_loss", {"checkpoint": "ours", "reference": "hf"}, "main", "both"),
    Case("two_model", "two_model, our llama N and N-1", "two_model", {"checkpoint": "ours_win", "checkpoint_short": "ours_win1"}, "win", "windows2"),
    Case("grad_input", "grad_input, estimator", "grad_input", {"checkpoint": "est_win"}, "win", "none"),
]  # fmt: skip


# -- corpus, tokenizers, models


def llama32_tokenizer(out: Path) -> Path:
    """The bundled Llama 3 tokenizer with Llama 3.2's 256 special tokens (128,256 ids; the pad is
    <|finetune_right_pad_id|>, id 128004), which the tokenize stage needs."""
    from entroweight.transforms.train_tokenizer import DEFAULT_BASE

    d = json.loads((Path(DEFAULT_BASE) / "tokenizer.json").read_text())
    named = {128004: "<|finetune_right_pad_id|>", 128006: "<|start_header_id|>", 128007: "<|end_header_id|>",
             128008: "<|eom_id|>", 128009: "<|eot_id|>", 128010: "<|python_tag|>"}  # fmt: skip
    have, r = {t["id"] for t in d["added_tokens"]}, 0
    for i in range(128002, 128256):
        if i in have:
            continue
        if i in named:
            name = named[i]
        else:
            name, r = f"<|reserved_special_token_{r}|>", r + 1
        d["added_tokens"].append(
            dict(
                id=i,
                content=name,
                single_word=False,
                lstrip=False,
                rstrip=False,
                normalized=False,
                special=True,
            )
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(d))
    return out


def bpe(out: Path, vocab: int, texts: list[str]) -> Path:
    from entroweight.transforms.train_tokenizer import DEFAULT_BASE, save_tokenizer, train_bpe

    save_tokenizer(train_bpe(texts, vocab, DEFAULT_BASE), out)
    return out


def documents(n: int) -> list[str]:
    """n documents from the C4 sample; copy k of a text is rotated at a word boundary (and marked
    if that still repeats a document), so no two are equal."""
    texts, out, seen = c4_texts(), [], set()
    for i in range(n):
        t, k = texts[i % len(texts)], i // len(texts)
        if k:
            spaces = [j for j, ch in enumerate(t) if ch == " "]
            if spaces:
                cut = spaces[k * 7919 % len(spaces)]
                t = t[cut + 1 :] + " " + t[:cut]
            if t in seen:
                t = f"{t} ({k})"
        seen.add(t)
        out.append(t)
    return out


def corpus(work: Path, tok: Path, n_ctx: int, docs: int, tag: str) -> Path:
    """A tokenized directory of `docs` documents at n_ctx (one shard; long documents are split)."""
    from entroweight.pipelines import run_stage
    from entroweight.pipelines.tokenize import TokenizeStage

    from .common import write_jsonl_gz

    src = work / f"docs-{tag}.jsonl.gz"
    write_jsonl_gz(src, documents(docs))
    out = work / f"data-{tag}"
    run_stage(TokenizeStage([str(src)], str(tok), n_ctx=n_ctx), out, progress=False)
    return out


def build_models(work: Path, size: Size, tok: Path, device: str) -> dict[str, str]:
    """Random-init checkpoints in the size's shapes, saved in bf16 (half the disk; loaded in either
    dtype). Variants of one model hold its weights under another config (`variant`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from entroweight.models.checkpoint import save_checkpoint
    from entroweight.models.estimator import EntropyEstimator
    from entroweight.models.llama import Llama
    from entroweight.transforms.tokenizer import load_tokenizer

    loaded = load_tokenizer(tok)
    vocab, sha, pad = loaded.vocab_size, loaded.sha256, loaded.pad_id
    where = torch.device(device if device.startswith("cuda") else "cpu")
    torch.manual_seed(0)
    models = {}

    def save(model, kind, name, n_ctx):
        model = model.to(torch.bfloat16)
        models[name] = str(
            save_checkpoint(model, kind, work / name, tokenizer_sha256=sha, n_ctx=n_ctx, pad_id=pad)
        )

    def variant(src, name, **changes):
        """The same weights under another model config (n_ctx, mask_pads), saved as such: a checkpoint
        records the config its weights were saved as, and a config.json edited after is refused."""
        from entroweight.models import build_model
        from entroweight.models.checkpoint import load_checkpoint

        model, cfg = load_checkpoint(models[src])
        with where:
            other = build_model(cfg["kind"], {**cfg["model"], **changes})
        other.load_state_dict(model.state_dict())
        del model
        save(other, cfg["kind"], name, changes.get("n_ctx", cfg["n_ctx"]))

    with where:
        ours = Llama(Llama.Config(vocab_size=vocab, n_ctx=size.n_ctx, tie_embeddings=True, **size.llama))
    save(ours, "llama", "ours", size.n_ctx)
    del ours
    variant("ours", "ours_masked", mask_pads=True)
    variant("ours", "ours_win", n_ctx=size.n_win)
    variant("ours", "ours_win1", n_ctx=size.n_win - 1)
    dec = {k: v for k, v in size.llama.items()}
    with where:
        est = EntropyEstimator(
            EntropyEstimator.Config(
                vocab_size=vocab, n_ctx=size.n_ctx, injection="token", encoder="llama", decoder="llama",
                encoder_config=size.encoder, decoder_config=dec, compression=4, noise="none",
            )
        )  # fmt: skip
    save(est, "estimator", "est", size.n_ctx)
    del est
    variant("est", "est_win", n_ctx=size.n_win)
    ll = size.llama
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=ll["d_model"], intermediate_size=ll["d_ff"], num_hidden_layers=ll["n_layers"],
        num_attention_heads=ll["n_heads"], num_key_value_heads=ll["n_kv_heads"], max_position_embeddings=2048,
        rope_theta=ll["rope_theta"], tie_word_embeddings=True, bos_token_id=loaded.bos_id, eos_token_id=loaded.eos_id,
    )  # fmt: skip
    with where:
        hf = LlamaForCausalLM(cfg)
    hf.to(torch.bfloat16).save_pretrained(work / "hf")
    del hf
    shutil.copy(tok / "tokenizer.json", work / "hf" / "tokenizer.json")
    models["hf"] = str(work / "hf")
    gc.collect()
    return models


# -- FLOPs and the packed limits


def llama_flops(c: dict, vocab: int, width: int, head: bool = True) -> float:
    """Forward FLOPs per token of a llama over rows of `width` tokens (module doc)."""
    d, L, h, ff = c["d_model"], c["n_layers"], c["n_heads"], c.get("d_ff", 4 * c["d_model"])
    kv = (c.get("n_kv_heads") or h) * (d // h)
    per_layer = 2 * (2 * d * d + 2 * d * kv + 3 * d * ff) + 2 * width * d
    return L * per_layer + (2 * d * vocab if head else 0)


def case_flops(case: Case, size: Size, vocab: int, real: int, model_tokens: int, rows: int) -> float | None:
    """FLOPs of the case's packed limit over the shard (of `rows` rows)."""
    W, w = size.n_ctx, size.n_win
    if case.limit in ("llama", "hf"):
        return real * llama_flops(size.llama, vocab, W)
    if case.limit == "both":
        return 2 * real * llama_flops(size.llama, vocab, W)
    if case.limit == "hf_text":
        return model_tokens * llama_flops(size.llama, vocab, W)
    if case.limit == "estimator":  # encoder + baseline decoder (W + 1 positions) + one head, packed;
        # the decoder with the row's own embedding over every padded row
        enc = llama_flops(size.encoder, vocab, W, head=False)
        dec = llama_flops(size.llama, vocab, W + 1, head=False)
        return real * (enc + dec + 2 * size.llama["d_model"] * vocab) + rows * (W + 1) * dec
    if case.limit == "windows":
        return real * w * llama_flops(size.llama, vocab, w)
    if case.limit == "windows2":
        return real * (
            w * llama_flops(size.llama, vocab, w) + (w - 1) * llama_flops(size.llama, vocab, w - 1)
        )
    if (
        case.limit == "none"
    ):  # grad_input: encoder + decoder forward + one decoder-sized backward per position
        enc = llama_flops(size.encoder, vocab, w, head=False)
        return real * (enc + w * llama_flops(size.llama, vocab, w + 1))
    return None


def _cast(model, dtype: str):
    want = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(want)
    return model


def _autocast(device: str, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _device_ctx(device: str):
    """Modules built inside land on the accelerator (random init there, not on the host's cores)."""
    return torch.device(device) if device.startswith("cuda") else contextlib.nullcontext()


def load_ours(path: str, device: str, dtype: str):
    from entroweight.models.checkpoint import load_checkpoint

    with _device_ctx(device):
        model, _ = load_checkpoint(path, map_location=device, verify=False)
    return _cast(model, dtype)


def load_hf(path: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    t = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=t, attn_implementation="sdpa")
    return model.to(device).eval()


def packed_rows(tokens: np.ndarray, width: int, device: str) -> list[torch.Tensor]:
    """`tokens` in full rows of `width` (the rest as one shorter row), on the device."""
    n = len(tokens) // width * width
    out = [torch.as_tensor(tokens[:n].reshape(-1, width), dtype=torch.long)]
    if n < len(tokens):
        out.append(torch.as_tensor(tokens[n:][None], dtype=torch.long))
    return [t.to(device) for t in out if t.numel()]


def _batches(rows: list[torch.Tensor], budget: int):
    for r in rows:
        step = max(1, budget // r.shape[1])
        for s in range(0, len(r), step):
            yield r[s : s + step]


HEAD_TOKENS = 8192  # tokens per head chunk of the limit's forwards (logits formed, then dropped)


def _head(head, h: torch.Tensor) -> None:
    h = h.reshape(-1, h.shape[-1])
    for s in range(0, len(h), HEAD_TOKENS):
        head(h[s : s + HEAD_TOKENS])


def run_limit(kind: str, models: list, rows: list[list[torch.Tensor]], budget: int, device: str, dtype: str):
    """The packed limit's forwards (no loss); `rows[i]` are the rows model i runs over."""
    with torch.inference_mode(), _autocast(device, dtype):
        for i, (model, model_rows) in enumerate(zip(models, rows, strict=True)):
            for x in _batches(model_rows, budget):
                if kind == "hf":
                    base = getattr(model, model.base_model_prefix)
                    _head(model.get_output_embeddings(), base(input_ids=x).last_hidden_state)
                elif kind == "estimator":
                    # the real tokens packed (i = 0): encoder, the baseline's decoder, one head; the
                    # padded rows (i = 1): the decoder with the row's own embedding, which enters
                    # before the pads, so every row's pads have their own states (which embedding
                    # enters takes the same time)
                    dec = model.decoder
                    e = dec.embed(x)
                    if i == 0:
                        model.encode(x)
                    empty = model.up(model.encode(torch.zeros_like(x[:1])))[:, None].expand(len(x), 1, -1)
                    h = dec.forward_hidden(torch.cat([empty.to(e.dtype), e], 1))[:, 1:]
                    if i == 0:
                        _head(dec.lm_head, h)
                else:  # our llama
                    _head(model.lm_head, model.forward_hidden(model.embed(x)))
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- where the time goes


class DeviceBusy:
    """Seconds the accelerator was busy inside the block: the union of its kernels, copies and sets
    (torch.profiler, CUDA activity only). None on a CPU or when the profiler gives no device events."""

    def __init__(self, device: str):
        self.on = device.startswith("cuda")
        self.seconds: float | None = None
        self.span: float | None = None  # first device event's start to the last one's end
        self.kernels = 0
        self.by_kind: dict[str, float] = {}  # seconds of device time per KERNEL_KINDS kind
        self.top: list[tuple[str, float, int]] = []  # (kernel, seconds, calls), the longest first

    def __enter__(self):
        if self.on:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if not self.on:
            return
        torch.cuda.synchronize()
        try:
            self.prof.__exit__(*exc)
            spans = self._spans()
        except Exception as e:  # a profiler that changed its API: the split is missing, the rates are not
            print(f"  device busy time unavailable: {type(e).__name__}: {e}", file=sys.stderr)
            return
        self.kernels = len(spans)
        if spans:
            spans.sort()
            self.span = (max(e for _, e in spans) - spans[0][0]) / 1e6
            busy, (a, b) = 0.0, spans[0]
            for s, e in spans[1:]:
                if s > b:
                    busy, a, b = busy + (b - a), s, e
                else:
                    b = max(b, e)
            self.seconds = (busy + (b - a)) / 1e6

    def _spans(self) -> list[tuple[float, float]]:
        """(start, end) in µs of every device event; fills in `by_kind` and `top` on the way."""
        from torch.autograd import DeviceType

        events = [
            (e.name, e.time_range.start, e.time_range.end)
            for e in self.prof.events()
            if getattr(e, "device_type", None) == DeviceType.CUDA and e.time_range.end > e.time_range.start
        ]
        if not events:
            events = [
                (e.name(), e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3)
                for e in self.prof.profiler.kineto_results.events()
                if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0
            ]
        per_name: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
        for name, s, e in events:
            per_name[name][0] += (e - s) / 1e6
            per_name[name][1] += 1
        kinds: collections.Counter = collections.Counter()
        for name, (sec, _) in per_name.items():
            kinds[kernel_kind(name)] += sec
        self.by_kind = {k: round(v, 4) for k, v in kinds.most_common()}
        self.top = [
            (n[:120], round(v[0], 4), v[1]) for n, v in sorted(per_name.items(), key=lambda x: -x[1][0])[:12]
        ]
        return [(s, e) for _, s, e in events]


# kernel kind <- the first pattern its name matches (case-insensitive), in this order
KERNEL_KINDS = (
    ("copy", r"memcpy|memset|copy_kernel|CatArrayBatched|index_select|gather|scatter|nonzero"),
    ("attention", r"flash|fmha|attention|attn|flex|sdpa|_tem_fused"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm\d+_|wgmma|splitK"),
    ("reduce", r"triton_red|triton_per|reduce|softmax|logsumexp|cross_entropy|nll|norm|argmax|cumsum|sort"),
    ("elementwise", r"elementwise|vectorized|unrolled|triton_|fill|where|cast"),
)


def kernel_kind(name: str) -> str:
    for kind, pattern in KERNEL_KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


SYNC_CALLS = (".cpu(", ".item(", ".tolist(", "synchronize(", ".numpy(")
WAIT_MODULES = ("threading", "queue", "concurrent.futures", "selectors", "multiprocessing")
MAIN_CATEGORIES = ("stage", "batch", "align", "launch", "sync", "wait_batch", "wait_write", "other")
THREAD_CATEGORIES = ("writer", "prefetch", "other_thread")


def _module(frame) -> str:
    return frame.f_globals.get("__name__", "") or ""


def classify_main(frame) -> str:
    """What the main thread is doing, from its innermost frames (categories: MAIN_CATEGORIES)."""
    in_torch = waiting = False
    f = frame
    while f is not None:
        m = _module(f)
        if m.startswith(("torch", "transformers")):
            in_torch = True
        elif m.startswith(WAIT_MODULES):
            waiting = True
        elif m.startswith(("entroweight.", "benchmarks.")):
            break
        f = f.f_back
    if f is None:
        return "launch" if in_torch else "other"
    m = _module(f)
    if m.startswith("entroweight.models"):
        return "launch"
    if waiting:
        if m.startswith("entroweight.transforms.prefetch"):
            return "wait_batch"
        return "wait_write" if m.startswith("entroweight.pipelines") else "other"
    if in_torch:
        return "launch"
    line = linecache.getline(f.f_code.co_filename, f.f_lineno)
    if any(s in line for s in SYNC_CALLS) and (
        m.startswith("entroweight.scorers") or m.startswith("benchmarks.")
    ):
        return "sync"
    if m.startswith(("entroweight.transforms.align", "entroweight.transforms.tokenizer")):
        return "align"
    if m.startswith("entroweight.scorers.cross_tokenizer") and f.f_code.co_name == "score":
        return "align"
    if m.startswith(("entroweight.scorers", "entroweight.transforms.prefetch")):
        return "batch"
    if m.startswith(
        ("entroweight.pipelines", "entroweight.transforms", "entroweight.storage", "entroweight.schemas")
    ):
        return "stage"
    return "other"


def classify_thread(frame) -> str | None:
    """A helper thread's category, or None when it is idle (waiting on a queue or a lock)."""
    f = frame
    inner = _module(f)
    if inner.startswith(WAIT_MODULES):
        return None
    while f is not None:
        m = _module(f)
        if m.startswith("entroweight.transforms.prefetch") or m.startswith("entroweight.scorers"):
            return "prefetch"
        if m.startswith(
            ("entroweight.transforms.weigh", "entroweight.transforms.writer", "entroweight.pipelines")
        ):
            return "writer"
        f = f.f_back
    return "other_thread"


class HostSampler:
    """Samples every thread's Python stack every `every` seconds inside the block."""

    def __init__(self, every: float = 0.005):
        self.every = every
        self.main = collections.Counter()
        self.threads = collections.Counter()
        self.samples = 0

    def __enter__(self):
        self.main_id = threading.get_ident()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        me = threading.get_ident()
        while not self.stop.wait(self.every):
            frames = sys._current_frames()
            self.samples += 1
            for tid, frame in frames.items():
                if tid == me:
                    continue
                if tid == self.main_id:
                    self.main[classify_main(frame)] += 1
                else:
                    cat = classify_thread(frame)
                    if cat:
                        self.threads[cat] += 1

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def shares(self) -> dict[str, float]:
        n = max(self.samples, 1)
        out = {k: round(self.main[k] / n, 3) for k in MAIN_CATEGORIES}
        out |= {f"{k}_busy": round(self.threads[k] / n, 3) for k in THREAD_CATEGORIES}
        return out


def timed(fn, device: str) -> dict:
    """Run fn under the device profiler and the host sampler: seconds, device busy, host shares."""
    with DeviceBusy(device) as busy, HostSampler() as host:
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "device_busy": None if busy.seconds is None else round(min(busy.seconds / seconds, 1.0), 3),
        # outside the span: before the first kernel and after the last (the shard's fixed costs)
        "outside_span_s": None if busy.span is None else round(max(seconds - busy.span, 0.0), 3),
        "device_events": busy.kernels,
        "device_s_by_kind": busy.by_kind,
        "top_kernels": busy.top,
        "host": host.shares(),
    }


# host-side calls that wait for the device (or copy from pageable memory, which also waits)
WAIT_OPS = ("Synchronize", "cudaMemcpy", "aten::item", "aten::_local_scalar_dense", "aten::nonzero")


def host_waits(fn) -> list[dict]:
    """One more untimed run of `fn` under the full profiler (CPU and CUDA, with Python stacks): the
    host calls in WAIT_OPS, grouped by where our code made them, the longest first. Where the device
    idles inside its span, these say which line held the host."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages(group_by_stack_n=12):
        if not any(w in e.key for w in WAIT_OPS):
            continue
        stack = list(e.stack or [])
        ours = [f for f in stack if "entroweight" in f or "scorers" in f or "models" in f]
        out.append(
            {
                "op": e.key,
                "calls": e.count,
                "cpu_s": round(e.cpu_time_total / 1e6, 4),
                "at": ours[:4],
                "stack": stack[:12],
            }
        )
    return sorted(out, key=lambda r: -r["cpu_s"])[:15]


# -- one case


def shard_tokens(data: Path) -> tuple[int, int, int, np.ndarray, list[np.ndarray]]:
    """(rows, width, real tokens, real tokens concatenated, each row's real ids) of the one shard."""
    t = pq.read_table(next(data.glob("part-*.parquet")), columns=["input_ids", "n_pad"])
    ids = np.stack(t.column("input_ids").to_numpy(zero_copy_only=False)).astype(np.int64)
    n_pad = t.column("n_pad").to_numpy()
    per_row = [ids[r, n_pad[r] :] for r in range(len(ids))]
    real = int(sum(len(r) for r in per_row))
    return len(ids), ids.shape[1], real, np.concatenate(per_row), per_row


def window_tokens(path, scorer) -> np.ndarray:
    """The model tokens cross_tokenizer's forwards read over the shard: each text's windows after its
    start token, the context a later window reads again included (as `make bench`'s limit: the
    forwards the scorer needs), recorded by one pass of the stage (`path`) with the model stubbed."""
    from .scoring_path import counting

    seen = counting(scorer, stub=True)
    try:
        path("count")
    finally:
        seen.restore()
    return np.concatenate(seen.tokens)


def manifest_extra(out: Path) -> dict:
    found = sorted(out.glob(".part-*.manifest.json"))
    return json.loads(found[0].read_text()).get("extra", {}) if found else {}


def _dtype_layout(r: dict) -> str:
    """A record's dtype, and its layout where it is not the default (`--layouts`)."""
    layout = r.get("layout", "packed")
    return r["dtype"] if layout == "packed" else f"{r['dtype']}, {layout}"


@contextlib.contextmanager
def planned(layout: str):
    """Inside, with layout "cut", rows a model packs are cut into batches whatever its attention (the
    one rule, `base.packs_shard_wide`, answered False where the score path asks it)."""
    if layout != "cut":
        yield
        return
    import entroweight.scorers.base as base
    import entroweight.scorers.cross_tokenizer as cross

    saved = base.packs_shard_wide, cross.packs_shard_wide
    base.packs_shard_wide = cross.packs_shard_wide = lambda scorer: False
    try:
        yield
    finally:
        base.packs_shard_wide, cross.packs_shard_wide = saved


def run_case(case: Case, dtype: str, ctx: dict) -> dict:
    from entroweight.pipelines import run_stage
    from entroweight.pipelines.score import ScoreStage
    from entroweight.scorers import make_scorer

    size, device, work = ctx["size"], ctx["device"], ctx["work"]
    data = ctx["data"][case.data, dtype]
    warm = ctx["data"][case.data, "warm"]
    options = {k: ctx["models"][v] for k, v in case.options.items()} | case.literal
    rec = {"case": case.key, "label": case.label, "scorer": case.scorer, "dtype": dtype, "device": device}
    rows, width, real, packed, per_row = shard_tokens(data)
    rec |= {"rows": rows, "width": width, "real_tokens": real}

    t0 = time.perf_counter()
    scorer = make_scorer(case.scorer, **options, dtype=dtype, device=device)
    stages = {
        k: ScoreStage(d, scorer, batch_tokens=size.budget[dtype]) for k, d in (("warm", warm), ("main", data))
    }
    # the model, once (run_stage's setup() then finds it loaded); ours built on the device directly
    with _device_ctx(device) if "checkpoint" in options else contextlib.nullcontext():
        stages["main"].setup()
    rec["load_s"] = round(time.perf_counter() - t0, 2)
    outs = work / "out" / case.key / dtype
    shutil.rmtree(outs, ignore_errors=True)

    def path(tag):
        out = outs / tag
        run_stage(stages["main" if tag != "warm" else "warm"], out, progress=False, overwrite=True)
        return out

    path("warm")
    # the packed limit: the same model, loaded with the public loaders, over the same real tokens
    limit_models, limit_rows, model_tokens = [], [], 0
    kind = case.limit
    if kind in ("llama", "windows", "windows2", "estimator", "both"):
        limit_models.append(load_ours(options["checkpoint"], device, dtype))
    if kind in ("hf", "hf_text"):
        limit_models.append(load_hf(options["model"], device, dtype))
    if kind == "both":
        limit_models.append(load_hf(options["reference"], device, dtype))
    w = size.n_win
    if kind in ("llama", "hf", "estimator", "both"):
        limit_rows = [packed_rows(packed, width, device) for _ in limit_models]
    if kind == "estimator":  # and the padded rows, for the decoder with each row's own embedding
        limit_models.append(limit_models[0])
        whole = np.zeros((rows, width), dtype=np.int64)
        for r, ids in enumerate(per_row):
            whole[r, width - len(ids) :] = ids
        limit_rows.append([torch.as_tensor(whole).to(device)])
    elif kind == "hf_text":
        mt = window_tokens(path, scorer)
        model_tokens = len(mt)
        limit_rows = [packed_rows(mt, width, device)]
    elif kind in ("windows", "windows2"):  # one window per real token: rows of w (and of w - 1)
        padded = np.r_[np.zeros(w - 1, dtype=np.int64), packed]
        wins = np.lib.stride_tricks.sliding_window_view(padded, w)[:real]
        limit_rows = [[torch.as_tensor(np.ascontiguousarray(wins)).to(device)]]
        if kind == "windows2":
            limit_models.append(limit_models[0])
            limit_rows.append([torch.as_tensor(np.ascontiguousarray(wins[:, 1:])).to(device)])
    rec["model_tokens"] = model_tokens or None
    flops = case_flops(case, size, ctx["vocab"], real, model_tokens, rows)
    limit_kind = "hf" if kind in ("hf", "hf_text") else ("estimator" if kind == "estimator" else "llama")

    def limit():
        if kind == "both":  # ours, then the HF reference
            run_limit("llama", limit_models[:1], limit_rows[:1], size.budget[dtype], device, dtype)
            run_limit("hf", limit_models[1:], limit_rows[1:], size.budget[dtype], device, dtype)
        else:
            run_limit(limit_kind, limit_models, limit_rows, size.budget[dtype], device, dtype)

    # warm-up: one whole untimed pass (after one batch, a first case's limit ran at 78 % busy on the H100)
    if limit_models:
        limit()
    path_runs, limit_runs = [], []
    for i in range(ctx["rounds"]):
        path_runs.append(timed(lambda i=i: path(f"run{i}"), device))
        if limit_models:
            limit_runs.append(timed(limit, device))
    best = min(path_runs, key=lambda r: r["seconds"])
    rec["path"] = best
    if ctx.get("trace") and device.startswith("cuda"):
        rec["host_waits"] = host_waits(lambda: path("trace"))
    rec["tok_s"] = real / best["seconds"]
    extra = manifest_extra(outs / f"run{path_runs.index(best)}")
    rec["pad_fraction"] = extra.get("pad_fraction")
    peak = ctx["peaks"].get(dtype)
    rec["flops"] = flops
    rec["mfu"] = flops / best["seconds"] / peak if flops and peak else None
    if limit_runs:
        lb = min(limit_runs, key=lambda r: r["seconds"])
        rec["limit"] = lb
        rec["limit_tok_s"] = real / lb["seconds"]
        rec["ratio"] = lb["seconds"] / best["seconds"]
        # without the shard's costs outside the device's span (reading and checking it before the first
        # kernel, weighing and writing after the last): the steady state of a shard many times longer
        outside = best.get("outside_span_s")  # None off CUDA (no device activity to span)
        in_span = None if outside is None else best["seconds"] - outside
        rec["ratio_in_span"] = lb["seconds"] / in_span if in_span else None
        rec["limit_mfu"] = flops / lb["seconds"] / peak if flops and peak else None
    limit_models.clear(), limit_rows.clear(), stages.clear()  # the models go before the next case
    return rec


# -- report


def fmt(x, spec=".3g", none="–"):
    return none if x is None else format(x, spec)


def markdown(records: list[dict], machine: dict) -> str:
    lines = [
        f"# Scorers on {machine['device']} ({machine['size']}), {machine['date']}, commit {machine['commit']}",
        "",
        "| scorer | dtype | rows × width | real tok/s | packed limit tok/s | ratio | ratio in span | MFU | limit MFU "
        "| pad fraction |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['label']} | {_dtype_layout(r)} | ERROR: {r['error'][:120]} | | | | | | | |")
            continue
        lines.append(
            f"| {r['label']} | {_dtype_layout(r)} | "
            f"{r['rows']} × {r['width']} | {fmt(r['tok_s'], ',.0f')} | "
            f"{fmt(r.get('limit_tok_s'), ',.0f')} | {fmt(r.get('ratio'), '.2f')} | {fmt(r.get('ratio_in_span'), '.2f')} | "
            f"{fmt(r.get('mfu'), '.1%')} | "
            f"{fmt(r.get('limit_mfu'), '.1%')} | {fmt(r.get('pad_fraction'), '.3f')} |"
        )
    lines += [
        "",
        "Where the path's wall time goes: device busy (profiler) and the host main thread's share of samples:",
        "",
        "| scorer | dtype | wall s | device busy | limit device busy | stage (read, write, manifest) | batch/pack | "
        "decode/encode/align | model launch | device sync | wait batch | wait writer | other | writer thread | prefetch thread |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        if "error" in r:
            continue
        p, h = r["path"], r["path"]["host"]
        lb = (r.get("limit") or {}).get("device_busy")
        lines.append(
            f"| {r['label']} | {_dtype_layout(r)} | {p['seconds']:.2f} | {fmt(p['device_busy'], '.0%')} | {fmt(lb, '.0%')} | "
            + " | ".join(
                fmt(h[k], ".0%")
                for k in ("stage", "batch", "align", "launch", "sync", "wait_batch", "wait_write", "other")
            )
            + f" | {fmt(h['writer_busy'], '.0%')} | {fmt(h['prefetch_busy'], '.0%')} |"
        )
    return "\n".join(lines) + "\n"


def machine_info(size: Size, device: str, peaks: dict) -> dict:
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit or os.environ.get("ENTROWEIGHT_COMMIT", ""),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "size": size.name,
        "peaks_tflops": {k: v / 1e12 for k, v in peaks.items()},
        "budget": size.budget,
    }


def prepare(work: Path, size: Size, dtypes: list[str], device: str, tiny: bool):
    """(data dirs, model paths, model tokenizer): tokenizers, corpora and checkpoints, built once per
    --work (`ready.json` records them; a later run of the same size and dtypes reuses them)."""
    ready = work / "ready.json"
    model_tok, data_tok = work / "tok-model", work / "tok-data"
    key = [size.name, sorted(dtypes)]
    if ready.is_file() and (prior := json.loads(ready.read_text()))["key"] == key:
        data = {tuple(k.split("|")): Path(v) for k, v in prior["data"].items()}
        return data, prior["models"], model_tok
    for d in ("tok-model", "tok-data", "models", *(p.name for p in work.glob("data-*"))):
        shutil.rmtree(work / d, ignore_errors=True)
    t = time.perf_counter()
    texts = c4_texts()[: 100 if tiny else None]
    bpe(model_tok, size.vocab, texts) if size.vocab else llama32_tokenizer(model_tok)
    bpe(data_tok, size.data_vocab, texts)
    data = {}
    for dtype in dtypes:
        data["main", dtype] = corpus(work, model_tok, size.n_ctx, size.docs[dtype], f"main-{dtype}")
        data["cross", dtype] = corpus(work, data_tok, size.n_ctx, size.docs[dtype], f"cross-{dtype}")
        data["win", dtype] = corpus(work, model_tok, size.n_win, size.win_docs[dtype], f"win-{dtype}")
    data["main", "warm"] = corpus(work, model_tok, size.n_ctx, size.warm_docs, "main-warm")
    data["cross", "warm"] = corpus(work, data_tok, size.n_ctx, size.warm_docs, "cross-warm")
    data["win", "warm"] = corpus(work, model_tok, size.n_win, 1, "win-warm")
    print(f"  tokenizers and corpora: {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    models = build_models(work / "models", size, model_tok, device)
    print(f"  models: {time.perf_counter() - t:.1f} s", flush=True)
    saved = {"key": key, "data": {"|".join(k): str(v) for k, v in data.items()}, "models": models}
    ready.write_text(json.dumps(saved) + "\n")
    return data, models, model_tok


def cache_weights_hash() -> None:
    """The score stage asks an HF model's config for the sha256 of its weight files 5 times a shard
    (plan, three config hashes, file metadata), each a full read: ≈ 14 s a shard for a 1B model in
    bf16 on the H100 machine. Cached here, the rates show the steady state of a long shard."""
    import functools

    import entroweight.scorers.hf as hf

    if not hasattr(hf.model_sha256, "cache_info"):
        hf.model_sha256 = functools.lru_cache(maxsize=None)(hf.model_sha256)


def device_peaks(device: str, args) -> dict[str, float]:
    peaks = {}
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        for key, (bf16, fp32) in PEAKS.items():
            if key in name:
                peaks = {"bf16": bf16, "fp32": fp32}
                break
    if args.peak_bf16:
        peaks["bf16"] = args.peak_bf16 * 1e12
    if args.peak_fp32:
        peaks["fp32"] = args.peak_fp32 * 1e12
    return peaks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny models and shards (CPU, for the test)")
    ap.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["fp32", "bf16"])
    ap.add_argument("--only", nargs="+", default=None, choices=[c.key for c in CASES])
    ap.add_argument("--out", default=str(REPO / "bench-out" / "gpu"))
    ap.add_argument("--work", default=None, help="where data and models go (default: a temp dir, removed)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="timed runs of each path and limit, the best kept (one run carries one-off costs: a "
        "shape compiled for the first time, the process's first pinned buffers)",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="after the timed runs, one more run under the full profiler: where the host waited (CUDA)",
    )
    ap.add_argument("--deadline", type=float, default=None, help="seconds: start no case after this")
    ap.add_argument(
        "--cache-weights-hash",
        action="store_true",
        help="hash an HF model directory's weights once per process (the stage re-reads them 5 times a shard)",
    )
    ap.add_argument(
        "--layouts",
        nargs="+",
        default=["packed"],
        choices=["packed", "cut", "rows"],
        help="packed: rows laid out without pads (scorers/packing.py), planned as on this device; cut: "
        "the same, length-sorted rows cut into batches, each packed at its longest row "
        "(`base.packs_shard_wide` False), the A/B for a model planned over the shard; rows: one row per "
        "batch row, pads computed (Scorer.pack = False), the layout before packing; several: each per case",
    )
    ap.add_argument("--peak-bf16", type=float, default=None, help="TFLOP/s, for a device not in the table")
    ap.add_argument("--peak-fp32", type=float, default=None, help="TFLOP/s, for a device not in the table")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    begin = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: pass --tiny --device cpu", file=sys.stderr)
        return 2
    if not args.tiny and not device.startswith("cuda"):
        print("the 1B-class run needs an accelerator; on a CPU run --tiny", file=sys.stderr)
        return 2
    size = SIZES["tiny" if args.tiny else "1b"]
    if not device.startswith("cuda"):
        torch.set_num_threads(bench_threads())
    peaks = device_peaks(device, args)
    machine = machine_info(size, device, peaks) | {
        "cache_weights_hash": args.cache_weights_hash,
        "layouts": args.layouts,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    cases = [c for c in CASES if args.only is None or c.key in args.only]
    records: list[dict] = []
    print(f"# {machine['device']}, {size.name}, torch {machine['torch']}, work in {work}", flush=True)
    try:
        data, models, model_tok = prepare(work, size, args.dtypes, device, args.tiny)
        if args.cache_weights_hash:
            cache_weights_hash()
        from entroweight.transforms.tokenizer import load_tokenizer

        ctx = dict(size=size, device=device, work=work, data=data, models=models, rounds=args.rounds,
                   peaks=peaks, trace=args.trace, vocab=load_tokenizer(model_tok).vocab_size)  # fmt: skip
        from entroweight.scorers.base import Scorer

        runs = [(dtype, layout) for dtype in args.dtypes for layout in args.layouts]
        for case in cases:
            for dtype, layout in runs:
                Scorer.pack = layout != "rows"  # every scorer of this run (a class default)
                if args.deadline and time.perf_counter() - begin > args.deadline:
                    records.append(
                        {"case": case.key, "label": case.label, "dtype": dtype, "error": "skipped: deadline"}
                    )
                    continue
                t = time.perf_counter()
                try:
                    with planned(layout):
                        rec = run_case(case, dtype, ctx)
                except Exception as e:
                    traceback.print_exc()
                    rec = {
                        "case": case.key,
                        "label": case.label,
                        "dtype": dtype,
                        "error": f"{type(e).__name__}: {e}",
                    }
                finally:
                    gc.collect()
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
                rec["case_s"] = round(time.perf_counter() - t, 1)
                rec["layout"] = layout
                records.append(rec)
                _print(rec)
                _save(out, machine, records)
    finally:
        from entroweight.scorers.base import Scorer

        Scorer.pack = True
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    _save(out, machine, records)
    print(markdown(records, machine))
    return 1 if any("error" in r and not r["error"].startswith("skipped") for r in records) else 0


def _print(r: dict) -> None:
    if "error" in r:
        print(f"  {r['label']} [{_dtype_layout(r)}]: {r['error']}", flush=True)
        return
    p = r["path"]
    print(
        f"  {r['label']} [{_dtype_layout(r)}]: {r['tok_s']:,.0f} real tok/s, limit {fmt(r.get('limit_tok_s'), ',.0f')}, "
        f"ratio {fmt(r.get('ratio'), '.2f')} (in span {fmt(r.get('ratio_in_span'), '.2f')}), MFU {fmt(r.get('mfu'), '.1%')}, device busy {fmt(p['device_busy'], '.0%')}, "
        f"host {p['host']} ({r['case_s']} s)",
        flush=True,
    )
    lim = r.get("limit") or {}
    for tag, run in (("path", p), ("limit", lim)):
        if run.get("device_s_by_kind"):
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in run["device_s_by_kind"].items())
            print(
                f"    {tag}: {run['seconds']:.2f} s, outside span {run['outside_span_s']} s; device s: {kinds}"
            )
    for w in r.get("host_waits", [])[:6]:
        print(f"    host wait: {w['op']} x{w['calls']} {w['cpu_s']} s at {' < '.join(w['at'][:2])}")


def _save(out: Path, machine: dict, records: list[dict]) -> None:
    (out / "results.json").write_text(json.dumps({"machine": machine, "records": records}, indent=1) + "\n")
    (out / "results.md").write_text(markdown(records, machine))


if __name__ == "__main__":
    sys.exit(main())
