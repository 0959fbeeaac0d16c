"""Forward passes for scoring: compute dtype, and per-token cross-entropy in chunks.

The logits of a whole batch are never materialised in fp32: for an HF model we run the decoder to
hidden states and apply the output head chunk by chunk; CE itself is always fp32.
"""

from __future__ import annotations

import contextlib
import platform
import warnings

import numpy as np
import torch
import torch.nn.functional as F

# fp32 logits per chunk: 256 MiB on an accelerator (Llama's 128k vocabulary -> 512 rows per chunk);
# on a CPU 64 MiB. (16 MiB was chosen when every chunk's fresh pages were faulted in; with the worker
# keeping freed memory, entroweight/allocator.py, head + CE of 4,096 rows of an 8k vocabulary took
# 104 ms at 64 MiB against 120 ms at 16, and causal_loss's fp32 path ran 1-18 % faster, ours, HF and
# cross_tokenizer, two alternated pairs of processes. bf16 read both ways at 64: kept at 6, below.)
CHUNK_BYTES = 256 << 20
CPU_CHUNK_BYTES = 64 << 20
# ... and 6 MiB for bf16/fp16 logits on a CPU, whose CE also makes an fp32 copy: head + CE of 8k
# logits took 155 ms a 8k-row batch at 6 MiB against 305 ms at 8-16 MiB here (a cache cliff), and
# causal_loss's whole path 0.93-0.96x the time (ours, HF; alternated x4); fp32 is 5 % slower at 6
CPU_LOW_CHUNK_BYTES = 6 << 20
# on CUDA the CE is one compiled kernel that reads the logits in their own dtype (`token_ce`): no
# fp32 copy exists, so a chunk holds 1 GiB of them (4k rows of bf16 at 128k). On the H100 the eager
# CE (an fp32 copy, log_softmax, gather) over 512-row chunks was 0.4 s of device time beside a 2.15-s
# bare forward of the same tokens (bench-gpu kernel kinds, docs/scaling.md)
FUSED_CHUNK_BYTES = 1 << 30


