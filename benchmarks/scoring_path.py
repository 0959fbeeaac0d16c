"""The whole shard path of the score stage against the packed limit, per scorer (issue 18).

For each scorer that runs a model over rows (causal_loss with our checkpoint, the same one as a
`mask_pads` model, and an HF model, on left-padded C4 at n_ctx 512; cross_tokenizer with that HF
model; occlusion; decomposition), on one shard scored by `ScoreStage` as a run does (read -> batch
-> forward -> weigh -> write):

- ratio, in fp32 and in bf16: real tokens scored per second / the scorer's packed limit, the bare
  forwards it needs over the same real tokens packed into full rows with no padding (same dtype and
  threads): one forward of the model for causal_loss and cross_tokenizer; for occlusion its
  encoder and the baseline's decoder over the real tokens packed, and the decoder with the row's
  own embedding over the whole padded rows (that embedding enters at position 0, before the pads,
  so each row's pads have their own states: no layout shares them), then one head over the
  difference; for decomposition its own limit, one model-width forward per real position. Path
  and limit alternate eight times in one process (A B, B A, ...), the fastest of each (`fastest`);
  the note gives the median of the eight paired ratios beside it;
- feed: real tokens per second of the same path with the scorer's forward replaced by a stub that
  returns zeros of the right shape (what the CPU side can feed an accelerator);
- busy share of a simulated device (`SimulatedDevice`): the same stub, its batches queued on a
  device that takes 4x the host's own time over the same rows and that the host waits on as on an
  accelerator (GIL released): 0.80 when the host's work runs in series with the forwards, 1 when
  the device hides all of it (a one-segment shard's read and write cannot be hidden);
- pad fraction: of the positions the forwards computed, the share that were not real tokens, as
  the stage records it (for cross_tokenizer, of the model-token positions: it scores windows of the
  text in its own tokens);
- with CUDA: MFU of a Llama-3.2-1B-shaped random model (bf16, a 64k-token budget).

Models have random weights (speed does not depend on them). Runs on the code it is imported with,
so the same file measures a checkout before a change (`PYTHONPATH=<old tree>`); a stage without
`batch_tokens` is scored its old way (batches of 16 rows per 256-row read).
"""

from __future__ import annotations

import gzip
import inspect
import json
import os
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from entroweight.scorers.base import Later
from entroweight.scorers.forward import HostCopy

from .common import C4, alternate, bench_threads, bench_tokenizer, fastest, median, paired_median, row

BUDGET = 4096  # tokens per forward on CPU (8 rows of 512; 64k on an accelerator)
N_CTX = 512
DTYPES = ("fp32", "bf16")  # each scorer in both, against its limit in the same dtype
# path and limit alternate (A B, B A, ...), the fastest of each: single runs on a shared machine swing
# by ±15 % (a 2048² matmul loop here took 0.93 to 1.24 s a run within one minute)
ROUNDS = {False: 8, True: 1}
LIMITS = {
    None: "one bare forward of the model",
    "occlusion": "encoder + baseline decoder packed, own-embedding decoder over the padded rows",
    "decomposition": "one model-width forward per position",
}


def _shard(tmp: Path, tok: Path, n_ctx: int, rows: int, tag: str = "") -> Path:
    """The first `rows` C4 documents, left-padded at n_ctx: one shard in its own directory."""
    from entroweight.pipelines import run_stage
    from entroweight.pipelines.tokenize import TokenizeStage

    src = tmp / f"c4-{n_ctx}{tag}.jsonl.gz"
    with gzip.open(C4, "rt", encoding="utf-8") as f, gzip.open(src, "wt", encoding="utf-8") as out:
        out.writelines(line for _, line in zip(range(rows), f, strict=False))
    one = tmp / f"shard{n_ctx}{tag}"
    run_stage(TokenizeStage([str(src)], str(tok), n_ctx=n_ctx), one, progress=False)  # one shard
    shutil.copy(tok / "tokenizer.json", one / "tokenizer.json")
    return one


