"""A model-free scorer for tests that exercise the stages, not a model: value = token id mod
`modulus` (cheap, deterministic, different between neighbouring ids). A test module subclasses it
under its own name and registers that (module-level classes, so that every engine can pickle them)."""

from __future__ import annotations

import numpy as np

from entroweight.scorers import Scorer


class IdMod(Scorer):
    modulus = 7

    def config(self):
        return {"scorer": self.name}

    def setup(self, data_tokenizer=None):
        pass

    def score_batch(self, input_ids, n_pad):
        return (input_ids % self.modulus).astype(np.float32)
