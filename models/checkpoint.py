"""Checkpoints on disk: `model.safetensors` + `config.json` (kind, model config, data provenance).

Only safetensors are read by default: unpickling a `.pt`/`.bin`/`.pth` file can run code. With
`allow_pickle=True` (the CLI's --allow-pickle) a pickle is read with `torch.load(weights_only=True)`,
which accepts tensors and plain containers only. Training state (optimizer, data position) is the
trainer's business and lives beside these files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from entroweight import storage
from entroweight.storage import sha256 as sha256_file

from . import REGISTRY, build_model

WEIGHTS, CONFIG = "model.safetensors", "config.json"
# the kind and model config the weights were saved as, in the safetensors header: config.json edited
# by hand (mask_pads, rope_theta, a llama called tfree: what the weights' shapes do not show) is
# refused, not used as written
SAVED_WITH = "entroweight_model"
PICKLE_SUFFIXES = (".pt", ".pth", ".bin")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says what to do."""


def save_checkpoint(model: torch.nn.Module, kind: str, out_dir: str | Path, **meta) -> Path:
    """Write weights and config; `meta` holds e.g. tokenizer_sha256, vocab_size, n_ctx, step."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # tied weights share storage: safetensors wants each tensor once, contiguous
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    seen, unique = {}, {}
    for k, v in state.items():
        ptr = v.data_ptr() if v.numel() else id(v)
        if ptr in seen:
            continue
        seen[ptr] = k
        unique[k] = v
    tmp = out / (WEIGHTS + ".tmp")
    save_file(unique, str(tmp), metadata={SAVED_WITH: _saved_as(kind, model)})
    plain_mode(tmp)
    tmp.replace(out / WEIGHTS)
    config = {"kind": kind, "model": dataclasses.asdict(model.config), **meta}
    config["weights_sha256"] = sha256_file(out / WEIGHTS)
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def plain_mode(path: str | Path) -> None:
    """Give a file the permissions every other file gets (0666 less the umask). safetensors writes
    through a private temp file and keeps its 0600, so a model would be unreadable to the group that
    reads the data beside it."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    try:  # Linux says it without changing it (os.umask can only be read by setting it)
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def a_model_of(kind) -> str:
    """How a message names a checkpoint's kind: 'a llama model', 'an estimator model'."""
    return f"{'an' if str(kind)[:1] in 'aeiou' else 'a'} {kind} model"


def read_checkpoint_config(ckpt_dir: str | Path) -> dict:
    """The checkpoint's config: a JSON object naming a model `kind` of models.REGISTRY and its `model`
    config. Anything else is refused here, once for every reader: an HF model directory also holds a
    config.json."""
    path = storage.path(ckpt_dir) / CONFIG  # local, or a URL (s3://...)
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not an entroweight checkpoint (no {CONFIG}); train one with `entroweight train`"
        )
    try:
        config = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{path} is not valid JSON ({e}): the checkpoint is corrupt; re-copy it"
        ) from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict) or "kind" not in config:
        hint = (
            "it looks like a Hugging Face model, which `entroweight score --model` reads; this needs one of "
            "ours (`entroweight train`)"
            if isinstance(config, dict) and ("architectures" in config or "model_type" in config)
            else "train one with `entroweight train`"
        )
        raise CheckpointError(
            f"{ckpt_dir} is not an entroweight checkpoint: its {CONFIG} names no model kind and config; {hint}"
        )
    if config["kind"] not in REGISTRY:
        raise CheckpointError(
            f"{path} names model kind {config['kind']!r}, which this version does not know "
            f"({', '.join(REGISTRY)}): a newer entroweight wrote it, or the file was edited"
        )
    return config


def made_from(ckpt_dir: str | Path) -> dict:
    """What an output made from the checkpoint records of it (an export's mark, an evaluation's
    results): where it lies and its weights' sha256 (entroweight.output names the checkpoint by its weights)."""
    try:
        weights = read_checkpoint_config(ckpt_dir).get("weights_sha256")
    except CheckpointError:  # refused by the command that reads it; here only a record is wanted
        weights = None
    return {"checkpoint": storage.key(ckpt_dir), "weights_sha256": weights}


def load_checkpoint(
    ckpt_dir: str | Path, map_location: str = "cpu", verify: bool = True, allow_pickle: bool = False
):
    """(model in eval mode, config dict). Refuses weights whose sha256 differs from the recorded one,
    and pickle weights unless `allow_pickle` (then read with weights_only=True). A checkpoint at a
    URL (s3://, gs://) is downloaded to a temp directory first, and checked the same way."""
    if storage.is_url(ckpt_dir):
        with storage.local_copy(ckpt_dir) as local:
            try:
                return load_checkpoint(local, map_location, verify, allow_pickle)
            except CheckpointError as e:  # named as the user gave it, not as the temp copy
                raise CheckpointError(str(e).replace(str(local), str(ckpt_dir).rstrip("/"))) from None
    ckpt = Path(ckpt_dir)
    config = read_checkpoint_config(ckpt)
    weights = ckpt / WEIGHTS
    if not weights.is_file():
        weights = _pickle_weights(ckpt, allow_pickle)
    if verify and config.get("weights_sha256") and sha256_file(weights) != config["weights_sha256"]:
        raise CheckpointError(
            f"{weights} does not match the sha256 recorded in {CONFIG}: the file changed or is corrupt; "
            "re-copy the checkpoint or retrain it"
        )
    try:  # a config.json edited by hand or cut short: refused naming it, not a TypeError from a Config
        model = build_model(config["kind"], config["model"])
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"{ckpt / CONFIG} does not describe {a_model_of(config['kind'])} ({_one_line(e)}): "
            "the file was edited or is corrupt; re-copy the checkpoint"
        ) from None
    load_weights(model, weights, config["kind"], map_location)
    return model.to(map_location).eval(), config