def _models(tmp: Path, sha: str, tok: Path, vocab: int) -> dict[str, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from entroweight.models.checkpoint import save_checkpoint
    from entroweight.models.estimator import EntropyEstimator
    from entroweight.models.llama import Llama

    torch.manual_seed(0)
    d = dict(d_model=256, n_layers=4, n_heads=4, d_ff=1024)
    ours = Llama(Llama.Config(vocab_size=vocab, n_ctx=N_CTX, **d)).eval()
    # the same weights, trained (here: declared) with the left padding masked: its pads may be cut
    masked = Llama(Llama.Config(vocab_size=vocab, n_ctx=N_CTX, mask_pads=True, **d)).eval()
    masked.load_state_dict(ours.state_dict())
    hf_cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=N_CTX + 1)  # fmt: skip
    hf_dir = tmp / "hf"
    LlamaForCausalLM(hf_cfg).save_pretrained(hf_dir)
    shutil.copy(tok / "tokenizer.json", hf_dir / "tokenizer.json")

    def estimator(n_ctx):
        cfg = EntropyEstimator.Config(
            vocab_size=vocab, n_ctx=n_ctx, injection="token", encoder="mixer", decoder="llama",
            encoder_config={"d_model": 128, "n_layers": 2},
            decoder_config={"d_model": 128, "n_layers": 2, "n_heads": 2}, embed_dim=16, noise="none",
        )  # fmt: skip
        return EntropyEstimator(cfg).eval()

    def save(model, name, kind, n_ctx):
        return str(save_checkpoint(model, kind, tmp / name, tokenizer_sha256=sha, n_ctx=n_ctx, pad_id=0))

    return {
        "ours": save(ours, "ours", "llama", N_CTX),
        "ours_masked": save(masked, "ours_masked", "llama", N_CTX),
        "hf": str(hf_dir),
        "est512": save(estimator(N_CTX), "est512", "estimator", N_CTX),
        "est64": save(estimator(64), "est64", "estimator", 64),
    }


def _stage(data: Path, name: str, options: dict, budget: int | None, dtype: str = "fp32"):
    from entroweight.pipelines.score import ScoreStage

    kw = {}
    if "batch_tokens" in inspect.signature(ScoreStage.__init__).parameters:
        kw["batch_tokens"] = budget
    tokenizer = str(data / "tokenizer.json")  # cross_tokenizer reads the data's text
    stage = ScoreStage(data, name, {**options, "dtype": dtype}, tokenizer=tokenizer, **kw)
    stage.setup()
    return stage


def _run_shard(stage, data: Path, out: Path, rows: int | None = None) -> float:
    """Seconds of the stage's process() on the shard (read, batch, forward, weigh, write); its first
    `rows` rows alone when given."""
    from entroweight.pipelines.stage import ShardTask

    (inp,) = stage.plan_inputs()
    if rows is not None:
        inp = inp.model_copy(update={"stop": rows})
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    task = ShardTask(shard="part-00000", inputs=[inp], out_dir=str(out))
    start = time.perf_counter()
    _run_shard.manifest = stage.process(task)
    return time.perf_counter() - start


class SimulatedDevice:
    """An accelerator on a CPU: work queued runs in order, each piece `s_per_token` seconds a real
    token, while the host goes on; `wait(done)` sleeps until a piece is done (the GIL released, as a
    host thread waiting on a device). With `s_per_token` 0 it is not there."""

    def __init__(self):
        self.s_per_token = 0.0
        self.free_at = self.busy = 0.0
        self.last_done = 0.0

    def queue(self, tokens: int) -> float:
        cost = tokens * self.s_per_token
        self.free_at = max(time.perf_counter(), self.free_at) + cost
        self.busy += cost
        self.last_done = self.free_at
        return self.free_at

    @staticmethod
    def wait(done: float) -> None:
        time.sleep(max(0.0, done - time.perf_counter()))


class _SimulatedCopy(HostCopy):
    """cross_tokenizer's HostCopy of a batch's values, read once the simulated device made them."""

    def __init__(self, device: SimulatedDevice, *tensors):
        super().__init__(*tensors)
        self.device, self.done = device, device.last_done

    def arrays(self) -> list:
        self.device.wait(self.done)
        return super().arrays()


