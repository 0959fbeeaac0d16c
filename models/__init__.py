"""Torch models: the llama-style decoder, masked mixers, the entropy estimator, the autoencoder.

Every model is built from a kind name and a config dict, and maps `input_ids` (B, T) to logits
(B, T, V) where position t predicts token t+1. Imports torch only.
"""

from __future__ import annotations

import importlib

# kind -> "module:Class"; each class takes its own `Config` dataclass (Class.Config) and has `.config`.
REGISTRY = {
    "llama": "entroweight.models.llama:Llama",
    "mixer": "entroweight.models.mixer:MaskedMixer",
    "estimator": "entroweight.models.estimator:EntropyEstimator",
    "autoencoder": "entroweight.models.autoencoder:Autoencoder",
    "tfree": "entroweight.models.tfree:TFree",
}


def model_class(kind: str):
    if kind not in REGISTRY:
        raise ValueError(f"unknown model kind {kind!r}; choose one of {', '.join(REGISTRY)}")
    module, name = REGISTRY[kind].split(":")
    return getattr(importlib.import_module(module), name)


def build_model(kind: str, config: dict):
    """A freshly initialised model of `kind` from a plain config dict (unknown keys refused)."""
    cls = model_class(kind)
    return cls(cls.Config(**config))