def load_weights(model: torch.nn.Module, weights: Path, kind: str, map_location: str = "cpu") -> None:
    """`weights` (model.safetensors, or a pickle the caller allowed) into `model`, every key and shape
    checked: a file that does not parse (cut short: its sha256 can be absent from config.json), or
    weights of another shape than config.json describes (an edited d_model), is a CheckpointError
    naming the file, where it was a SafetensorError or a state dict's "size mismatch" traceback.
    Every reader of our weights goes through it: load_checkpoint, and the trainer's resume."""
    if weights.name == WEIGHTS:
        try:
            state = load_file(str(weights), device=map_location)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(
                f"{weights} is not a readable safetensors file ({_one_line(e)}): it is cut short or "
                "corrupt; re-copy the checkpoint or retrain it"
            ) from None
    else:
        state = _load_pickle_state(weights, map_location)
    expected = model.state_dict()
    # tied weights were saved once; anything else missing is an error
    missing = [k for k in expected if k not in state and not _is_tied(model, k)]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{weights} does not fit {a_model_of(kind)}: missing {missing}, unexpected {unexpected}"
        )
    wrong = [k for k in state if tuple(state[k].shape) != tuple(expected[k].shape)]
    if wrong:
        k = wrong[0]
        raise CheckpointError(
            f"{weights} does not fit the {kind} model its {CONFIG} describes: {k} is "
            f"{list(state[k].shape)}, the model's {list(expected[k].shape)}"
            + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else "")
            + f"; {CONFIG} was edited, or the weights are of another model"
        )
    _check_saved_as(model, weights, kind)
    model.load_state_dict(state, strict=False)


def _saved_as(kind: str, model: torch.nn.Module) -> str:
    return json.dumps({"kind": kind, **dataclasses.asdict(model.config)}, sort_keys=True)


def _check_saved_as(model: torch.nn.Module, weights: Path, kind: str) -> None:
    """Refuse a kind or model config other than the weights were saved as (weights saved before it
    was recorded are taken as config.json describes them)."""
    if weights.name != WEIGHTS:
        return
    if said := _saved_as_differs(weights, json.loads(_saved_as(kind, model))):
        raise CheckpointError(
            f"{weights.parent / CONFIG} does not describe the model its weights were saved as ({said}): "
            "the file was edited; re-copy the checkpoint, or train a model of these settings"
        )


def edited_config(ckpt_dir: str | Path) -> str | None:
    """How a local checkpoint's config.json differs from the model its weights were saved as (None:
    it does not, or the weights record nothing): what a workflow asks of a finished checkpoint
    before it calls it up to date. Reads the header and config.json only."""
    ckpt = Path(ckpt_dir)
    try:
        config = json.loads((ckpt / CONFIG).read_bytes())
        return _saved_as_differs(ckpt / WEIGHTS, {"kind": config["kind"], **config["model"]})
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):
        return None  # unreadable: the loader says why, naming the file


def _saved_as_differs(weights: Path, now: dict) -> str | None:
    with safe_open(str(weights), "pt") as f:
        saved = (f.metadata() or {}).get(SAVED_WITH)
    if saved is None:
        return None
    saved = json.loads(saved)
    changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
    changed = ["kind"] if "kind" in changed else changed  # another kind's fields all differ
    return (
        "; ".join(
            f"{k} {json.dumps(now.get(k))} where the weights were saved as {json.dumps(saved.get(k))}"
            for k in changed
        )
        or None
    )


def _one_line(e: Exception) -> str:
    """An exception's message on one line (torch's and safetensors' span several)."""
    return " ".join(str(e).split())


def _pickle_weights(ckpt: Path, allow_pickle: bool) -> Path:
    pickles = sorted(p for p in ckpt.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    if not pickles:
        raise CheckpointError(f"{ckpt} has no {WEIGHTS}")
    names = ", ".join(p.name for p in pickles)
    if not allow_pickle:
        raise CheckpointError(
            f"{ckpt} has no {WEIGHTS}, only pickle files ({names}), which can run code when loaded; "
            "convert them to safetensors, or pass --allow-pickle if you trust their source "
            "(they are then read with torch.load(weights_only=True))"
        )
    if len(pickles) > 1:
        raise CheckpointError(f"{ckpt} holds several pickle files ({names}); keep the one to load")
    return pickles[0]


def _load_pickle_state(path: Path, map_location: str) -> dict[str, torch.Tensor]:
    try:  # weights_only: tensors and plain containers; any other object is refused, not built
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{path} is refused by torch.load(weights_only=True): {type(e).__name__}: {e}"
        ) from e
    if isinstance(state, dict):
        # a training checkpoint nests the weights; never test a tensor's truth ("model" may be one)
        state = next((state[k] for k in ("model", "state_dict") if isinstance(state.get(k), dict)), state)
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return state


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(key)
    return target is not None and any(p is target and k != key for k, p in params.items())