class _Counting:
    """Wraps a scorer's score_batch: counts the positions its forwards compute (rows × the width the
    model runs at) and the real tokens among them, and with `stub` returns zeros instead of running
    the model (with `device.s_per_token` set, the values of a simulated accelerator: `Later`)."""

    def __init__(self, scorer, stub: bool = False):
        self.scorer, self.inner, self.stub = scorer, scorer.score_batch, stub
        self.computed = self.real = 0
        self.device = SimulatedDevice()
        scorer.score_batch = self

    def __call__(self, ids, n_pad, *more):
        model_width = getattr(self.scorer, "n_ctx", 0)  # our estimators widen rows to their n_ctx
        self.computed += ids.shape[0] * max(ids.shape[1], model_width)
        real = int((ids.shape[1] - n_pad).sum())
        self.real += real
        if self.stub:
            zeros = np.zeros(ids.shape, dtype=np.float32)
            if not self.device.s_per_token:
                return zeros
            done = self.device.queue(real)
            return Later(lambda: self.device.wait(done) or zeros)
        return self.inner(ids, n_pad, *more)

    def restore(self):
        self.scorer.score_batch = self.inner


class _CountingHF:
    """The same for cross_tokenizer, which batches windows of model tokens its own way: wraps the HF
    forwards it calls (`hf_token_losses`, left-padded windows, and `hf_packed_losses`, packed ones,
    as its module imported them). Keeps the real model tokens it was given (`tokens`: what the packed
    bare forward runs over)."""

    def __init__(self, scorer, stub: bool = False):
        import entroweight.scorers.cross_tokenizer as module

        self.module, self.stub = module, stub
        self.inner = module.hf_token_losses
        self.inner_packed = getattr(module, "hf_packed_losses", None)
        self.computed = self.real = 0
        self.device = SimulatedDevice()
        self.tokens: list[np.ndarray] = []
        self.host_copy = module.HostCopy
        module.hf_token_losses = self
        module.HostCopy = partial(_SimulatedCopy, self.device)
        if self.inner_packed is not None:
            module.hf_packed_losses = self.packed

    def __call__(self, model, x, mask, dtype):
        self.computed += x.numel()
        self.real += int(mask.sum())
        self.tokens.append(x[mask.bool()].cpu().numpy())
        if self.stub:
            self.device.queue(int(mask.sum()))
            return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return self.inner(model, x, mask, dtype)

    def packed(self, model, packed, device, dtype):
        real = packed.segments >= 0
        self.computed += packed.ids.size
        self.real += int(real.sum())
        self.tokens.append(packed.ids[real])
        if self.stub:
            self.device.queue(int(real.sum()))
            return torch.zeros(packed.ids.shape, dtype=torch.float32)
        return self.inner_packed(model, packed, device, dtype)

    def restore(self):
        self.module.hf_token_losses = self.inner
        self.module.HostCopy = self.host_copy
        if self.inner_packed is not None:
            self.module.hf_packed_losses = self.inner_packed


def counting(scorer, stub: bool = False):
    return _CountingHF(scorer, stub) if scorer.name == "cross_tokenizer" else _Counting(scorer, stub)


