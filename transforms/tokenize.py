"""Documents -> sequences: batch-encode, then left-pad one document per sequence or pack windows.

A document longer than n_ctx tokens (one document per row) either continues in the next rows
(`overflow="split"`, the default: every piece but the last is full, the last is left-padded, all
keep the document's id and count their place in it, `row_in_doc`, so no text is lost and a reader
finds the document's rows without comparing ids), or keeps its first n_ctx tokens (`"truncate"`, the
write-up's layout; what it drops is counted: `n_truncated`, `bytes_dropped`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from entroweight.schemas import sequence_schema
from entroweight.schemas.weighted import lists

from .tokenizer import LoadedTokenizer

OVERFLOW = ("split", "truncate")  # what happens to a document longer than n_ctx (module docstring)


class SequenceBuilder:
    """Turns DOCUMENT_SCHEMA batches into sequence batches for one shard.

    Left padding (default): a document per row (split over rows, or truncated: see the module
    docstring), pads on the left. Packing: the documents' tokens joined by eos and cut into `n_ctx`
    windows; the last window is left-padded.
    """

    def __init__(self, tok: LoadedTokenizer, n_ctx: int, pack: bool, shard: str, overflow: str = "split"):
        if tok.pad_id is None:
            raise ValueError(
                f"the tokenizer {tok.path} has no pad token; train one with `entroweight train-tokenizer`"
            )
        if pack and tok.eos_id is None:
            raise ValueError(f"--pack needs an eos token, and the tokenizer {tok.path} has none")
        if overflow not in OVERFLOW:
            raise ValueError(f"--overflow is one of {', '.join(OVERFLOW)}, not {overflow!r}")
        self.tok, self.n_ctx, self.pack, self.shard = tok, n_ctx, pack, shard
        self.truncate = overflow == "truncate" and not pack
        self.schema = sequence_schema(tok.vocab_size, packed=pack)
        self.ids_type = self.schema.field("input_ids").type.value_type
        self.np_dtype = np.uint16 if self.ids_type == pa.uint16() else np.int32
        self.n_seq = 0
        self.docs_out = 0
        self.n_truncated = 0  # documents cut (--overflow truncate) ...
        self.bytes_dropped = 0  # ... and the UTF-8 bytes of text they lost
        self.n_real_tokens = 0
        self.n_bytes = 0
        # An upper bound of characters that n_ctx tokens can cover: longer texts are cut before
        # encoding, so a 50 MB document never becomes a huge id list (truncate mode only).
        max_token_len = int(tok.token_nbytes.max()) if tok.vocab_size else 1
        self.char_budget = 2 * n_ctx * max(max_token_len, 1) + 64
        self._stream: list[np.ndarray] = []  # packing: pending token runs
        # packing: (doc id, tokens of it still pending, windows already emitted holding part of it)
        self._stream_docs: list[tuple[str, int, int]] = []

    def encode(self, docs: pa.RecordBatch) -> list[list[int]]:
        """Token ids of each document (no state touched: may run in another thread than `add`)."""
        texts = docs.column("text").to_pylist()
        if self.truncate:
            texts = [t if len(t) <= self.char_budget else _cut(t, self.char_budget) for t in texts]
        encs = self.tok.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encs]

    def add(self, docs: pa.RecordBatch, ids: list[list[int]] | None = None) -> Iterator[pa.RecordBatch]:
        """Sequences of `docs`, given their `encode` output if it was computed ahead."""
        if docs.num_rows == 0:
            return
        doc_ids = docs.column("id").to_pylist()
        if ids is None:
            ids = self.encode(docs)
        self.docs_out += len(doc_ids)
        if self.pack:
            yield from self._pack(doc_ids, ids)
        elif not self.truncate:
            yield self._split(doc_ids, ids)
        else:
            batch = self._left_pad(doc_ids, ids)
            # a full row is truncated when its tokens cover fewer bytes than the text has
            full = np.flatnonzero(batch.column("n_pad").to_numpy() == 0)
            n_bytes = batch.column("n_bytes").to_numpy()
            text_bytes = pc.binary_length(docs.column("text")).to_numpy()  # UTF-8 bytes, no Python strings
            lost = text_bytes[full] - n_bytes[full]
            self.n_truncated += int((lost > 0).sum())
            self.bytes_dropped += int(lost[lost > 0].sum())
            yield batch

    def finish(self) -> Iterator[pa.RecordBatch]:
        if self.pack and self._stream_docs:
            yield from self._emit_windows(final=True)

    # -- one document per sequence
    def _left_pad(self, doc_ids: list[str], ids: list[list[int]]) -> pa.RecordBatch:
        n = self.n_ctx
        matrix = np.full((len(ids), n), self.tok.pad_id, dtype=self.np_dtype)
        n_pad = np.empty(len(ids), dtype=np.int32)
        for row, seq in enumerate(ids):
            k = min(len(seq), n)
            if k:
                matrix[row, n - k :] = seq[:k]
            n_pad[row] = n - k
        return self._batch(matrix, n_pad, doc_ids, np.zeros(len(ids), np.int32))

    def _split(self, doc_ids: list[str], ids: list[list[int]]) -> pa.RecordBatch:
        """Each document over ceil(len / n_ctx) rows: full rows, then the rest left-padded."""
        n = self.n_ctx
        pieces = [max(1, -(-len(seq) // n)) for seq in ids]
        matrix = np.full((sum(pieces), n), self.tok.pad_id, dtype=self.np_dtype)
        n_pad = np.zeros(len(matrix), dtype=np.int32)
        row = 0
        for seq in ids:
            seq = np.asarray(seq, dtype=self.np_dtype)
            full, rest = divmod(len(seq), n)
            matrix[row : row + full] = seq[: full * n].reshape(full, n)
            row += full
            if rest or not full:  # the last piece: left-padded
                matrix[row, n - rest :] = seq[full * n :]
                n_pad[row] = n - rest
                row += 1
        row_in_doc = np.concatenate([np.arange(k, dtype=np.int32) for k in pieces]) if pieces else []
        rows_doc = [d for d, k in zip(doc_ids, pieces, strict=True) for _ in range(k)]
        return self._batch(matrix, n_pad, rows_doc, np.asarray(row_in_doc, np.int32))

    # -- packed windows
    def _pack(self, doc_ids: list[str], ids: list[list[int]]) -> Iterator[pa.RecordBatch]:
        eos = self.tok.eos_id
        for seq in ids:
            seq.append(eos)
        lengths = [len(seq) for seq in ids]
        # one array per batch, not per document: a numpy call per document costs more than the copy
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.np_dtype, count=sum(lengths))
        self._stream.append(flat)
        self._stream_docs.extend((d, n, 0) for d, n in zip(doc_ids, lengths, strict=True))
        yield from self._emit_windows(final=False)

    def _emit_windows(self, final: bool) -> Iterator[pa.RecordBatch]:
        n = self.n_ctx
        stream = np.concatenate(self._stream) if self._stream else np.empty(0, self.np_dtype)
        n_full = len(stream) // n
        n_windows = n_full + (final and len(stream) % n > 0)
        if n_windows == 0:
            return
        matrix = np.full((n_windows, n), self.tok.pad_id, dtype=self.np_dtype)
        matrix[:n_full] = stream[: n_full * n].reshape(n_full, n)
        n_pad = np.zeros(n_windows, dtype=np.int32)
        if n_windows > n_full:
            rest = stream[n_full * n :]
            matrix[-1, n - len(rest) :] = rest
            n_pad[-1] = n - len(rest)
        # which documents each window holds
        window_docs: list[list[str]] = [[] for _ in range(n_windows)]
        # of each window's first document: how many windows before this one hold part of it
        row_in_doc = np.zeros(n_windows, dtype=np.int32)
        pos, pending = 0, []
        for doc_id, length, before in self._stream_docs:
            first, last = pos // n, (pos + length - 1) // n
            for w in range(first, min(last, n_windows - 1) + 1):
                if not window_docs[w]:
                    row_in_doc[w] = before + w - first
                window_docs[w].append(doc_id)
            if last >= n_windows:  # (the rest of) the document waits for the next window
                pending.append(
                    (doc_id, min(length, pos + length - n_windows * n), before + max(0, n_windows - first))
                )
            pos += length
        consumed = n_windows * n
        self._stream = [stream[consumed:]] if len(stream) > consumed else []
        self._stream_docs = pending
        yield self._batch(matrix, n_pad, [d[0] for d in window_docs], row_in_doc, window_docs)

    def _batch(self, matrix, n_pad, doc_ids, row_in_doc, window_docs=None) -> pa.RecordBatch:
        n_bytes = self.tok.token_nbytes[matrix].sum(axis=1, dtype=np.int64)
        seq_ids = [f"{self.shard}:{self.n_seq + i}" for i in range(len(doc_ids))]
        self.n_seq += len(doc_ids)
        self.n_real_tokens += int(matrix.size - n_pad.sum())
        self.n_bytes += int(n_bytes.sum())
        arrays = [
            pa.array(seq_ids, pa.string()),
            pa.array(doc_ids, pa.string()),
            pa.array(row_in_doc, pa.int32()),
            lists(matrix, self.ids_type),
            pa.array(n_pad, pa.int32()),
            pa.array(n_bytes, pa.int64()),
        ]
        if self.pack:
            arrays.append(pa.array(window_docs, pa.list_(pa.string())))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def _cut(text: str, budget: int) -> str:
    """The first `budget` characters, backed off to a whitespace so no word is split."""
    head = text[:budget]
    space = max(head.rfind(" ", budget - budget // 8), head.rfind("\n", budget - budget // 8))
    return head[:space] if space > 0 else head
