"""A teacher: a causal LM that draws sequences by ancestral sampling, with each token's exact entropy.

What the synthesize stage (pipelines/synthesize.py) runs: the model is one of our llama checkpoints
or any Hugging Face causal LM (a .gguf file included), loaded through causal_loss's `ModelSource`s, so
that its identity (sha256), vocabulary, width and start token are what `causal_loss` reads of the same
model. Sampling is incremental (a KV cache: our llama reads the keys and values of the positions
before through its `Layout.prefix`; an HF model through `past_key_values`), batched, and each row's
draws depend on its own seed alone: token t of a row is the inverse CDF of the distribution at a
uniform drawn from `numpy.random.default_rng([seed, row_seed])`, never from a shared stream, so a row
is the same whatever batch or shard it is drawn in (to the float rounding of a batched forward).

The values are those of the distribution sampled from, p = softmax(logits / temperature):
`entropy` H_t = −Σ p log p and `surprisal` −log p(x_t), in nats, both of the same row as written
(a row's context is its left padding and its prefix for our llama, the model's start token and the
prefix for an HF model: what `causal_loss` reads of the row), so at temperature 1 the surprisal is
`causal_loss`'s value of the teacher on the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from entroweight.models.packing import Layout

from .causal_loss import HFModel, ModelSource, OurCheckpoint
from .forward import autocast, to_device


class TeacherError(ValueError):
    """A teacher that cannot sample (not causal, no KV cache, no start token); the message says why."""


def teacher_source(checkpoint: str | None = None, model: str | None = None) -> ModelSource:
    """The teacher named by exactly one of `checkpoint` (ours, a llama) or `model` (HF id, directory or
    .gguf). Cheap: no model is loaded."""
    if (checkpoint is None) == (model is None):
        raise TeacherError(
            "give exactly one teacher: --checkpoint (ours, a llama) or --model (HF id, directory or .gguf)"
        )
    if checkpoint is not None:
        source = OurCheckpoint(checkpoint)  # refuses a kind that is not causal
        if source.info.get("kind") != "llama":
            raise TeacherError(
                f"{checkpoint} holds a {source.info.get('kind')} model; the synthesize stage samples from a "
                "llama (its KV cache) or a Hugging Face causal LM"
            )
        return source
    return HFModel(model)


class Incremental:
    """A model read one token at a time: `start` the rows' contexts, then `step` each new token."""

    def start(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """(B, C) left-padded contexts (`real`: their real tokens) -> (B, V) logits of the first draw."""
        raise NotImplementedError

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B,) the tokens just drawn -> (B, V) logits of the next draw."""
        raise NotImplementedError


class LlamaIncremental(Incremental):
    """Our llama with a KV cache: each layer's keys and values of the positions so far are the `prefix`
    of the next forward (models/packing.py `Layout`). A model that attends to its left padding reads
    the pads as the row shows them; a `mask_pads` model reads positions from its first real token."""

    def __init__(self, model):
        self.model = model
        self.mask_pads = bool(model.config.mask_pads)

    def start(self, ids, real):
        kv: list = []
        mask = real if self.mask_pads else None
        h = self.model.forward_hidden(self.model.embed(ids), attention_mask=mask, capture=kv, last=1)
        self.cache, self.real = kv, real.bool()
        return self.model.head(h[:, -1])

    def step(self, tokens):
        B, P = self.real.shape
        self.real = torch.cat([self.real, torch.ones_like(self.real[:, :1])], dim=1)
        if self.mask_pads:  # a pad is seen by nothing but itself; positions count real tokens
            positions = (self.real.sum(1, keepdim=True) - 1).clamp(min=0)
            layout = Layout(positions=positions, mask=self.real[:, None, None, :], prefix=self.cache)
        else:  # the padding is context: every position before is read
            mask = torch.ones(1, P + 1, dtype=torch.bool, device=tokens.device)
            layout = Layout(offset=P, mask=mask, prefix=self.cache)
        kv: list = []
        h = self.model.forward_hidden(self.model.embed(tokens[:, None]), layout=layout, capture=kv)
        self.cache = [
            (torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
            for (pk, pv), (k, v) in zip(self.cache, kv, strict=True)
        ]
        return self.model.head(h[:, -1])


class HFIncremental(Incremental):
    """An HF causal LM with `past_key_values`: each row is read from the model's start token (as
    `causal_loss` reads it), its left padding masked, positions from its first real token."""

    def __init__(self, model, start: int | None):
        self.model, self.start_id = model, start

    def start(self, ids, real):
        if self.start_id is not None:  # the start token just before each row's first real token
            B, C = ids.shape
            ids = torch.cat([torch.zeros_like(ids[:, :1]), ids], dim=1)
            real = torch.cat([torch.zeros_like(real[:, :1]), real], dim=1)
            first = C - (real[:, 1:].sum(1))  # index of the start token in the widened row
            rows = torch.arange(B, device=ids.device)
            ids[rows, first] = self.start_id
            real[rows, first] = True
        self.mask = real.long()
        ids = torch.where(real.bool(), ids, torch.zeros_like(ids))
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True)
        self.past, self.next_pos = out.past_key_values, positions[:, -1:] + 1
        return out.logits[:, -1]

    def step(self, tokens):
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=self.next_pos,
            past_key_values=self.past,
            use_cache=True,
        )
        self.past, self.next_pos = out.past_key_values, self.next_pos + 1
        return out.logits[:, -1]


def incremental(source: ModelSource, model) -> Incremental:
    if isinstance(source, OurCheckpoint):
        return LlamaIncremental(model)
    if source.start is None:
        raise TeacherError(
            f"{source.model} declares no start token and its vocabulary has no begin- or end-of-text token: "
            "the first token of a row would be drawn from nothing"
        )
    return HFIncremental(model, source.start)


@dataclass
class Drawn:
    """(B, L) of the drawn tokens, their entropy and surprisal (nats, fp32)."""

    tokens: np.ndarray
    entropy: np.ndarray
    surprisal: np.ndarray


def uniforms(seeds: list[int], run_seed: int, length: int) -> np.ndarray:
    """(B, length) float64 uniforms in [0, 1): row r's from its own stream, (run_seed, seeds[r])."""
    return np.stack([np.random.default_rng([run_seed, s]).random(length) for s in seeds])


