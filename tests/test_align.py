"""Byte-span regrouping on real tokenizers: Llama 3 (model side) vs the 1k BPE (data side)."""

from __future__ import annotations

import numpy as np
import pytest

from entroweight.transforms.align import AlignmentError, encode_exact, regroup, spans, utf8_runs
from entroweight.transforms.tokenizer import load_tokenizer

TEXTS = [
    "Café naïve façade — déjà vu. 😀👍🏽 Emoji! 日本語のテキストと中文字符。 Ünïcödé   spaces\n\ttabs",
    " leading space, then <|endoftext|> as plain text and a trailing space ",
    "🎉",
]


def test_hand_made_spans_give_known_values():
    # data tokens of 2 and 3 bytes; model tokens cover byte 0 (loss 1) and bytes 1-4 (loss 8)
    data, starts, ends, losses = np.array([2, 3]), np.array([0, 1]), np.array([1, 5]), np.array([1.0, 8.0])
    summed, stats = regroup(data, starts, ends, losses, "sum")
    np.testing.assert_allclose(summed, [1 + 8 / 4, 3 * 8 / 4])  # 8 nats spread over 4 bytes
    assert stats.max_rel_err == 0 and stats.bytes_uncovered == 0
    mean, _ = regroup(data, starts, ends, losses, "mean")
    np.testing.assert_allclose(mean, [(1 + 8) / 2, 8])  # each byte carries its token's whole loss


def brute_force(data_nbytes, model_nbytes, losses, aggregate):
    """Byte by byte in plain Python: the reference the vectorised regroup must match."""
    per_byte = []
    for n, loss in zip(model_nbytes, losses, strict=True):
        per_byte += [loss / n if aggregate == "sum" else loss] * int(n)
    out, pos = [], 0
    for n in data_nbytes:
        chunk = per_byte[pos : pos + n]
        pos += n
        out.append(sum(chunk) if aggregate == "sum" else (sum(chunk) / len(chunk) if chunk else 0.0))
    return np.array(out)


@pytest.fixture(scope="module")
def llama3(llama3_tokenizer):
    return load_tokenizer(llama3_tokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_regroup_non_ascii_on_real_tokenizers(text, tokenizer_dir, llama3):
    data_tok, model_tok = load_tokenizer(tokenizer_dir), llama3
    raw = text.encode("utf-8")
    data_ids = data_tok.tokenizer.encode(text, add_special_tokens=False).ids
    data_nbytes = data_tok.token_nbytes[data_ids]
    assert data_nbytes.sum() == len(raw)  # byte-level: CJK and emoji become several byte tokens
    model_ids, model_nbytes = encode_exact(model_tok, text)
    assert model_tok.tokenizer.id_to_token(int(model_ids[0])) != "<|endoftext|>"
    losses = np.arange(1, len(model_ids) + 1, dtype=np.float64)  # known per-token values
    starts, ends = spans(model_nbytes)
    for aggregate in ("sum", "mean"):
        values, stats = regroup(data_nbytes, starts, ends, losses, aggregate)
        np.testing.assert_allclose(
            values, brute_force(data_nbytes, model_nbytes, losses, aggregate), rtol=1e-12
        )
        assert stats.bytes_uncovered == 0 and stats.tokens_uncovered == 0
        assert stats.max_rel_err < 1e-5
    summed, _ = regroup(data_nbytes, starts, ends, losses, "sum")
    assert abs(summed.sum() - losses.sum()) / losses.sum() < 1e-5  # conservation


def test_mean_equals_loss_where_tokens_coincide(llama3):
    tok = llama3
    ids, nbytes = encode_exact(tok, "The quick brown fox jumps over the lazy dog.")
    losses = np.random.default_rng(0).uniform(0, 10, len(ids))
    starts, ends = spans(nbytes)
    mean, _ = regroup(nbytes, starts, ends, losses, "mean")
    summed, _ = regroup(nbytes, starts, ends, losses, "sum")
    np.testing.assert_allclose(mean, losses)
    np.testing.assert_allclose(summed, losses)


def test_windows_cut_mid_character_report_uncovered_bytes():
    raw = "日本語".encode()[1:-1]  # starts with 2 continuation bytes, ends with half a character
    assert utf8_runs(raw) == [(2, 5)]
    assert utf8_runs(b"abc") == [(0, 3)]
    assert utf8_runs(b"") == []
    # a model token covering only the valid run: the cut bytes are reported, sum still conserved
    data = np.array([1, 1, 3, 2])
    values, stats = regroup(data, np.array([2]), np.array([5]), np.array([6.0]), "sum")
    np.testing.assert_allclose(values, [0, 0, 6, 0])
    assert stats.bytes_uncovered == 4 and stats.tokens_uncovered == 3 and stats.max_rel_err < 1e-12


def test_non_byte_exact_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(AlignmentError, match="byte for byte"):
        encode_exact(load_tokenizer(tmp_path), "Hello")