def native_bf16(device: str) -> bool:
    """CUDA with bf16, or a CPU whose instructions compute in bf16: on x86 AVX512-BF16 or AMX; on
    other CPUs what oneDNN reports (Arm's BF16 extension). Emulated bf16 is slower than fp32, and
    oneDNN's own check also says yes on an x86 CPU with AVX512 alone, where it converts every
    operand: on such a CPU (2 cores) our d256x4 llama's score path ran 3.1-3.3x slower in bf16
    than in fp32 (`make bench`, docs/scoring.md)."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        checks = (
            getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        )
        return any(check() for check in checks if check is not None)
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_dtype(dtype: str | None) -> str:
    """The requested dtype as the stage config records it: 'bf16', 'fp16', 'fp32' or 'auto' (None).
    'auto' is resolved where the model runs (`resolve_dtype` in the worker's setup), not on a driver
    that may have no accelerator."""
    if dtype in (None, "auto"):
        return "auto"
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"--dtype must be bf16, fp16 or fp32, not {dtype!r}")
    return dtype


def resolve_dtype(dtype: str | None, device: str) -> str:
    """'bf16', 'fp16' or 'fp32'; None/'auto' picks bf16 where it is native."""
    if check_dtype(dtype) == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    return dtype


def resolved_device(device: str) -> str:
    """The device a worker actually computes on ('cuda' -> 'cuda:N', the current one)."""
    if device == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return device


def to_device(array, device: str) -> torch.Tensor:
    """A host array (numpy or tensor) as a tensor on `device`. To CUDA through pinned memory with a
    non-blocking copy: the host goes on preparing the next batch while the copy runs, and the kernels
    that read it are queued after it on the same stream (the pinned buffer is held until the copy is
    done). Elsewhere the array itself, as `torch.as_tensor` gives it: on a CPU, no copy at all."""
    t = torch.as_tensor(array)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors on their way to the host: the copies are queued now (into pinned memory, behind
    the kernels that make the tensors) and `arrays()` waits for those copies alone. A scorer hands one
    back before reading it, so the next batch's forward is queued first and the device does not idle
    while the host places this batch's values (`base.Later`). On a CPU the tensors are the arrays."""

    def __init__(self, *tensors: torch.Tensor):
        self.event = None
        if any(t.device.type == "cuda" for t in tensors):
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = [t.cpu() for t in tensors]

    def arrays(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return [h.numpy() for h in self.host]


def to_compute_dtype(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """Parameters in the compute dtype, so that autocast does not re-cast every weight on every forward;
    buffers (RoPE tables) stay fp32, as they are under autocast."""
    want = TORCH_DTYPES[dtype]
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != want:
            p.data = p.data.to(want)
    return model


def autocast(device: str, dtype: str):
    if dtype in ("bf16", "fp16"):
        return torch.autocast(device_type=device.split(":")[0], dtype=TORCH_DTYPES[dtype])
    return contextlib.nullcontext()


def token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N,) fp32 CE of each row of (N, V) logits at its target: logsumexp − the target's logit, in
    fp32 whatever the logits' dtype (what `F.cross_entropy(logits.float(), …)` gives)."""
    x = logits.float()
    return torch.logsumexp(x, -1) - x.gather(-1, targets[:, None])[:, 0]


_fused_ce = None  # token_ce compiled for CUDA once per process; False where it cannot be


def _ce(logits: torch.Tensor, targets: torch.Tensor, scratch: bool = False) -> torch.Tensor:
    """`token_ce`: compiled on CUDA (the fp32 cast inside the reduction, one read of the logits);
    elsewhere eagerly (compiled for a CPU it is faster, but each process would pay ~15 s of compiling
    and need a C compiler: docs/scoring.md). `scratch`: the logits are ours to overwrite."""
    global _fused_ce
    # one row stays eager: dynamo specializes sizes 0 and 1, so a lone row would compile once more
    if logits.device.type == "cuda" and _fused_ce is not False and logits.shape[0] > 1:
        if _fused_ce is None:
            _fused_ce = torch.compile(token_ce, dynamic=True)
        try:
            return _fused_ce(logits, targets)
        except Exception as e:  # no working triton/inductor here: the eager CE, said once
            warnings.warn(f"compiled CE unavailable ({type(e).__name__}: {e}); CE runs eagerly", stacklevel=2)
            _fused_ce = False
    if logits.device.type == "cpu" and (scratch or logits.dtype != torch.float32):
        # log_softmax in place on an fp32 tensor of our own (the copy of low-precision logits, or
        # logits the head just made): no second (N, V) fp32 tensor a chunk. Head + CE of 8k bf16
        # logits, 8,192 rows: 112-125 ms against 122-195 ms for `F.cross_entropy` (fastest of 25;
        # fp32 236 against 257 ms); the same values to the bit. (CPU only: its kernel reads each
        # element before writing it; other devices' kernels were not checked for that.)
        x = logits.float()
        torch.log_softmax(x, -1, out=x)
        return -x.gather(-1, targets[:, None])[:, 0]
    return F.cross_entropy(logits.float(), targets, reduction="none")


def fused_ce(device: torch.device) -> bool:
    """Whether `_ce` on this device is the compiled one (so chunks are sized by `FUSED_CHUNK_BYTES`)."""
    return device.type == "cuda" and _fused_ce is not False


def chunked_ce(rows: torch.Tensor, targets: torch.Tensor, head=None, chunk_rows: int | None = None):
    """Per-row CE in fp32 nats. `rows` are logits (N, V), or hidden states (N, D) when `head` maps them
    to logits; either way at most `chunk_rows` rows of logits exist at once (by default as many as
    `CHUNK_BYTES` of fp32 logits, or `FUSED_CHUNK_BYTES` of logits in their dtype where CE is fused)."""
    n = rows.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=rows.device)
    if n == 0:
        return out
    if chunk_rows is None:
        vocab = head.out_features if head is not None and hasattr(head, "out_features") else rows.shape[-1]
        if fused_ce(rows.device):
            chunk_rows = max(1, FUSED_CHUNK_BYTES // (rows.element_size() * vocab))
        elif rows.device.type == "cpu":
            budget = CPU_CHUNK_BYTES if rows.dtype == torch.float32 else CPU_LOW_CHUNK_BYTES
            chunk_rows = max(1, budget // (4 * vocab))
        else:
            chunk_rows = max(1, CHUNK_BYTES // (4 * vocab))
    for s in range(0, n, chunk_rows):
        chunk = rows[s : s + chunk_rows]
        logits = chunk if head is None else head(chunk)
        # logits the head made (not the caller's rows, nor a view of them) may be overwritten
        ours = logits.untyped_storage().data_ptr() != chunk.untyped_storage().data_ptr()
        out[s : s + chunk_rows] = _ce(logits, targets[s : s + chunk_rows], scratch=ours)
    return out


def read_targets(segments: np.ndarray) -> np.ndarray:
    """Flat indices into (N, S) `segments` (each slot's row, -1 on fill) of the slots whose CE a value
    reads: every slot of a row but its first. Found on the host, so picking them costs no sync."""
    read = np.zeros(segments.shape, dtype=bool)
    read[:, 1:] = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] >= 0)
    return np.flatnonzero(read)


def next_token_ce(h: torch.Tensor, ids: torch.Tensor, segments: np.ndarray, head=None, chunk_rows=None):
    """(N, S) fp32: slot t's CE given its row's slots before it (from `h` at t − 1: logits, or hidden
    states with `head`), 0 where t starts a row or is fill (`segments`, on the host: `read_targets`).
    The head and the CE run over the read slots alone: a prediction nothing reads (a pad's, a row's
    last, fill's) is never turned into logits. Chunked as `chunked_ce`."""
    N, S = ids.shape
    read = to_device(read_targets(segments), ids.device)
    flat = h.reshape(N * S, h.shape[-1]).index_select(0, read - 1)
    ce = chunked_ce(flat, ids.reshape(-1).index_select(0, read), head, chunk_rows)
    return torch.zeros(N * S, dtype=torch.float32, device=ids.device).index_copy_(0, read, ce).view(N, S)


def hf_packed_losses(model, packed, device: str, dtype: str) -> torch.Tensor:
    """`packed` rows (scorers/packing.py `Packed`) -> (N, S) fp32 CE of each slot given its row's
    slots before it, 0 on each row's first slot and on fill. The rows are told apart by
    `position_ids` restarting at 0, which transformers turns into block-diagonal attention (a varlen
    kernel with flash attention); no attention mask is passed (`packs` says which models allow it)."""
    x = to_device(packed.ids, device)
    # one row a sequence: the model's own positions and plain causal attention (no mask built)
    rows = {} if packed.one_row_each else {"position_ids": to_device(packed.positions, device)}
    base, head, plain = _decoder_and_head(model)
    with torch.inference_mode(), autocast(x.device.type, dtype):
        # no cache: with one, transformers reads `position_ids` as a continuation, not as rows
        if base is not None:
            h = base(input_ids=x, use_cache=False, **rows).last_hidden_state
            return next_token_ce(h, x, packed.segments, head)
        return next_token_ce(model(input_ids=x, use_cache=False, **rows).logits, x, packed.segments)


def _decoder_and_head(model):
    """(decoder, output head, True) when the head can be applied in chunks to the decoder's hidden
    states (no scaled or capped logits); else (None, None, False): the model's own logits."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plain = getattr(model.config, "final_logit_softcapping", None) is None and not hasattr(
        model.config, "logit_scale"
    )
    if base is not None and head is not None and plain:
        return base, head, True
    return None, None, False


def hf_token_losses(model, x: torch.Tensor, mask: torch.Tensor, dtype: str) -> torch.Tensor:
    """(B, T) ids and 0/1 mask (left padding) -> (B, T) fp32: value t = CE of x[t] given x[<t];
    0 where x[t] or x[t-1] is masked. Uses the decoder + chunked head when the model allows it."""
    device = x.device.type
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # first real token at position 0, as unpadded
    pred = (mask[:, :-1] & mask[:, 1:]).bool()  # h[t] predicts x[t+1], both real
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    base, head, plain = _decoder_and_head(model)
    with torch.inference_mode(), autocast(device, dtype):
        # CE at every position, pads zeroed by `where`: no boolean-mask indexing, so no host sync
        # inside (a pad's value may be anything, even NaN; `where` does not propagate it)
        if plain:
            h = base(input_ids=x, attention_mask=mask, position_ids=pos).last_hidden_state[:, :-1]
            ce = chunked_ce(h.reshape(-1, h.shape[-1]), x[:, 1:].reshape(-1), head)
        else:  # models with scaled or capped logits: full logits, CE still chunked in fp32
            logits = model(input_ids=x, attention_mask=mask, position_ids=pos).logits[:, :-1]
            ce = chunked_ce(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        out[:, 1:] = torch.where(pred, ce.view(pred.shape), 0.0)
    return out


def with_start_token(ids: torch.Tensor, lengths: torch.Tensor, start: int | None):
    """Left-padded (B, W) ids -> (x, mask) with `start` just before each row's first real token.
    Pads become id 0 (masked; any id works, it must only be a valid embedding row)."""
    B, W = ids.shape
    col = torch.arange(W, device=ids.device)[None, :]
    real = col >= (W - lengths)[:, None]
    x = torch.where(real, ids, torch.zeros_like(ids))
    if start is None:
        return x, real.long()
    x = torch.cat([torch.zeros_like(x[:, :1]), x], dim=1)
    mask = torch.cat([torch.zeros_like(real[:, :1]), real], dim=1)
    rows = torch.arange(B, device=ids.device)
    x[rows, W - lengths] = start
    mask[rows, W - lengths] = True
    return x, mask.long()
