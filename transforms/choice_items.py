"""Multiple-choice items from held-out documents: the offline downstream-accuracy task.

Each item is a prefix of a document and `choices` continuations of the same token length: the
document's own next tokens and continuations cut from other documents. A model that has learned
anything of the text's structure ranks the true continuation first more often than chance
(1/choices); lm-eval scores the items (trainers/accuracy.py) with `acc`, `acc_norm` and
`acc_mutual_info`.

What keeps an item honest, each checked on the tokenizer itself, the way lm-eval's HF model encodes
a (context, continuation) pair (`encode(context + continuation)` split after `encode(context)`):

- every choice is exactly `continuation_tokens` tokens after the prefix, alone and joined to it, so
  no choice is shorter (likelier) by its length and the prefix's tokens do not change under it;
- every choice starts a word (one space, then a non-space), so the true one cannot be told by a cut
  inside a word that the others lack; the prefix ends in no whitespace (lm-eval would move it);
- the distractors come from other documents, each from a different one;
- no text holds a special token's string (lm-eval's tokenizer would read it as the special token);
- the longest (prefix + choice) fits `max_tokens`, the model's context (lm-eval silently cuts a
  longer one from the left).

The cuts tile each document: a prefix, its continuation, then the next prefix after it (no two
items of a document share tokens), or, with a shorter `stride`, every `stride` tokens. Everything random (which spans, the distractors, the gold
position) is drawn from one seeded generator: the same documents, tokenizer and settings give the
same items, byte for byte. Nothing here looks at a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from entroweight.schemas.tokenizer import token_bytes


class ItemError(ValueError):
    """The documents do not give the items asked for (too few documents, none long enough)."""


@dataclass(frozen=True)
class Span:
    doc: int
    cut: int  # token index of the continuation's first token in its document
    prefix: str
    continuation: str


def _decode(tb: list[bytes], ids) -> str | None:
    try:
        return b"".join(tb[i] for i in ids).decode("utf-8")
    except UnicodeDecodeError:  # the span cuts a character: not a cut point
        return None


def _starts_word(s: str) -> bool:
    return len(s) > 1 and s[0] == " " and not s[1].isspace()


class _Encoder:
    """The token counts lm-eval's HF model sees, memoised per text (a prefix is tried with many choices)."""

    def __init__(self, tok):
        self.tok, self._special, self._plain = tok, {}, {}

    def special(self, text: str) -> list[int]:  # as HFLM.tok_encode: the tokenizer's own special tokens
        if text not in self._special:
            self._special[text] = self.tok.encode(text).ids
        return self._special[text]

    def plain(self, text: str) -> list[int]:  # as the unconditional request (acc_mutual_info)
        if text not in self._plain:
            self._plain[text] = self.tok.encode(text, add_special_tokens=False).ids
        return self._plain[text]

    def fits(self, prefix: str, choice: str, n: int, max_tokens: int | None) -> int | None:
        """The tokens of prefix + choice when `choice` is exactly `n` tokens after `prefix` (and alone),
        leaving the prefix's tokens as they are, and they fit `max_tokens`; else None."""
        ctx = self.special(prefix)
        whole = self.tok.encode(prefix + choice).ids
        if whole[: len(ctx)] != ctx or len(whole) - len(ctx) != n or len(self.plain(choice)) != n:
            return None
        if max_tokens is not None and len(whole) > max_tokens:
            return None
        return len(whole)


