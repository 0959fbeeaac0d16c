"""A T-FREE-style output head: hashed trigram multi-label prediction instead of a vocabulary softmax.

T-FREE (Deiseroth et al. 2024, "T-FREE: Subword Tokenizer-Free Generative LLMs via Sparse
Representations for Memory-Efficient Embeddings", arXiv 2406.19223) describes each word by its
character trigrams, hashes each trigram m times into a small space of n_hash positions, and trains
the head as n_hash independent sigmoids with BCE against that multi-hot pattern; decoding scores
every dictionary entry by its activated positions and picks the best.

Here the dictionary is our tokenizer's vocabulary: token v's pattern is the set of positions of the
byte trigrams of its bytes (with a boundary symbol at both ends), each hashed `n_active` times. The
body and the input embedding are the llama decoder's; only the head changes (d_model x n_hash instead
of d_model x vocab_size).

Scores and the distribution used for BPB: s_v = the mean of the head logits at v's positions (T-FREE
normalises by the number of activations too); decoding picks argmax_v s_v and BPB uses softmax(s), a
proper distribution over the vocabulary. The sum of the logits would be the exact BCE model conditioned
on emitting a vocabulary pattern (log P(pattern_v) = sum + a shared term), but it favours tokens with
few positions: measured on the C4 sample after 200 steps, sum gave CE 15.4 nats and 0% top-1, mean
6.7 nats and 1.6% (uniform is 6.93). `forward(ids)` returns these scores, so eval-bpb and generation
see an ordinary (B, T, V) logits tensor; `forward(ids, hashed=True)` returns the (B, T, n_hash) head
logits the `tfree_bce` loss trains.

Without token bytes (no tokenizer given), token v's pattern hashes its id: a Bloom-filter head with
no shared morphology, still a valid model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .llama import Llama

# Carter-Wegman hashing h_k(x) = ((A_k·x + B_k) mod P) mod n_hash with fixed constants: stable across
# runs and machines (Python's hash() is salted), and simple enough to check by hand.
P = 2**31 - 1
HASH_A = (1103515245, 48271, 69621, 16807, 39373, 40692, 40014, 53668)
HASH_B = (12345, 11, 7, 3, 101, 1009, 10007, 100003)
BOUND = 256  # the word-boundary symbol, outside the byte range
BASE = 258  # trigram key = s0·BASE² + s1·BASE + s2
ID_KEY = BASE**3  # tokens without bytes (specials) hash key ID_KEY + id, past every trigram key


def trigram_keys(token: bytes, token_id: int) -> list[int]:
    if not token:
        return [ID_KEY + token_id]
    s = [BOUND, *token, BOUND]
    return sorted({s[i] * BASE * BASE + s[i + 1] * BASE + s[i + 2] for i in range(len(s) - 2)})


def token_positions(token: bytes, token_id: int, n_hash: int, n_active: int) -> list[int]:
    """The sorted, unique head positions token `token_id` (bytes `token`) activates."""
    return sorted(
        {
            (HASH_A[k] * x + HASH_B[k]) % P % n_hash
            for x in trigram_keys(token, token_id)
            for k in range(n_active)
        }
    )


class TFree(Llama):
    @dataclass
    class Config(Llama.Config):
        n_hash: int = 1024  # head width (T-FREE's v); the vocabulary may be larger
        n_active: int = 4  # hashes per trigram (T-FREE's m)
        token_bytes: list[str] | None = None  # hex bytes per token id (the trainer fills it from --tokenizer)

        def __post_init__(self):
            super().__post_init__()
            if self.tie_embeddings:
                raise ValueError("a T-FREE head has n_hash outputs, not vocab_size: set tie_embeddings false")
            if not 1 <= self.n_active <= len(HASH_A):
                raise ValueError(f"n_active must be in 1..{len(HASH_A)}, not {self.n_active}")
            if self.token_bytes is not None and len(self.token_bytes) != self.vocab_size:
                raise ValueError(
                    f"token_bytes lists {len(self.token_bytes)} tokens but vocab_size is {self.vocab_size}"
                )

    wants_token_bytes = True  # the trainer fills Config.token_bytes from the tokenizer

    def __init__(self, config: TFree.Config):
        super().__init__(config)
        c = config
        self.lm_head = nn.Linear(c.d_model, c.n_hash, bias=False)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=c.init_std)
        tb = [bytes.fromhex(h) for h in c.token_bytes] if c.token_bytes else [b""] * c.vocab_size
        rows = [token_positions(b, i, c.n_hash, c.n_active) for i, b in enumerate(tb)]
        codes = torch.full((c.vocab_size, max(map(len, rows))), -1, dtype=torch.int64)
        for i, r in enumerate(rows):
            codes[i, : len(r)] = torch.tensor(r)
        # derived from the config, so not saved with the weights
        self.register_buffer("codes", codes, persistent=False)
        # the same as embedding_bag's flat indices and per-token offsets, built once, not per forward
        valid = codes >= 0
        n = valid.sum(1)
        self.register_buffer("bag_indices", codes[valid], persistent=False)
        self.register_buffer("bag_offsets", torch.cumsum(n, 0) - n, persistent=False)

    def scores(self, z: torch.Tensor) -> torch.Tensor:
        """Head logits (..., n_hash) -> vocabulary scores (..., V): the mean of each token's activated logits."""
        flat = z.reshape(-1, z.shape[-1]).float()
        # one bag per token over the head positions: (V, N) without a dense (V, n_hash) matrix
        s = F.embedding_bag(self.bag_indices, flat.t(), self.bag_offsets, mode="mean")
        return s.t().reshape(*z.shape[:-1], -1)

    def forward(self, input_ids: torch.Tensor, hashed: bool = False) -> torch.Tensor:
        z = self.head(self.forward_hidden(self.embed(input_ids)))
        return z if hashed else self.scores(z)

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The next token at every position: argmax of the vocabulary scores."""
        return self.forward(input_ids).argmax(-1)
