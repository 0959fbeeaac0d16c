"""cross_tokenizer: a model with another tokenizer (Llama 3.2 1B's 128k) scores the data's text.

Per row: data ids -> exact bytes (token_bytes) -> valid UTF-8 runs -> the model's tokens with exact
byte spans -> per-token CE (sliding windows when longer than the model's context) -> regrouped onto
the data tokens by byte spans (transforms/align.py: `mean` as the write-up, or `sum`, which conserves
the total nats). The first model token is predicted from the model's start token (scorers/hf.py
`start_token`: what the model declares, recorded in the file metadata), so every byte of valid text
is covered; the alignment error goes into the shard manifest.

Packed rows hold several documents joined by a special token (the data's EOS). Each document is
scored as its own text, from the model's start token, never glued to its neighbour; the separator
itself carries no text: its value is 0 and it is excluded from weighting (weight 0, see `excluded`).

A document split over rows (`overflow: split`, or a packed document across windows) is scored as one
text: the score stage hands the rows of a document together and says which rows continue the one
before (`continues`, from the data's `row_in_doc`), so each row keeps its left context and no
character is cut at a row edge. Where a character is cut anyway (the end of a truncated document, a
segment that begins mid-document), the data tokens holding part of it are excluded too.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import numpy as np
from pydantic import Field

from entroweight.transforms.align import (
    AGGREGATES,
    AlignStats,
    encode_exact_batch,
    partly_covered,
    regroup,
    utf8_runs,
)
from entroweight.transforms.prefetch import prefetch

from . import hf
from .base import (
    Batching,
    HFModelOptions,
    Scored,
    Scorer,
    ScorerError,
    packs_shard_wide,
    plan_batches,
    queued,
)
from .causal_loss import HFModel
from .forward import HostCopy, check_dtype, hf_packed_losses, hf_token_losses, resolve_dtype, to_device
from .packing import pack_rows


class CrossTokenizerScorer(Scorer):
    name = "cross_tokenizer"
    needs_data_tokenizer = True
    reads_documents = True  # a split document's rows are scored as one text (its left context kept)

    class Options(HFModelOptions):
        model: str = Field(hf.LLAMA_32_1B, description="HF causal LM: hub id, directory or .gguf file.")
        aggregate: Literal[AGGREGATES] = Field(
            "mean", description="Model-token CE onto data tokens: mean or sum."
        )
        context: int = Field(
            2048, ge=4, description="Model tokens per window (at most the model's positions)."
        )
        stride: int | None = Field(
            None, ge=1, description="New tokens per later window (default context / 2)."
        )
        batch_size: int = Field(8, ge=1, description="Windows per forward pass.")

    def __init__(
        self,
        model: str = hf.LLAMA_32_1B,
        aggregate: str = "mean",
        dtype: str | None = None,
        batch_size: int = 8,
        device: str = "cpu",
        context: int = 2048,
        stride: int | None = None,
        checkpoint: str | None = None,
        **options: Any,
    ):
        super().__init__(batch_size=batch_size, device=device, **options)
        if checkpoint is not None:
            raise ScorerError("cross_tokenizer scores with an HF model: pass --model, not --checkpoint")
        if aggregate not in AGGREGATES:
            raise ScorerError(f"--aggregate must be one of {', '.join(AGGREGATES)}, not {aggregate!r}")
        if context < 4:
            raise ScorerError(f"--context must be at least 4 model tokens, not {context}")
        self.aggregate, self.context = aggregate, context
        # each later window scores `stride` new tokens after `context - stride` tokens of context
        self.stride = stride or context // 2
        if not 0 < self.stride < context:
            raise ScorerError(f"--stride must be in 1..{context - 1}, not {self.stride}")
        # what was asked ('auto' included) is the config; the worker resolves it in setup()
        self.dtype_option, self.dtype = check_dtype(dtype), None
        # the model's identity in the config, its hub revision pinned at planning, its loading: as
        # causal_loss's HF models
        self.source = HFModel(model)
        self._model = None

    def config(self) -> dict[str, Any]:
        return {
            "scorer": self.name,
            **self.source.config(),
            "aggregate": self.aggregate,
            "dtype": self.dtype_option,
            "context": self.context,
            "stride": self.stride,
            # every window read after the start token (`windows`): a text longer than one window had
            # other values before, so scores made then are not taken for these
            "start_every_window": True,
        }

    def setup(self, data_tokenizer=None) -> None:
        if data_tokenizer is None:
            raise ScorerError("cross_tokenizer needs the data's tokenizer: pass --tokenizer")
        self._data_tok = data_tokenizer
        self.dtype = resolve_dtype(self.dtype_option, self.device)  # here, where the model runs
        if self._model is None:
            self._model = self.source.load(self.device, self.dtype, self.options)
            self._model_tok = self.source.tokenizer()
            self._start = self.source.start
            # windows no longer than the model reads (the config keeps what was asked: it is hashed
            # before the model loads, and the same request always gives the same windows)
            self._max_positions = getattr(self._model.config, "max_position_embeddings", None)

    def metadata(self) -> dict[str, Any]:
        # the windows as scored: --context and --stride as asked (config) cut to the model's positions
        context, stride = self._window()
        return {
            **super().metadata(),
            **self.source.metadata(),
            "windows": {"context": context, "stride": stride},
        }

    def attention_skips_fill(self) -> bool:
        return hf.attention_skips_fill(self._model)

    def score(
        self,
        input_ids: np.ndarray,
        n_pad: np.ndarray,
        batching: Batching = Batching(),
        continues: np.ndarray | None = None,
    ) -> Scored:
        """The rows' text re-tokenized for the model, in windows of model tokens batched by length
        (`batching`'s budget), the losses regrouped onto data tokens.

        A row that `continues` the row before it (the same document, split over rows) is joined to it:
        the document is scored as one text, so no row loses its left context and no character is cut
        at a row edge. A data token with a byte no model token covers (part of a character cut where
        the given rows begin or end: a truncated document, a segment that starts mid-document) is
        excluded, as separators are: value 0, weight 0.

        The host's work overlaps the forwards: the texts go in waves of about `WAVE_BATCHES`
        forwards; while the model runs one wave, the next is decoded and re-tokenized on a background
        thread and the one before is regrouped on another (an accelerator's main thread waits for the
        device with the GIL released). Done in series, it held an H200 at 80 % busy (docs/scaling.md)."""
        input_ids, n_pad = np.asarray(input_ids), np.asarray(n_pad)
        B, T = input_ids.shape
        out = np.zeros((B, T), dtype=np.float32)
        excluded = np.zeros((B, T), dtype=bool)
        joined = np.zeros(B, dtype=bool) if continues is None else np.asarray(continues, dtype=bool).copy()
        joined[:1] = False
        chains = np.split(np.arange(B), np.flatnonzero(~joined)[1:])  # rows scored as one text
        budget = batching.batch_tokens or (batching.batch_size or self.batch_size) * self._window()[0]
        texts = (self._texts(input_ids, n_pad, w) for w in waves(chains, T - n_pad, budget))
        computed = real = 0
        regrouped = []
        with (
            closing(prefetch(texts, depth=1)) as texts,
            ThreadPoolExecutor(1, thread_name_prefix="entroweight-regroup") as regrouper,
        ):
            for wave in texts:
                losses, c, r = self._model_losses([ids for ids, _ in wave.encoded], batching)
                computed, real = computed + c, real + r
                regrouped.append(
                    regrouper.submit(self._regroup, wave, losses, out, excluded, n_pad, batching)
                )
            stats = AlignStats()
            for done in regrouped:
                stats.add(done.result())
        return Scored(out, excluded, computed, real, {"alignment": stats})

    def _texts(self, input_ids: np.ndarray, n_pad: np.ndarray, chains: list[np.ndarray]) -> Wave:
        """The texts of `chains` (rows scored as one text each) in the model's tokens: the host's
        first half (decode the data tokens to bytes, split into valid UTF-8 runs, re-tokenize)."""
        nb = self._data_tok.token_nbytes
        wave = Wave(chains)
        texts = []
        for rows in chains:
            real = np.concatenate([input_ids[r, n_pad[r] :] for r in rows]) if len(rows) else np.zeros(0, int)
            nbytes = nb[real].astype(np.int64)
            wave.nbytes.append(nbytes)
            ends, runs = np.cumsum(nbytes), []
            # each document of a packed row is its own text: split at the separators (no bytes)
            cuts = np.flatnonzero(nbytes == 0)
            for a, b in zip(np.r_[0, cuts + 1], np.r_[cuts, len(real)], strict=True):
                if b <= a:
                    continue
                base = int(ends[a - 1]) if a else 0
                raw = self._data_tok.decode_bytes(real[a:b].tolist())
                runs += [(base + s, raw[s:e].decode("utf-8")) for s, e in utf8_runs(raw)]
            wave.runs.append(runs)
            texts += [t for _, t in runs]
        wave.encoded = encode_exact_batch(self._model_tok, texts)
        return wave

    def _regroup(self, wave: Wave, losses, out, excluded, n_pad, batching: Batching) -> AlignStats:
        """The host's second half: the model tokens' `losses` onto the data tokens of the wave's rows,
        written into their rows of `out` and `excluded`."""
        T = out.shape[1]
        stats = AlignStats()
        encoded, losses = iter(wave.encoded), iter(losses)
        for rows, nbytes, runs in zip(wave.chains, wave.nbytes, wave.runs, strict=True):
            starts, ends, vals, covered = [], [], [], []
            for offset, text in runs:
                _, model_nbytes = next(encoded)
                e = np.cumsum(model_nbytes) + offset
                starts.append(e - model_nbytes)
                ends.append(e)
                vals.append(next(losses))
                covered.append((offset, offset + len(text.encode("utf-8"))))
            cat = (lambda xs: np.concatenate(xs)) if vals else (lambda xs: np.zeros(0, dtype=np.int64))
            values, chain_stats = regroup(nbytes, cat(starts), cat(ends), cat(vals), self.aggregate)
            stats.add(chain_stats)
            # separators (no bytes, no text), and tokens holding part of a character cut at an edge
            skip = (nbytes == 0) | partly_covered(nbytes, covered)
            values[skip] = 0.0
            at = 0
            for r in rows:
                n = T - int(n_pad[r])
                out[r, n_pad[r] :] = values[at : at + n]
                excluded[r, n_pad[r] :] = skip[at : at + n]
                at += n
            if batching.on_rows is not None:
                batching.on_rows(len(rows))
        return stats

    def windows(self, m: int) -> list[tuple[int, int, int]]:
        """(context start, first scored, end) model-token ranges, each read after the model's start
        token: the first window scores everything in it, each later one scores `stride` new tokens
        after as many tokens before them as fit. Every window begins with the start token, as the
        model was trained to read a text: one begun mid-text without it makes its first token the
        model's attention sink, and scored a repetitive text at 16.4 nats a token (SmolLM2; 0.4
        with the start token, 1.9 with all the text before it)."""
        context, stride = self._window()
        room = context - (self._start is not None)  # the model tokens a window holds
        out = [(0, 0, min(m, room))]
        while out[-1][2] < m:
            a = out[-1][2]
            end = min(m, a + stride)
            out.append((max(0, end - room), a, end))
        return out

    def _window(self) -> tuple[int, int]:
        """(context, stride) of the windows: as asked, cut to the positions the loaded model reads."""
        limit = getattr(self, "_max_positions", None)
        if limit and self.context > limit:
            return limit, min(self.stride, limit // 2)
        return self.context, self.stride

    def _model_losses(
        self, texts_ids: list[np.ndarray], batching: Batching
    ) -> tuple[list[np.ndarray], int, int]:
        """Per-model-token CE (float64) of each text, every token scored exactly once; the positions
        the forwards computed, and how many of them were real."""
        losses = [np.zeros(len(ids), dtype=np.float64) for ids in texts_ids]
        jobs = []  # (text index, context start, first scored, end, with start token)
        for t, ids in enumerate(texts_ids):
            if len(ids):
                jobs += [(t, c, a, e, self._start is not None) for c, a, e in self.windows(len(ids))]
        lengths = np.array([e - c + w for _, c, _, e, w in jobs], dtype=np.int64)
        # sorted by length, longest first, in batches of `batch_size` windows or of a token budget;
        # each batch as wide as its longest window, so the forward computes (almost) no pads
        batch_size = batching.batch_size or self.batch_size
        packed = self.pack and hf.packs(self._model)  # several windows per sequence (block-diagonal)
        wide = packed and packs_shard_wide(self)  # else a batch's windows cut to its longest
        plan = plan_batches(lengths, lambda n: n, batch_size, batching.batch_tokens, wide)
        computed = 0

        def launch(plan_item):  # the batch's forward queued; its values come back through a HostCopy
            nonlocal computed
            idx, width = plan_item
            seqs = []
            for j in idx:
                t, c, a, e, w = jobs[j]
                seqs.append(np.concatenate([[self._start], texts_ids[t][c:e]]) if w else texts_ids[t][c:e])
            if packed:
                p = pack_rows(seqs, width)
                computed += p.ids.size
                copy = HostCopy(hf_packed_losses(self._model, p, self.device, self.dtype))
                return copy, partial(p.rows, lengths=[len(q) for q in seqs])
            # one window per batch row, left-padded to the batch's longest
            x = np.zeros((len(idx), width), dtype=np.int64)
            mask = np.zeros((len(idx), width), dtype=np.int64)
            for row, seq in enumerate(seqs):
                x[row, width - len(seq) :] = seq
                mask[row, width - len(seq) :] = 1
            x_t, mask_t = to_device(x, self.device), to_device(mask, self.device)
            computed += x.size
            return HostCopy(hf_token_losses(self._model, x_t, mask_t, self.dtype)), list

        def place(plan_item, launched) -> None:
            copy, rows_of = launched
            for row, j in zip(rows_of(copy.arrays()[0]), plan_item[0], strict=True):
                t, c, a, e, _ = jobs[j]
                losses[t][a:e] = row[len(row) - (e - a) :]

        queued(plan, launch, place)
        return losses, computed, int(lengths.sum())


# texts scored together: about this many forwards of the budget each (on C4 at 4k and 64k tokens a
# forward, windows sorted within a wave of 8 took 1.4 and 4.1 % fill against 0.6 and 3.5 % over a
# whole segment; the host's work overlaps all but the first wave's re-tokenizing and the last's
# regrouping)
WAVE_BATCHES = 8


@dataclass
class Wave:
    """The texts of some rows on their way through `CrossTokenizerScorer.score`: per chain of rows
    (one text), its data tokens' byte counts and its valid UTF-8 runs (byte offset, text); per run,
    its model tokens and their byte counts (`encoded`)."""

    chains: list[np.ndarray]
    nbytes: list[np.ndarray] = field(default_factory=list)
    runs: list[list[tuple[int, str]]] = field(default_factory=list)
    encoded: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


def waves(chains: list[np.ndarray], lengths: np.ndarray, budget: int) -> list[list[np.ndarray]]:
    """`chains` (row indices of one text each) in consecutive groups of about `WAVE_BATCHES` forwards
    of `budget` tokens (the rows' real `lengths`); at least one group, none empty but a lone one."""
    out, size, target = [[]], 0, WAVE_BATCHES * budget
    for rows in chains:
        if out[-1] and size >= target:
            out.append([])
            size = 0
        out[-1].append(rows)
        size += int(lengths[rows].sum())
    return out