def spans(
    texts: list[str], tok, prefix_tokens: int, continuation_tokens: int, max_tokens=None, stride=None
) -> list[Span]:
    """Every cut point of every document, in document order: the prefix's `prefix_tokens` tokens and the
    next `continuation_tokens`, each one a valid item for its own continuation. Cuts lie at least
    `stride` tokens apart (default prefix + continuation: no two items of a document share a token)."""
    stride = stride or prefix_tokens + continuation_tokens
    tb, enc = token_bytes(tok), _Encoder(tok)
    # lm-eval's HF tokenizer reads a special token's string ("<|eos|>") in text as that token; ours reads
    # it as text (schemas.tokenizer.text_as_data): leave such cuts out, their lengths would differ
    specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    out: list[Span] = []
    for d, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False).ids
        pos = prefix_tokens
        while pos + continuation_tokens <= len(ids):
            prefix = _decode(tb, ids[pos - prefix_tokens : pos])
            cont = _decode(tb, ids[pos : pos + continuation_tokens])
            ok = (
                prefix is not None
                and cont is not None
                and prefix == prefix.rstrip()
                and _starts_word(cont)
                and not any(sp in prefix or sp in cont for sp in specials)
                and enc.fits(prefix, cont, continuation_tokens, max_tokens) is not None
            )
            if ok:
                out.append(Span(d, pos, prefix, cont))
                pos += stride
            else:
                pos += 1
    return out


def build_items(
    texts: list[str],
    tok,
    prefix_tokens: int = 48,
    continuation_tokens: int = 16,
    choices: int = 4,
    seed: int = 0,
    max_items: int | None = None,
    max_tokens: int | None = None,
    stride: int | None = None,
) -> list[dict]:
    """The items, in document order: {"prefix", "choices", "label", "doc", "cut", "tokens"} where
    `tokens` is the longest prefix + choice in tokens. `tok`: a `tokenizers.Tokenizer`. `stride`: the
    least distance between two cuts of a document (default prefix + continuation, no overlap; shorter
    gives more items from the same documents, which then share text and are not independent)."""
    if prefix_tokens < 1 or continuation_tokens < 1 or choices < 2 or (stride is not None and stride < 1):
        raise ItemError(
            "an item needs a prefix, a continuation, at least 2 choices and a stride of 1 or more"
        )
    if max_tokens is not None and prefix_tokens + continuation_tokens > max_tokens:
        raise ItemError(
            f"prefix {prefix_tokens} + continuation {continuation_tokens} tokens do not fit the model's "
            f"context of {max_tokens} tokens (lm-eval would cut the prefix from the left)"
        )
    pool = spans(texts, tok, prefix_tokens, continuation_tokens, max_tokens, stride)
    docs = {s.doc for s in pool}
    if len(docs) < choices:
        raise ItemError(
            f"{len(docs)} of {len(texts)} documents hold a {prefix_tokens}+{continuation_tokens}-token cut; "
            f"{choices} choices need distractors from {choices - 1} other documents"
        )
    rng = np.random.default_rng(seed)
    chosen = np.arange(len(pool))
    if max_items is not None and max_items < len(pool):
        chosen = np.sort(rng.choice(len(pool), size=max_items, replace=False))
    enc, items = _Encoder(tok), []
    for i in chosen:
        true = pool[i]
        picked: list[Span] = []
        used = {true.doc}
        lengths = [enc.fits(true.prefix, true.continuation, continuation_tokens, max_tokens)]
        for j in rng.permutation(len(pool)):  # lazily: stops at the first few that qualify
            cand = pool[j]
            if cand.doc in used or cand.continuation == true.continuation:
                continue
            n = enc.fits(true.prefix, cand.continuation, continuation_tokens, max_tokens)
            if n is None:
                continue
            picked.append(cand)
            used.add(cand.doc)
            lengths.append(n)
            if len(picked) == choices - 1:
                break
        if len(picked) < choices - 1:
            continue  # no distractors join this prefix cleanly: left out (counted by the caller)
        label = int(rng.integers(choices))
        conts = [s.continuation for s in picked]
        conts.insert(label, true.continuation)
        items.append(
            {
                "prefix": true.prefix,
                "choices": conts,
                "label": label,
                "doc": true.doc,
                "cut": true.cut,
                "tokens": max(lengths),
            }
        )
    if not items:
        raise ItemError("no item could be built from these documents")
    return items