def draw(
    decoder: Incremental,
    context: np.ndarray,
    real: np.ndarray,
    u: np.ndarray,
    temperature: float,
    device: str = "cpu",
    dtype: str = "fp32",
) -> Drawn:
    """Ancestral sampling of `u.shape[1]` tokens after each row's left-padded `context` (B, C), the
    distribution at each step softmax(logits / temperature) in fp32, each token its inverse CDF at the
    row's uniform (fp64 cumulative sums)."""
    B, L = u.shape
    tokens = torch.zeros((B, L), dtype=torch.long, device=device)
    entropy = torch.zeros((B, L), dtype=torch.float32, device=device)
    surprisal = torch.zeros((B, L), dtype=torch.float32, device=device)
    at = to_device(u, device)
    with torch.inference_mode(), autocast(device, dtype):
        logits = decoder.start(to_device(context, device), to_device(real, device).bool())
        for t in range(L):
            logp = torch.log_softmax(logits.float() / temperature, dim=-1)
            p = logp.exp()
            entropy[:, t] = -torch.where(p > 0, p * logp, 0.0).sum(-1)
            cdf = p.double().cumsum(-1)
            # right=True: the first token whose cumulative mass exceeds the draw (never one of p = 0)
            x = torch.searchsorted(cdf, (at[:, t] * cdf[:, -1])[:, None], right=True)
            x = x.clamp(max=p.shape[-1] - 1)
            surprisal[:, t] = -logp.gather(1, x)[:, 0]
            tokens[:, t] = x[:, 0]
            if t + 1 < L:
                logits = decoder.step(x[:, 0])
    return Drawn(tokens.cpu().numpy(), entropy.cpu().numpy(), surprisal.cpu().numpy())


@dataclass
class Excess:
    """(B, L) per token of the rows read: the exact KL(teacher || student) of the two distributions
    before the token, the student's CE on it, and the teacher's entropy H there (nats, fp64)."""

    kl: np.ndarray
    ce: np.ndarray
    entropy: np.ndarray


