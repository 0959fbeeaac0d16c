"""Torch models: the llama-style decoder, masked mixers, the entropy estimator, the autoencoder.

Every model is built from a kind name and a config dict, and maps `input_ids` (B, T) to logits
(B, T, V) where position t predicts token t+1. Imports torch only.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

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


def is_causal(kind: str) -> bool:
    """Whether `kind`'s value at t depends on the tokens up to t alone (llama, mixer), not on an
    embedding of the whole row (estimator, autoencoder): what a per-token CE given the tokens before
    each token (causal_loss, excess_loss) may read."""
    return bool(getattr(model_class(kind), "causal", False))


def config_of(kind: str, config: dict):
    """`kind`'s Config from a plain dict, checked as far as it can be without the data: an unknown
    kind or key, a value of another type than its field's default (a string for d_model), a size
    below 1 where the default is a size, and what the Config's own checks refuse (d_model not a
    multiple of n_heads) raise ValueError naming them. A run asks it before it trains anything."""
    cls = model_class(kind)
    fields = {f.name: f for f in dataclasses.fields(cls.Config)}
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ValueError(
            f"the model config has {', '.join(unknown)}, which {kind} does not take; its fields: "
            f"{', '.join(sorted(fields))}"
        )
    config = dict(config)
    for key, value in config.items():
        default = fields[key].default
        if isinstance(default, float) and isinstance(value, str):  # YAML 1.1 reads 1e-05 as a string
            try:
                value = config[key] = float(value)
            except ValueError:
                pass
        if value is None or default is None or isinstance(default, str) or default is dataclasses.MISSING:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ValueError(f"the model config's {key} is {value!r}, not true or false")
        if isinstance(default, int) and not isinstance(default, bool):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"the model config's {key} is {value!r}, not a whole number")
            if default >= 1 and value < 1:
                raise ValueError(f"the model config's {key} must be at least 1, not {value!r}")
        if isinstance(default, float) and not (number and math.isfinite(value)):
            raise ValueError(f"the model config's {key} is {value!r}, not a finite number")
    try:
        return cls.Config(**config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the model config is refused by {kind}: {e}") from None


def build_model(kind: str, config: dict):
    """A freshly initialised model of `kind` from a plain config dict (checked by `config_of`)."""
    return model_class(kind)(config_of(kind, config))