def _packed_forward(
    model, tokens: np.ndarray, n_ctx: int, budget: int, hf: bool, dtype: str = "fp32"
) -> float:
    """Seconds of a bare forward over `tokens` packed into full rows of n_ctx (no padding), batches of
    the token budget, in `dtype`; the logits are formed (the model's whole forward) but no loss."""
    from entroweight.scorers.forward import autocast

    n = len(tokens) // n_ctx * n_ctx
    rows = torch.as_tensor(tokens[:n].reshape(-1, n_ctx))
    rest = torch.as_tensor(tokens[n:])[None] if n < len(tokens) else None
    step = max(1, budget // n_ctx)
    start = time.perf_counter()
    with torch.inference_mode(), autocast("cpu", dtype):
        for s in range(0, len(rows), step):
            model(rows[s : s + step]) if not hf else model(input_ids=rows[s : s + step])
        if rest is not None:
            model(rest) if not hf else model(input_ids=rest)
    return time.perf_counter() - start


def _occlusion_forward(
    model, tokens: np.ndarray, padded: np.ndarray, n_ctx: int, budget: int, dtype: str = "fp32"
) -> float:
    """Occlusion's packed limit: its encoder and the baseline's decoder over `tokens` packed into full
    rows, the decoder with each row's own embedding over the `padded` rows themselves (its pads'
    states depend on that embedding), the head applied once (to the difference of the two)."""
    from entroweight.scorers.estimator_common import hidden_outputs
    from entroweight.scorers.forward import autocast

    n = max(len(tokens) // n_ctx, 1) * n_ctx
    rows = torch.as_tensor(np.resize(tokens, n).reshape(-1, n_ctx))
    whole = torch.as_tensor(padded)
    step = max(1, budget // n_ctx)
    scale = len(tokens) / n  # the packed part ran over `n` tokens
    start = time.perf_counter()
    with torch.inference_mode(), autocast("cpu", dtype), hidden_outputs(model) as head:
        base = model.encode(rows[:1])
        for s in range(0, len(rows), step):
            x = rows[s : s + step]
            model.encode(x)
            head(model.decode(x, base.expand(len(x), -1)))
    packed_s = (time.perf_counter() - start) * scale
    start = time.perf_counter()
    # (hidden states, as the scorer's: the head runs once, above; which embedding enters takes the same time)
    with torch.inference_mode(), autocast("cpu", dtype), hidden_outputs(model):
        for s in range(0, len(whole), step):
            model.decode(whole[s : s + step], base.expand(len(whole[s : s + step]), -1))
    return packed_s + time.perf_counter() - start


def _per_position_forward(model, tokens: np.ndarray, n_ctx: int, budget: int, dtype: str = "fp32") -> float:
    """decomposition's own limit: one bare forward of a model-width window per real position (batches
    of the token budget); the windows are rows of `tokens` (their content does not change the time)."""
    from entroweight.scorers.forward import autocast

    n = len(tokens)
    # a copy: the strided view is read-only, which torch warns of (the windows exist in the scorer too)
    wins = torch.from_numpy(
        np.lib.stride_tricks.sliding_window_view(np.resize(tokens, n + n_ctx), n_ctx)[:n].copy()
    )
    step = max(1, budget // n_ctx)
    start = time.perf_counter()
    with torch.inference_mode(), autocast("cpu", dtype):
        for s in range(0, n, step):
            model(wins[s : s + step])
    return time.perf_counter() - start


def _limit(name: str, model, tokens: np.ndarray, width: int, hf: bool, dtype: str, padded=None) -> float:
    if name == "occlusion":
        return _occlusion_forward(model, tokens, padded, width, BUDGET, dtype)
    if name == "decomposition":
        return _per_position_forward(model, tokens, width, BUDGET, dtype)
    return _packed_forward(model, tokens, width, BUDGET, hf, dtype)


# the host's overlap with a device, simulated on a CPU: the stub forward queues its batch on a
# `SimulatedDevice` that takes DEVICE_SHARE times the host's own time over the same rows:
# the split the H200 showed cross_tokenizer (80 % busy, docs/scaling.md)
DEVICE_SHARE = 4
SERIAL_BUSY = DEVICE_SHARE / (DEVICE_SHARE + 1)
SIM_ROWS = 4000


def _simulated_busy(stub, stage, data: Path, out: Path) -> tuple[float, float, float]:
    """(busy share, host seconds, wall seconds) of the stage over the first SIM_ROWS rows of `data`,
    its forwards a simulated device of DEVICE_SHARE times the host's time (`stub.device_s`)."""
    device, real = stub.device, stub.real
    device.s_per_token = 0.0
    host_s = _run_shard(stage, data, out, SIM_ROWS)
    device.s_per_token, device.busy = DEVICE_SHARE * host_s / max(stub.real - real, 1), 0.0
    wall_s = _run_shard(stage, data, out, SIM_ROWS)
    device.s_per_token = 0.0
    return device.busy / wall_s, host_s, wall_s


def _written_values(out: Path) -> np.ndarray:
    """The raw values (`entropy`) the stage wrote for the real positions of its shard."""
    t = pq.read_table(next(out.glob("part-*.parquet")), columns=["entropy", "n_pad"])
    vals = t.column("entropy").to_numpy(zero_copy_only=False)
    return np.concatenate(
        [np.asarray(v)[p:] for v, p in zip(vals, t.column("n_pad").to_numpy(), strict=True)]
    )


def _pad_fraction() -> float | None:
    """The pad fraction the last shard's manifest records."""
    return (getattr(_run_shard.manifest, "extra", None) or {}).get("pad_fraction")


CASES = (
    # name, scorer, options key -> model, data width
    ("causal_loss (ours d256x4)", "causal_loss", {"checkpoint": "ours"}, N_CTX),
    ("causal_loss (ours d256x4, mask_pads)", "causal_loss", {"checkpoint": "ours_masked"}, N_CTX),
    ("causal_loss (HF d256x4)", "causal_loss", {"model": "hf"}, N_CTX),
    ("cross_tokenizer (HF d256x4)", "cross_tokenizer", {"model": "hf"}, N_CTX),
    ("occlusion", "occlusion", {"checkpoint": "est512"}, N_CTX),
    ("decomposition (n_ctx 64)", "decomposition", {"checkpoint": "est64"}, 64),
)


def bench_paths(quick: bool = False) -> list[dict]:
    from entroweight.schemas import read_file_metadata

    tok = bench_tokenizer(8000, quick)
    vocab = json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"].__len__()
    out_rows = []
    with tempfile.TemporaryDirectory(prefix="bench-path-") as tmp:
        tmp = Path(tmp)
        n_rows = 16 if quick else 48
        data = {N_CTX: _shard(tmp, tok, N_CTX, n_rows), 64: _shard(tmp, tok, 64, 4 if quick else 6)}
        data["big", N_CTX] = _shard(tmp, tok, N_CTX, 200 if quick else 100_000, "big")
        sha = read_file_metadata(next(data[N_CTX].glob("part-*.parquet")))["tokenizer_sha256"]
        models = _models(tmp, sha, tok, max(vocab, 8000))
        only = os.environ.get("BENCH_SCORING_CASES")  # e.g. "occlusion,decomposition": those rows only
        for label, name, spec, width in CASES:
            if only and not any(k.strip() and k.strip() in label for k in only.split(",")):
                continue
            d = data[width]
            options = {k: models[v] for k, v in spec.items()}
            t = pq.read_table(next(d.glob("part-*.parquet")), columns=["input_ids", "n_pad"])
            ids = np.stack(t.column("input_ids").to_numpy(zero_copy_only=False)).astype(np.int64)
            n_pad = t.column("n_pad").to_numpy()
            real = int(ids.size - n_pad.sum())
            is_hf = "model" in spec
            values = {}  # dtype -> the values the stage wrote (the raw scorer output)
            for dtype in os.environ.get("BENCH_SCORING_DTYPES", ",".join(DTYPES)).split(","):
                stage = _stage(d, name, options, BUDGET, dtype)
                packed = np.concatenate([ids[r, n_pad[r] :] for r in range(len(ids))])
                seen = counting(stage.scorer)
                _run_shard(stage, d, tmp / "warm")  # warm-up
                seen.restore()
                if name == "cross_tokenizer":  # the bare forward runs over the model's tokens of the text
                    packed = np.concatenate(seen.tokens)
                model = stage.scorer._model
                _limit(name, model, packed, width, is_hf, dtype, ids)  # warm-up
                times = alternate(
                    {
                        "path": partial(_run_shard, stage, d, tmp / "out"),
                        "limit": partial(_limit, name, model, packed, width, is_hf, dtype, ids),
                    },
                    ROUNDS[quick],
                )
                pad = _pad_fraction()
                values[dtype] = _written_values(tmp / "out")
                note = (
                    f"{len(ids)} C4 rows <= {width} tokens, {real} real; {dtype}, {torch.get_num_threads()} "
                    f"thread(s); limit: {LIMITS.get(name, LIMITS[None])}; pads computed "
                    + ("?" if pad is None else f"{pad:.1%}")
                    + f"; fastest of {ROUNDS[quick]} alternated (median of the paired ratios "
                    f"{paired_median(times['path'], times['limit']):.2f})"
                )
                out_rows.append(
                    row(
                        "score-path",
                        f"{label}, {dtype}: real tok/s (vs its packed limit)",
                        real / fastest(times["path"]),
                        real / fastest(times["limit"]),
                        ">= 0.9",
                        note,
                    )
                )
            if "fp32" in values and "bf16" in values:  # what bf16 changes in the values, real text
                diff = np.abs(values["bf16"] - values["fp32"])
                out_rows.append(
                    row(
                        "score-path",
                        f"{label}: bf16 − fp32 values, max abs difference",
                        float(diff.max()),
                        None,
                        None,
                        f"mean abs difference {diff.mean():.3g} over {diff.size} real positions; mean |fp32| "
                        f"{np.abs(values['fp32']).mean():.3g}",
                    )
                )
            if os.environ.get("BENCH_SCORING_NO_FEED"):
                continue
            # feed rate and pad fraction on a whole shard (all the sample's documents): forward = zeros
            big = data.get(("big", width), d)
            feed_stage = _stage(big, name, options, BUDGET) if big is not d else stage
            stub = counting(feed_stage.scorer, stub=True)
            t_feed = median([_run_shard(feed_stage, big, tmp / "feed") for _ in range(2)])
            busy, host_s, wall_s = _simulated_busy(stub, feed_stage, big, tmp / "sim")
            stub.restore()
            t = pq.read_table(next(big.glob("part-*.parquet")), columns=["n_pad"])
            big_rows, big_real = t.num_rows, int(t.num_rows * width - pc.sum(t.column("n_pad")).as_py())
            out_rows.append(
                row(
                    "score-path",
                    f"{label}: feed rate, real tok/s (stub forward)",
                    big_real / t_feed,
                    None,
                    None,
                    f"{big_rows} rows: read -> batch -> weigh -> write, forward = zeros",
                )
            )
            out_rows.append(
                row(
                    "score-path",
                    f"{label}: busy share of a device {DEVICE_SHARE}x the host's time (simulated)",
                    busy,
                    None,
                    None,  # a diagnostic: where the host is a bottleneck (a one-segment shard's read
                    # and write are in series with its forwards by construction)
                    f"the first {SIM_ROWS} rows: the host alone {host_s:.2f} s, with the device {wall_s:.2f} s; "
                    f"in series it would be {SERIAL_BUSY:.2f} busy, fully overlapped 1",
                )
            )
    return out_rows


def bench_mfu() -> list[dict]:
    """A Llama-3.2-1B-shaped model with random weights, bf16, SDPA, 64k-token batches: the forward's
    model FLOPs utilisation (2 × params × tokens + attention, over the device's dense bf16 peak)."""
    if not torch.cuda.is_available():
        return []
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                      tie_word_embeddings=True)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    n_ctx, rows = 1024, 64  # 64k tokens per forward
    x = torch.randint(0, cfg.vocab_size, (rows, n_ctx), device="cuda")
    base, head = model.model, model.lm_head
    with torch.inference_mode():
        for _ in range(2):
            h = base(input_ids=x).last_hidden_state
        torch.cuda.synchronize()
        start, n = time.perf_counter(), 5
        for _ in range(n):
            h = base(input_ids=x).last_hidden_state
            for s in range(0, rows, 4):  # the head in chunks, as the scorer does
                head(h[s : s + 4])
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / n
    params = sum(p.numel() for p in model.parameters())
    flops = 2 * params * rows * n_ctx + 4 * cfg.num_hidden_layers * rows * n_ctx * n_ctx * cfg.hidden_size / 2
    name = torch.cuda.get_device_name()
    peak = 989e12 if "H100" in name or "H200" in name else 312e12  # dense bf16 (A100: 312)
    return [
        row(
            "score-path",
            "Llama-3.2-1B-shaped forward, tokens/s",
            rows * n_ctx / seconds,
            None,
            ">= 150k",
            name,
        ),
        row(
            "score-path",
            "Llama-3.2-1B-shaped forward, MFU",
            flops / seconds / peak,
            None,
            "0.40-0.50",
            f"bf16, {rows}x{n_ctx} tokens per forward, peak {peak / 1e12:.0f} TFLOP/s",
        ),
    ]


def run(quick: bool = False) -> list[dict]:
    threads = torch.get_num_threads()
    if not torch.cuda.is_available():
        torch.set_num_threads(bench_threads())
    try:
        rows = bench_paths(quick)
        try:
            return rows + bench_mfu()
        except Exception as e:  # a GPU problem must not lose the rows measured before it
            return rows + [
                row("score-path", "MFU: ERROR", float("nan"), note=f"{type(e).__name__}: {e}"[:300])
            ]
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":  # python -m entroweight.benchmarks.scoring_path [--quick]
    import sys

    for r in run("--quick" in sys.argv):
        print(json.dumps(r))