def excess(
    teacher: Incremental,
    student: Incremental,
    context: np.ndarray,
    real: np.ndarray,
    tokens: np.ndarray,
    temperature: float = 1.0,
    device: str = "cpu",
) -> Excess:
    """Both models read the same rows, teacher-forced through their KV caches (the path `draw` samples
    by, so the teacher's distribution at each token is the one it was drawn from: softmax(logits /
    temperature)); the student's is softmax(logits). KL_t = Σ_v p(v) (log p(v) − log q(v)) over the
    teacher's vocabulary (a student's larger one: ids the teacher never draws); E[CE − H] = KL."""
    B, L = tokens.shape
    kl, ce, ent = (np.zeros((B, L)) for _ in range(3))
    x = to_device(tokens, device)
    with torch.inference_mode():
        lt = teacher.start(to_device(context, device), to_device(real, device).bool())
        ls = student.start(to_device(context, device), to_device(real, device).bool())
        for t in range(L):
            logp = torch.log_softmax(lt.double() / temperature, dim=-1)
            V = logp.shape[-1]
            if ls.shape[-1] < V:
                raise TeacherError(
                    f"the student's vocabulary ({ls.shape[-1]}) is smaller than the teacher's ({V}): the KL "
                    "is infinite wherever the teacher puts mass on the rest"
                )
            logq = torch.log_softmax(ls.double(), dim=-1)
            p = logp.exp()
            terms = torch.where(p > 0, p * (logp - logq[:, :V]), 0.0)
            kl[:, t] = terms.sum(-1).cpu().numpy()
            ent[:, t] = (-torch.where(p > 0, p * logp, 0.0).sum(-1)).cpu().numpy()
            ce[:, t] = (-logq.gather(1, x[:, t : t + 1])[:, 0]).cpu().numpy()
            if t + 1 < L:
                lt, ls = teacher.step(x[:, t]), student.step(x[:, t])
    return Excess(kl, ce, ent)


def excess_of_rows(
    heldout: str,
    student: str,
    checkpoint: str | None = None,
    model: str | None = None,
    device: str = "cpu",
    batch_size: int = 32,
) -> dict:
    """A student checkpoint (ours, a llama) on held-out rows of a synthesize output (`heldout`) drawn
    from the teacher named by `checkpoint` or `model` (the output's record names it: it must match),
    at the temperature recorded. Per row: the summed KL(teacher || student), CE − H (the student's CE
    on the drawn token less the teacher's entropy there) and the tokens; and the means per token."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from entroweight.schemas.datadir import DataDir, DataDirError
    from entroweight.schemas.weighted import EXCLUDED, matrix

    try:
        d = DataDir(heldout).require(hint="synthesize the held-out rows first").require_one_config()
    except DataDirError as e:
        raise TeacherError(str(e)) from None
    meta = d.metadata
    source = teacher_source(checkpoint, model)
    if d.stage != "synthesize" or meta.get("teacher") != source.config():
        raise TeacherError(f"{heldout} was not drawn from the teacher {checkpoint or model}")
    teacher = incremental(source, source.load(device, "fp32", {}))
    pupil_source = OurCheckpoint(student)
    if pupil_source.info.get("kind") != "llama":
        raise TeacherError(
            f"{student} holds a {pupil_source.info.get('kind')}: the student is read as a llama"
        )
    pupil = incremental(pupil_source, pupil_source.load(device, "fp32", {}))
    names, kl, ce_h, tokens = [], [], [], []
    for part in d.parts:
        t = pq.read_table(pa.BufferReader(part.read()), columns=["seq_id", "input_ids", "n_pad", EXCLUDED])
        if any(len(v) for v in t.column(EXCLUDED).to_pylist()):
            raise TeacherError(
                f"{part.location}: rows that continue prefixes are not evaluated (draw without)"
            )
        ids, n_pad = matrix(t.column("input_ids")).astype(np.int64), t.column("n_pad").to_numpy()
        for C in np.unique(n_pad):  # rows of one context width together
            rows = np.flatnonzero(n_pad == C)
            for a in range(0, rows.size, batch_size):
                r = rows[a : a + batch_size]
                context, drawn = ids[r, :C], ids[r, C:]
                e = excess(
                    teacher,
                    pupil,
                    context,
                    np.zeros_like(context, dtype=bool),
                    drawn,
                    float(meta.get("temperature", 1.0)),
                    device,
                )
                names += t.column("seq_id").take(pa.array(r)).to_pylist()
                kl += e.kl.sum(1).tolist()
                ce_h += (e.ce - e.entropy).sum(1).tolist()
                tokens += [drawn.shape[1]] * len(r)
    n = float(sum(tokens))
    return {
        "kl": sum(kl) / n,
        "ce_minus_h": sum(ce_h) / n,
        "tokens": int(n),
        "rows": {"seq_id": names, "kl": kl, "ce_minus_h": ce_h, "tokens": tokens},
    }
