"""What a training run is: one pydantic model, the single source of every training option.

`entroweight train`'s options (`workflows/cli/train.py`), a workflow's `train:`/`models:` sections
(`workflows/spec.py`) and the file `torchrun` receives (`workflows/engine/runner.py`) are all derived from
these classes: a new option is one field here, with its default, its bounds and its help text.

Three parts, because the workflow file places them apart: `TrainSettings` (the optimisation knobs
shared by every run of a workflow), `LossSettings` (what each experiment run varies) and
`TrainConfig` (everything one run needs).
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from entroweight.options import DeviceName, Options, Seed, refusal_lines

from .losses import LOSSES

LossName = Literal[tuple(LOSSES)]  # type: ignore[valid-type]  # the registry's names, nowhere else


class TrainError(ValueError):
    """A run that cannot start; the message says what to do."""


class _Settings(Options):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrainSettings(_Settings):
    """The optimisation knobs, shared by a workflow's estimator models and experiment runs."""

    steps: int = Field(1000, ge=1, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Sequences per micro-batch per rank.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    lr: float = Field(2e-4, gt=0, description="Peak learning rate.")
    warmup_steps: int | None = Field(None, ge=0, description="Linear warmup steps (default: 5% of --steps).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="The cosine decays to lr × this.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (matrices and embeddings only).")
    grad_clip: float = Field(1.0, ge=0, description="Clip the gradient norm to this (0: no clipping).")
    shuffle_buffer: int = Field(4096, ge=1, description="Rows shuffled together as they stream in.")
    log_every: int = Field(10, ge=1, description="Log (metrics.jsonl and the console) every N steps.")
    # the name here (a workflow file is validated where it may not run); whether it is on this machine
    # is asked when the run starts (trainers/loop.py, entroweight.options.device_here)
    device: DeviceName = Field("auto", description="auto, cpu, cuda, cuda:1, ...")
    compile: bool = Field(False, description="torch.compile the model.")

    @model_validator(mode="after")
    def _warmup_within_steps(self):
        if self.warmup_steps is not None and self.warmup_steps > self.steps:  # lr would never peak
            raise ValueError(
                f"warmup_steps (--warmup-steps) {self.warmup_steps} is past steps (--steps) {self.steps}: "
                "the learning rate would never reach lr; give fewer warmup steps"
            )
        return self


class LossSettings(_Settings):
    """The loss and its parameters (trainers/losses.py holds the registry)."""

    loss: LossName = Field("ce", description="The training loss (docs/trainer.md#losses---loss).")
    normalize: Literal["tokens", "weight"] = Field(
        "tokens", description="weighted_ce: divide Σ w·CE by the real-token count or by Σ w."
    )
    # below 0 the target's own logit is dropped: its CE is infinite
    margin: float = Field(
        2.0, ge=0, description="hard_negative: logits this far below the target's are dropped."
    )
    prefix_weight: float = Field(0.1, ge=0, description="prefix_smooth: the weight of each prefix token.")
    shuffle_weights: Literal["row", "position"] | None = Field(
        None,
        description="A control: the data's weights permuted afresh for each seed, within each row (row) "
        "or across rows at each position (position) (docs/experiments.md#controls).",
    )

    @model_validator(mode="after")
    def _options_of_the_loss(self):
        """A loss parameter given for a loss that does not take it would change nothing (and then
        block a resume as a changed setting): refused, naming whose it is."""
        takes = set(LOSSES[self.loss].options)
        if self.shuffle_weights is not None and "weight" not in LOSSES[self.loss].columns:
            raise ValueError(
                f"shuffle_weights (--shuffle-weights) permutes the weights, which --loss {self.loss} does "
                "not read: train with a weighted loss (weighted_ce), or drop it"
            )
        for name in sorted(
            self.model_fields_set & (set(LossSettings.model_fields) - {"loss", "shuffle_weights"}) - takes
        ):
            if getattr(self, name) == LossSettings.model_fields[name].default:
                continue  # the default, written out (a config file, a workflow's defaults): harmless
            owner = next(n for n, loss in LOSSES.items() if name in loss.options)
            raise ValueError(
                f"{name} (--{name.replace('_', '-')}) is {owner}'s; --loss {self.loss} takes "
                f"{', '.join(sorted(takes)) or 'no parameter'}: drop it, or train with --loss {owner}"
            )
        return self


class TrainConfig(TrainSettings, LossSettings):
    """Everything one run needs."""

    data: list[str] | str = Field(description="Token parquet: directories or files.")
    out: str = Field(description="Checkpoint directory (or s3://, gs:// URL).")
    model: str = Field("llama", description="Model kind (llama, mixer, estimator, ...).")
    # `model_config` is pydantic's own attribute: the field is `model_cfg`, spelled `model_config`
    # in every input and output (the constructor, a config file, config.json)
    model_cfg: dict[str, Any] = Field(
        default_factory=dict, alias="model_config", description="The model's Config fields."
    )
    tokenizer: str | None = Field(
        None,
        description="The data's tokenizer.json (default: the copy the data carries); stored for eval-bpb / "
        "export-hf.",
    )
    seed: Seed = Field(0, description="Initialisation, data order and dropout.")
    betas: tuple[float, float] = Field(
        (0.9, 0.95), description="AdamW betas.", json_schema_extra={"cli": False}
    )
    save_every: int | None = Field(None, ge=1, description="Checkpoint every N steps (default: at the end).")
    stop_at: int | None = Field(
        None, ge=1, description="Stop after this step, leaving a resumable checkpoint."
    )
    resume: bool = Field(False, description="Continue the run in --out from its last checkpoint.")
    overwrite: bool = Field(False, description="Start over in an --out that already holds a checkpoint.")
    quiet: bool = Field(False, description="No console log.", json_schema_extra={"cli": False})

    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, validate_assignment=True, protected_namespaces=()
    )

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise TrainError(refusal(e)) from None

    @field_validator("data", "out", "tokenizer", mode="before")
    @classmethod
    def _paths_as_text(cls, v):
        if isinstance(v, os.PathLike):
            return os.fspath(v)
        if isinstance(v, (list, tuple)):
            return [os.fspath(x) if isinstance(x, os.PathLike) else x for x in v]
        return v

    @model_validator(mode="after")
    def _stop_within_steps(self):
        if self.stop_at is not None and self.stop_at > self.steps:  # it would stop nothing
            raise ValueError(
                f"stop_at (--stop-at) {self.stop_at} is past steps (--steps) {self.steps}: give a step of the run"
            )
        return self

    @model_validator(mode="after")
    def _resume_or_overwrite(self):
        if self.resume and self.overwrite:  # one continues the checkpoint, the other deletes it
            raise ValueError(
                "resume (--resume) continues the checkpoint, overwrite (--overwrite) replaces it: pass one"
            )
        return self

    @field_validator("data")
    @classmethod
    def _some_data(cls, v):
        if not v:
            raise ValueError("name at least one data directory or file")
        return v

    def dump(self) -> dict:
        """The config as JSON types, keys as users spell them (config.json, the torchrun file)."""
        return self.model_dump(mode="json", by_alias=True)


# settings that do not change what a run computes: a resume may change them freely
RUN_ONLY = ("out", "resume", "overwrite", "quiet", "device", "compile", "log_every", "save_every", "stop_at")
# checked on their own on resume: the model (kind and effective config) and the tokenizer (sha256)
CHECKED_APART = ("model", "model_config", "tokenizer")


def refusal(e: ValidationError) -> str:
    """A pydantic refusal as one line per field: `lr: Input should be greater than 0 (got 0.0)`."""
    return "; ".join(refusal_lines(e, unknown="not a training option"))
