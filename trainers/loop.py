"""The training loop: stream parquet, AdamW + warmup/cosine, grad accumulation, clipping, DDP, resume.

One process per device under `torchrun` (DDP, rank-sharded data; gloo on CPU, nccl on CUDA), or a
single process. bf16 autocast on CUDA, fp32 on CPU. Deterministic: the data order and every random
draw inside the model (dropout, estimator noise) are functions of (seed, step), so a resumed run
reproduces an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import filecmp
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors import SafetensorError

from entroweight import output, storage
from entroweight.models import build_model, config_of, model_class
from entroweight.models.checkpoint import WEIGHTS, a_model_of, load_weights, read_checkpoint_config
from entroweight.options import device_here, setting_changes
from entroweight.schemas.datadir import DataDir, DataDirError
from entroweight.schemas.tokenizer import TokenizerError, resolve_tokenizer_path, vocab_size

from .checkpoint import METRICS, STATE, TOKENIZER, load_training_state, save_training_checkpoint
from .config import CHECKED_APART, RUN_ONLY, TrainConfig, TrainError
from .data import DataError, WeightedTokens, inspect_data, parquet_files, value_problems
from .losses import LOSSES, Loss, floor, per_token_ce
from .outputs import TRAIN


class TrainFailed(TrainError):
    """A run that started but cannot go on (a non-finite loss, a failed save); the last saved
    checkpoint stays valid."""


@dataclasses.dataclass
class TrainResult:
    out: str
    step: int
    steps: int  # the run's last step (--steps)
    loss: float | None
    tokens: int
    seconds: float
    tokens_per_s: float
    metrics: str


def lr_at(step: int, cfg: TrainConfig) -> float:
    warm = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, cfg.steps // 20)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, cfg.steps - warm))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def _device(name: str) -> torch.device:
    """--device on this machine (`auto` resolved), or a TrainError: asked before anything is read or
    written, where a device torch does not know or a CUDA it cannot see failed with a traceback."""
    try:
        return device_here(name)
    except ValueError as e:
        raise TrainError(f"--device {e}") from None


def _setup_dist(device: torch.device):
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        device = torch.device("cuda", local if world > 1 else (device.index or 0))
        torch.cuda.set_device(device)
    own_group = False
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        own_group = True
    return rank, world, device, own_group


def _check_nats(files) -> None:
    """`rescaled` fits each token's CE (nats) down to its `entropy` value: only an entropy in nats can
    be such a floor (an L1 or cosine distance, a loss difference cannot)."""
    from entroweight.schemas import read_file_metadata

    for f in files:
        meta = read_file_metadata(f)
        unit = meta.get("unit")
        if unit != "nats":
            what = f"unit {unit!r}" if unit else "no recorded unit (scored before units were recorded)"
            raise TrainError(
                f"--loss rescaled needs entropies in nats, but {f} holds {meta.get('scorer', 'scores')} values "
                f"with {what}; score with a loss scorer (causal_loss, cross_tokenizer, decomposition) or "
                "train with --loss weighted_ce"
            )


def _check_out_apart(cfg: TrainConfig, wait: float, reads, apart: bool) -> str | None:
    """The path rule (entroweight.output.check_output), asked here alone: a run writing --out now is
    OutputHeld (exit 3: its files are not yet marked as its output); --out neither is, holds nor lies
    inside the data, the tokenizer or `reads` (checkpoints would mix with the data), nor holds another
    command's output unless --overwrite replaces it whole (returned: the caller removes it once
    training can start); `apart` (run by hand): nor lies inside another command's output. An --out
    on an object store must be writable now, not at the first save."""
    storage.wait_unheld(cfg.out, wait)
    reads = [("the data", d) for d in _as_list(cfg.data)] + [("--tokenizer", cfg.tokenizer), *reads]
    try:
        foreign = output.check_output(cfg.out, reads, "train", overwrite=cfg.overwrite, apart=apart)
        if storage.is_url(cfg.out):
            storage.check_writable(cfg.out)
        if foreign is None:
            _check_leftover_config(cfg.out)
    except storage.OutputRefused as e:
        raise TrainError(str(e)) from None
    except OSError as e:  # no bucket, no credentials, read-only
        raise TrainError(f"cannot write to --out {cfg.out}: {e.strerror or e}") from None
    return foreign


def _check_leftover_config(out) -> None:
    """A config.json with no trainer_state.json beside it is the leftover of a run stopped in its first
    save (train's declared leftovers, trainers/outputs.py: --resume has nothing to continue, --overwrite starts over) only if a
    training run wrote it; another program's config.json is a user's file, which no --overwrite
    replaces."""
    config, state = storage.path(out) / "config.json", storage.path(out) / STATE  # (a trailing / too)
    if not config.exists() or state.exists():
        return
    try:
        record = json.loads(config.read_bytes())
    except ValueError:  # not JSON (or not UTF-8)
        record = None
    ours = isinstance(record, dict) and {"kind", "train", "weights_sha256"} <= record.keys()
    if not ours:
        raise storage.OutputRefused(
            f"--out {out} holds a config.json that no training run wrote (another program's file), which "
            "train would replace: write to a new or empty directory"
        )


def _model_config(cfg: TrainConfig, info, base: dict, tok_path=None) -> dict:
    """The model's config dict: the user's, with vocab_size / n_ctx taken from the data when unset.
    Data that records neither (another tool's parquet, a hub export's rows) takes the vocabulary of
    --tokenizer, else both are asked for: the model's defaults would fit by chance at best."""
    mc = {**base, **cfg.model_cfg}
    try:  # the one check of a model config (keys, types, the Config's own), as a workflow asks it
        config_of(cfg.model, mc)
    except ValueError as e:
        raise TrainError(str(e)) from None
    fields = {f.name for f in dataclasses.fields(model_class(cfg.model).Config)}
    if "vocab_size" in fields and not info.vocab_size and "vocab_size" not in mc and tok_path:
        mc["vocab_size"] = vocab_size(tok_path)
    unknown = [
        k for k, fact in (("vocab_size", info.vocab_size), ("n_ctx", info.n_ctx)) if k in fields and not fact
    ]
    if missing := [k for k in unknown if k not in mc]:
        tokenizer = " (or pass --tokenizer for the vocabulary)" if "vocab_size" in missing else ""
        raise TrainError(
            f"the data records no {' or '.join(missing)} (not a stage's output: another tool's parquet or "
            f"an export's rows); set {' and '.join(missing)} in --model-config{tokenizer}"
        )
    if "vocab_size" in fields and info.vocab_size:
        if mc.setdefault("vocab_size", info.vocab_size) != info.vocab_size:
            raise TrainError(
                f"the model config says vocab_size {mc['vocab_size']} but the data's tokenizer has "
                f"{info.vocab_size}; drop vocab_size from the model config to take it from the data"
            )
    if "n_ctx" in fields and info.n_ctx:
        if mc.setdefault("n_ctx", info.n_ctx) < info.n_ctx:
            raise TrainError(
                f"the data's sequences have {info.n_ctx} tokens, longer than the model's n_ctx {mc['n_ctx']}; "
                "raise n_ctx in the model config or tokenize with a smaller --n-ctx"
            )
    return mc


def _optimizer(model, cfg: TrainConfig, device) -> torch.optim.AdamW:
    # no weight decay on norms (1-D); decay matrices and embeddings, as nanoGPT
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, **kw)


def train(
    cfg: TrainConfig, allow_config_change: bool = False, wait: float = 0, reads=(), apart: bool = False
) -> TrainResult:
    """Run (or with cfg.resume continue) a training run. A resume whose settings differ from the
    checkpoint's is refused unless `allow_config_change`; then config.json's `train_history` records
    each config with the step it took effect. The run holds the lock on cfg.out while it writes
    there (`_holding_out`): another run holding it is refused (storage.OutputHeld, exit 3), or
    waited for `wait` seconds. `reads`: what else the caller read ((flag, location) pairs: a config
    file) and `apart` (a command run by hand), for the path rule (`_check_out_apart`)."""
    if allow_config_change and not cfg.resume:
        raise TrainError("--allow-config-change applies only with --resume")
    device = _device(cfg.device)
    # another command's output, which --overwrite replaces whole
    foreign = _check_out_apart(cfg, wait, reads, apart)
    try:
        rank, world, device, own_group = _setup_dist(device)
        try:
            with _holding_out(cfg, wait, foreign, rank, world, device):
                cfg = _the_same_run(cfg, rank, world)
                if storage.is_url(cfg.out):
                    return _train_to_store(cfg, rank, world, device, allow_config_change)
                return _train(cfg, rank, world, device, allow_config_change)
        finally:
            if own_group:
                torch.distributed.destroy_process_group()
    except (RuntimeError, MemoryError) as e:
        if not _out_of_memory(e):
            raise
        raise TrainFailed(
            f"out of memory on {device} with --batch-size {cfg.batch_size} ({_first_line(e)}): lower "
            "--batch-size (--grad-accum keeps the tokens per step); the last checkpoint saved stays"
        ) from None


def _the_same_run(cfg: TrainConfig, rank: int, world: int) -> TrainConfig:
    """`cfg` with `resume` where --out holds a checkpoint of this very run (a scheduler's retry, a
    rerun after a kill), as the output contract judges it (`output.continues` over `made_of`): it
    continues, or at its last step has nothing to train, as a stage's rerun does; any other
    checkpoint there is refused (--resume, --overwrite or another --out: `_resolve`). Read under the
    run's lock."""
    if cfg.resume or cfg.overwrite:
        return cfg
    step = output.continues(cfg.out, TRAIN, lambda: made_of(cfg, world))
    if step is None:
        return cfg
    if rank == 0 and not cfg.quiet and step < cfg.steps:  # (finished: "nothing to train")
        print(f"{cfg.out} holds this run (the same settings) at step {step}: continuing it", flush=True)
    return cfg.model_copy(update={"resume": True})


def _made_of(settings: dict, world: int, tokenizer_sha256: str | None, shards: dict) -> dict:
    """What a training run is made of, as its rerun compares it (the contract's made_of): every
    setting that changes what it computes (the model kind among them) and its processes (the data
    order); the tokenizer by its content, however and from wherever it is named (its path is as
    typed; None: the data's own, which its shards fix); the data by its shards' sha256."""
    options = {k: v for k, v in settings.items() if k not in (*RUN_ONLY, "tokenizer")}
    return {
        "options": {**options, "world_size": world},
        "inputs": {"tokenizer": tokenizer_sha256, "data": shards},
    }


def made_of(cfg: TrainConfig, world: int, shards: dict | None = None) -> dict | None:
    """`_made_of` for a run of `cfg` on `world` processes, the data's `shards` as given (a workflow's
    plan: from its manifests, `manifest_shards`) or as read now (`data_shards`); None where its inputs
    cannot be read (refused where the run reads them)."""
    try:
        tok = storage.sha256(resolve_tokenizer_path(cfg.tokenizer)) if cfg.tokenizer is not None else None
        shards = data_shards(parquet_files(cfg.data)) if shards is None else shards
    except (TokenizerError, DataError, DataDirError, OSError, ValueError):
        return None
    return _made_of(_settings(cfg), world, tok, shards)


def recorded_made_of(directory) -> tuple[dict, int] | None:
    """What the checkpoint in `directory` records it is made of (`_made_of`) and the step it is at
    (train's declared `resumable`, trainers/outputs.py); None where it holds no checkpoint of ours, or
    one no single command made: continued under other settings (`train_history`), or on data of
    other tools, known by its size alone (not told apart from other data)."""
    out = storage.path(directory)
    try:
        prev = json.loads((out / "config.json").read_bytes())
        state = json.loads((out / STATE).read_bytes())
        step, world = int(state.get("step", 0)), int(state.get("world_size", 1))
        settings = _recorded_settings(prev["train"])
        shards, tok = prev["data_shards"], prev.get("tokenizer_sha256")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no checkpoint, or not ours
        return None
    if len(prev.get("train_history") or ()) > 1 or settings.get("model") != prev.get("kind"):
        return None
    if not isinstance(shards, dict) or any(not str(v).startswith("sha256:") for v in shards.values()):
        return None
    return _made_of(settings, world, tok if settings.get("tokenizer") is not None else None, shards), step


def _out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: CUDA's OutOfMemoryError, the CPU allocator's RuntimeError, Python's."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(e)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


@contextlib.contextmanager
def _holding_out(cfg: TrainConfig, wait: float, foreign: str | None, rank: int, world: int, device):
    """The lock on the --out the user gave (a file lock in it locally, a lease object on an object
    store: `storage.holding_output`, as a stage holds), for the whole run: by rank 0 only under
    torchrun (one run, one holder: the ranks of a run never refuse each other). Rank 0 takes it, then
    removes the other command's output --overwrite replaces (`foreign`), then tells the other ranks
    whether the run goes on: every rank stops together where it is held."""
    refused: Exception | None = None
    with contextlib.ExitStack() as held:
        if rank == 0:
            try:
                held.enter_context(storage.holding_output(cfg.out, wait))
                if foreign:
                    storage.clear_output(cfg.out)
            except storage.OutputHeld as e:
                refused = e
            except OSError as e:  # StorageError: it says why
                refused = TrainError(
                    str(e)
                    if isinstance(e, storage.StorageError)
                    else f"cannot write to --out {cfg.out}: {e.strerror or e}"
                )
        if world > 1:
            code = torch.tensor(
                [0 if refused is None else 1 if isinstance(refused, storage.OutputHeld) else 2]
            )
            code = code.to(device)
            torch.distributed.broadcast(code, src=0)
            if rank and code.item() == 1:
                refused = storage.OutputHeld(
                    f"another entroweight run holds {cfg.out} (rank 0 found its lock held)"
                )
            elif rank and code.item() == 2:
                refused = TrainError(f"rank 0 cannot write to --out {cfg.out}")
        if refused is not None:
            raise refused
        yield


def _train_to_store(
    cfg: TrainConfig, rank: int, world: int, device: torch.device, allow_config_change: bool
) -> TrainResult:
    """Train with --out on an object store: the run works in a local directory (a resume downloads
    the checkpoint into it first) and each checkpoint is uploaded as it is saved, trainer_state.json
    last, which commits it (a resume checks the other files against its sha256s). metrics.jsonl is
    uploaded whole with each checkpoint: an object store cannot append."""
    url = cfg.out.rstrip("/")
    if not cfg.resume and storage.path(f"{url}/config.json").exists() and not cfg.overwrite:
        raise TrainError(f"{url} already holds a checkpoint; pass --resume to continue it, or another --out")
    with tempfile.TemporaryDirectory(prefix="entroweight-train-") as local:
        if cfg.resume and not storage.download_dir(url, Path(local)):
            raise TrainError(f"nothing to resume in {url} (no {STATE}); drop --resume to start a new run")
        # the lease this run holds on `url` came down with the checkpoint: not a file of it, and never
        # uploaded back over the live lease
        (Path(local) / storage.LOCK_FILE).unlink(missing_ok=True)
        publish = (lambda: storage.upload_dir(Path(local), url, last=(STATE,))) if rank == 0 else None
        # cfg keeps the URL: config.json records the --out the user gave, not this staging folder
        result = _train(cfg, rank, world, device, allow_config_change, publish, workdir=Path(local))
    return dataclasses.replace(result, out=url, metrics=f"{url}/{METRICS}")


def _settings(cfg: TrainConfig) -> dict:
    """The train config as stored in config.json: JSON types, data paths absolute."""
    return _recorded_settings(cfg.dump())


def _recorded_settings(train: dict) -> dict:
    """Train settings with their data paths absolute (`storage.key`), as `_settings` stores them: a
    config.json written before they were is compared as it would be written now."""
    return {**train, "data": [storage.key(p) for p in _as_list(train.get("data", []))]}


def _config_history(prev: dict, new: dict, step: int, allow: bool) -> list[dict]:
    """config.json's train_history after resuming at `step` with settings `new`; refuses a change
    unless `allow`."""
    old = prev.get("train")
    history = prev.get("train_history") or ([{"step": 0, "train": old}] if old else [])
    if old is None:
        return history
    old = _recorded_settings(old)
    skip = set(RUN_ONLY) | set(CHECKED_APART)
    # keys of one side only come from another version of TrainConfig: their default kept the behaviour
    changed = sorted(k for k in new.keys() & old.keys() if k not in skip and old[k] != new[k])
    if not changed:
        return history
    if not allow:
        diff = "; ".join(f"{k} {old[k]!r} -> {new[k]!r}" for k in changed)
        raise TrainError(
            f"--resume with settings that differ from the checkpoint's ({diff}); resume with the same "
            "settings, or pass --allow-config-change to continue under the new ones (config.json then "
            "records each config and the step it took effect)"
        )
    return [*history, {"step": step, "changed": changed, "train": new}]


def data_shards(files) -> dict[str, str]:
    """The fingerprint of the data a run reads, recorded in its checkpoint: each file by its key and its
    content, the sha256 its stage manifest records (what workflow steps key on), else its size in bytes.
    One listing and the manifests' small reads per directory."""
    out: dict[str, str] = {}
    for d in dict.fromkeys(str(f).rsplit("/", 1)[0] for f in files):
        data = DataDir(d)
        shas = {p.name: p.manifest.output_sha256 for p in data.parts}
        for f in (f for f in files if str(f).rsplit("/", 1)[0] == d):
            name = str(f).rsplit("/", 1)[1]
            out[storage.key(f)] = f"sha256:{shas[name]}" if name in shas else f"bytes:{data.names.get(name)}"
    return out


def manifest_shards(data_dir) -> dict[str, str]:
    """`data_shards` of a stage's output as its manifests record it, its files not read: what a
    workflow plans from (a shard gone missing is remade as recorded before the run reads it)."""
    return {
        storage.key(f"{str(data_dir).rstrip('/')}/{m.output}"): f"sha256:{m.output_sha256}"
        for m in DataDir(data_dir).manifests
    }


def _check_same_data(old: dict[str, str] | None, new: dict[str, str], allow: bool) -> None:
    """Refuse a resume whose data changed since the checkpoint (a shard added, removed or rewritten),
    naming what changed, unless `allow` (--allow-config-change)."""
    if old is None or old == new or allow:
        return  # None: a checkpoint written before runs recorded their data
    kinds = {
        "added": sorted(new.keys() - old.keys()),
        "removed": sorted(old.keys() - new.keys()),
        "changed": sorted(k for k in new.keys() & old.keys() if old[k] != new[k]),
    }
    said = "; ".join(
        f"{kind} {', '.join(ks[:3])}" + (f" and {len(ks) - 3} more" if len(ks) > 3 else "")
        for kind, ks in kinds.items()
        if ks
    )
    raise TrainError(
        f"--resume on data that changed since the checkpoint ({said}); resume on the data it was trained "
        "on, or pass --allow-config-change to continue on the new data"
    )


def _as_list(x) -> list:
    return [x] if isinstance(x, str) else list(x)


@dataclasses.dataclass
class _Run:
    """Where a run starts, resolved and checked before the model is built."""

    out: Path
    tokenizer: Path | None  # the tokenizer.json stored with the checkpoint
    files: list[Path]  # the data's parquet files
    model_cfg: dict  # the model's effective Config fields
    meta: dict  # config.json's fields beside the model's
    state: dict | None = None  # a resumed run's trainer_state.json
    optimizer: dict | None = None  # ... and its optimizer state


def _resolve(
    cfg: TrainConfig, loss: Loss, rank: int, world: int, device, allow_config_change: bool, workdir=None
) -> _Run:
    """Resume or start: the tokenizer, the data, the model config, each checked against the others
    (and against the checkpoint on resume). Refusals are TrainErrors naming what to do, and the
    --out the user gave (not `workdir`, the local folder a run to an object store works in)."""
    out = Path(workdir) if workdir is not None else Path(cfg.out)
    shown = cfg.out.rstrip("/") if workdir is not None else out
    try:  # --tokenizer, else the copy the data carries (checked against the data's sha256 below)
        tok_path = resolve_tokenizer_path(cfg.tokenizer, cfg.data, required=False)
    except TokenizerError as e:
        raise TrainError(str(e)) from None
    tok_sha = storage.sha256(tok_path) if tok_path else None

    state, optim_sd, prev, base_model_cfg = None, None, None, {}
    if cfg.resume:
        if not (out / STATE).is_file():
            raise TrainError(f"nothing to resume in {shown} (no {STATE}); drop --resume to start a new run")
        prev = read_checkpoint_config(out)
        state, optim_sd = load_training_state(out)
        if prev["kind"] != cfg.model:
            raise TrainError(
                f"{shown} holds {a_model_of(prev['kind'])}, not {cfg.model}; pass --model {prev['kind']}"
            )
        if state["world_size"] != world:
            raise TrainError(
                f"{shown} was trained on {state['world_size']} processes; resume with the same number "
                f"(not {world}) so the data order stays the same"
            )
        base_model_cfg = prev["model"]
        if tok_sha and prev.get("tokenizer_sha256") and tok_sha != prev["tokenizer_sha256"]:
            if cfg.tokenizer:
                raise TrainError(
                    "--tokenizer differs from the one this checkpoint was trained with; drop it (the "
                    "checkpoint keeps its own)"
                )
            raise TrainError(
                "the data's tokenizer (the copy it carries) differs from the one this checkpoint was trained "
                "with; resume on the data it was trained on, or train this data in a new run (another --out)"
            )
        tok_sha = tok_sha or prev.get("tokenizer_sha256")
        if tok_path is None and (out / TOKENIZER).is_file():
            tok_path = out / TOKENIZER
    elif (out / "config.json").exists() and not cfg.overwrite:
        if not (out / STATE).exists():  # nothing --resume could continue: say what is there
            raise TrainError(
                f"{shown} holds a config.json but no checkpoint ({STATE}): a run stopped before its first "
                "save, or another program's file; write to another --out, or pass --overwrite to start over there"
            )
        raise TrainError(
            f"{shown} already holds a checkpoint; pass --resume to continue it, or another --out"
        )

    try:
        if cfg.resume:
            advice = "resume on data of the checkpoint's tokenizer, or train this data in a new run (another --out)"
        elif cfg.tokenizer:
            advice = "drop --tokenizer (the data carries the tokenizer that made it), or re-tokenize the data"
        else:
            advice = "give data of the model's tokenizer (re-tokenize it)"
        info = inspect_data(cfg.data, loss.columns, tok_sha, tokenizer_advice=advice)
        _check_values(info.files, loss.columns, rank, world, device, info.parts)
    except DataError as e:
        raise TrainError(str(e)) from e
    if loss.nats:
        _check_nats(info.files)
    if loss.token_bytes and tok_path is None:
        raise TrainError(f"--loss {cfg.loss} needs the tokenizer's token bytes: pass --tokenizer")
    mc = _model_config(cfg, info, base_model_cfg, tok_path)
    if (
        getattr(model_class(cfg.model), "wants_token_bytes", False)
        and mc.get("token_bytes") is None
        and tok_path
    ):
        from .prefix import token_bytes  # a T-FREE head hashes each token's bytes

        mc["token_bytes"] = [b.hex() for b in token_bytes(tok_path)]
    settings, history = _settings(cfg), None
    if cfg.resume:
        if mc != base_model_cfg:
            # each field that differs, not the whole config (a T-FREE's is long)
            changed = "; ".join(setting_changes(base_model_cfg, mc))
            raise TrainError(f"--model-config differs from the checkpoint's ({changed}); drop it to resume")
        history = _config_history(prev, settings, state["step"], allow_config_change)
    shards = data_shards(info.files)
    if cfg.resume:
        _check_same_data(prev.get("data_shards"), shards, allow_config_change)
        if prev.get("data_shards") not in (None, shards):  # allowed: recorded with the step it took effect
            history = [*(history or [{"step": 0, "train": prev.get("train")}])]
            history.append({"step": state["step"], "changed": ["data"], "train": settings})
    meta = {
        "tokenizer_sha256": tok_sha or info.tokenizer_sha256,
        "vocab_size": mc.get("vocab_size", info.vocab_size),
        "n_ctx": mc.get("n_ctx", info.n_ctx),
        "pad_id": info.pad_id,
        "loss": cfg.loss,
        "train": settings,
        "data_shards": shards,
        **({"train_history": history} if history and len(history) > 1 else {}),
    }
    return _Run(out, tok_path, info.files, mc, meta, state, optim_sd)


def _loss_arguments(cfg: TrainConfig, loss: Loss, model, tokenizer: Path | None, device) -> tuple[dict, dict]:
    """The loss's keyword arguments (its options from the config, its tables) and the forward's."""
    loss_kw = {name: getattr(cfg, name) for name in loss.options}
    fwd_kw = {}
    if loss.token_bytes:
        from .prefix import prefix_table, token_bytes

        loss_kw["prefix_table"] = prefix_table(token_bytes(tokenizer)).to(device)
    if loss.hashed_head:  # the model's hashed head logits, against each target's code
        if not hasattr(model, "codes"):
            raise TrainError(f"--loss {cfg.loss} trains a T-FREE head: pass --model tfree")
        loss_kw["codes"], fwd_kw["hashed"] = model.codes, True
    return loss_kw, fwd_kw


def _prepare_out(out: Path, tokenizer: Path | None, step: int) -> None:
    """--out with the run's tokenizer in it, and metrics past the resumed step dropped."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        if tokenizer is not None and not storage.is_local(tokenizer):  # the data's copy on a store
            (out / TOKENIZER).write_bytes(tokenizer.read_bytes())
        elif tokenizer is not None and tokenizer.resolve() != (out / TOKENIZER).resolve():
            if not (out / TOKENIZER).is_file() or not filecmp.cmp(tokenizer, out / TOKENIZER, shallow=False):
                shutil.copyfile(tokenizer, out / TOKENIZER)  # (a resume finds its own copy: left as it is)
        _trim_metrics(out / METRICS, step)
    except OSError as e:
        raise TrainError(f"cannot write to --out {out}: {e}") from None


def _build(cfg: TrainConfig, run: _Run, world: int, device):
    """(the model, what the loop calls: compiled and/or DDP-wrapped, its AdamW), restored on resume."""
    torch.manual_seed(cfg.seed)  # same init on every rank
    raw_model = build_model(cfg.model, run.model_cfg)
    if run.state is not None:  # every key and shape checked, as every reader of our weights does
        load_weights(raw_model, run.out / WEIGHTS, cfg.model)
    raw_model.to(device)
    optimizer = _optimizer(raw_model, cfg, device)
    if run.optimizer is not None:
        optimizer.load_state_dict(run.optimizer)
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    return raw_model, model, optimizer


def _train(
    cfg: TrainConfig,
    rank: int,
    world: int,
    device,
    allow_config_change: bool,
    publish=None,
    workdir: Path | None = None,
) -> TrainResult:
    """`publish`: called on rank 0 after each checkpoint is saved (the upload of an object-store --out);
    `workdir`: the local folder the run writes in, where it is not cfg.out (an object store's)."""
    loss_def = LOSSES[cfg.loss]
    run = _resolve(cfg, loss_def, rank, world, device, allow_config_change, workdir)
    out, state = run.out, run.state
    log = (lambda *a: None) if (cfg.quiet or rank) else (lambda *a: print(*a, flush=True))

    raw_model, model, optimizer = _build(cfg, run, world, device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    )
    loss_kw, fwd_kw = _loss_arguments(cfg, loss_def, raw_model, run.tokenizer, device)

    step = state["step"] if state else 0
    tokens = state["tokens"] if state else 0  # positions read, pads included (the data order's clock)
    ds = WeightedTokens(
        run.files,
        batch_size=cfg.batch_size,
        shuffle_buffer=cfg.shuffle_buffer,
        seed=cfg.seed,
        epochs=None,
        rank=rank,
        world_size=world,
        start=state["position"] if state else 0,
        columns=loss_def.columns,
        shuffle_weights=cfg.shuffle_weights,
    )
    batches = iter(ds)
    if rank == 0:
        _prepare_out(out, run.tokenizer, step)
    n_params = sum(p.numel() for p in raw_model.parameters())
    log(f"{cfg.model}: {n_params / 1e6:.2f}M params on {device} × {world}; loss {cfg.loss}; from step {step}")

    saved = step  # the step of the last checkpoint on disk

    def save():
        nonlocal saved
        # each rank's loss summed since the last log step: a resumed run's next row averages the same
        # steps as an uninterrupted run's
        sums = [loss_sum.reshape(1)]
        if world > 1:
            sums = [torch.zeros(1, device=device) for _ in range(world)]
            torch.distributed.all_gather(sums, loss_sum.reshape(1))
        if rank == 0:
            st = {
                "step": step,
                "position": ds.position,
                "world_size": world,
                "tokens": tokens,
                "seed": cfg.seed,
                "log_window": {"loss_sums": [float(x) for x in sums], "steps": n_steps},
            }
            with _failing(f"cannot save the checkpoint at step {step}", out, saved):
                save_training_checkpoint(out, raw_model, cfg.model, optimizer, st, {**run.meta, "step": step})
                if publish is not None:
                    publish()
        if world > 1:
            torch.distributed.barrier()
        saved = step

    mask_pads = bool(run.model_cfg.get("mask_pads"))  # a model that skips the left padding reads where it is
    last_stop = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps
    t_run = t0 = time.perf_counter()
    # each rank's share of the steps' losses (they sum over ranks to the step's loss), summed on the
    # device between log steps: the host reads them there (and once a step, below); a resumed run goes
    # on with the sum its checkpoint saved (none before 2026-11-28: from 0)
    window = _log_window((state or {}).get("log_window"), cfg.grad_accum, world)
    loss_sum = torch.tensor(window["loss_sums"][rank], dtype=torch.float32, device=device)
    n_steps = window["steps"]
    real = torch.zeros((), dtype=torch.int64, device=device)
    real_total = 0  # real tokens of every rank, as the log rows sum them (the run's tokens/s)
    ce_sums, last_loss = None, None
    model.train()
    while step < last_stop:
        lr = lr_at(step, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr
        micro_batches = [next(batches) for _ in range(cfg.grad_accum)]
        logged = (step + 1) % cfg.log_every == 0 or step + 1 == last_stop

        def seed(
            micro, step=step
        ):  # dropout / estimator noise drawn from (seed, step, micro, rank): resume-exact
            torch.manual_seed(hash((cfg.seed, step, micro, rank)) & 0x7FFFFFFF)

        step_loss, plain = step_gradients(
            model, micro_batches, loss_def, loss_kw, fwd_kw, world, device, autocast, mask_pads, seed, logged
        )
        for batch in micro_batches:
            tokens += batch["input_ids"].numel() * world
            real += batch["mask"][:, 1:].to(device).sum()
        if plain is not None:
            ce_sums = plain
        # the step's one host sync: a non-finite loss stops the run before it reaches the weights
        value = step_loss.item()
        _stop_if_not_finite(
            None if math.isfinite(value) else value, step + 1, cfg.loss, out, saved, world, device
        )
        loss_sum += step_loss
        n_steps += 1
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % cfg.log_every == 0 or step == last_stop:
            row, real_logged = _log_row(step, lr, tokens, loss_sum / n_steps, ce_sums, real, world, t0, t_run)
            real_total += real_logged
            last_loss = row["loss"]
            if rank == 0:
                with (
                    _failing(f"cannot write {METRICS} at step {step}", out, saved),
                    open(out / METRICS, "a") as f,
                ):
                    f.write(json.dumps(row, allow_nan=False) + "\n")  # standard JSON: no NaN/Infinity
            log(
                f"step {step}/{cfg.steps} loss {_show(row['loss'])} ce {_show(row['ce'])} lr {lr:.2e} "
                f"{row['tokens_per_s']:.0f} tok/s"
            )
            t0 = time.perf_counter()
            real.zero_()
            if step % cfg.log_every == 0:  # a run stopped between log steps keeps its sum (save, above)
                n_steps = 0
                loss_sum.zero_()
        if (cfg.save_every and step % cfg.save_every == 0) or step == last_stop:
            save()
    seconds = time.perf_counter() - t_run
    return TrainResult(
        out=str(out),
        step=step,
        steps=cfg.steps,
        loss=last_loss,
        tokens=tokens,
        seconds=seconds,
        tokens_per_s=real_total / max(seconds, 1e-9),
        metrics=str(out / METRICS),
    )


def step_gradients(
    model, micro_batches, loss_def: Loss, loss_kw, fwd_kw, world, device, autocast, mask_pads, seed, plain
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward and backward one optimizer step's micro-batches on this rank: (this rank's share of the
    step's loss, and where `plain` the plain CE's (sum, count) over its real targets, else None).

    The step's loss is the sum over every real target of the step, all micro-batches of all ranks,
    divided by one normaliser counted up front over the same (`Loss.normaliser`: the real targets, or
    their Σ w), so a token weighs the same in a step whatever micro-batch or rank it fell in: a step of
    micro-batches of unequal real-token counts gives the loss and gradients of one batch of its rows,
    not a mean of the micro-batches' means. DDP averages the ranks' gradients: each rank's backward is
    scaled by the world size to make that average their sum. The ranks' shares sum to the step's loss."""
    moved = []
    for batch in micro_batches:
        ids = batch["input_ids"].to(device, non_blocking=True)
        columns = {k: batch[k][:, 1:].to(device) for k in loss_def.columns}
        moved.append((ids, batch["mask"].to(device), columns))
    normaliser = sum(loss_def.normaliser(mask[:, 1:], **columns, **loss_kw) for _, mask, columns in moved)
    if world > 1:
        torch.distributed.all_reduce(normaliser)
    denominator = floor(normaliser)
    step_loss = torch.zeros((), device=device)
    ce = torch.zeros(2, dtype=torch.float64, device=device) if plain else None
    for micro, (ids, mask, columns) in enumerate(moved):
        seed(micro)
        pads = {"attention_mask": mask} if mask_pads else {}
        sync = micro == len(moved) - 1 or world == 1
        with contextlib.nullcontext() if sync else model.no_sync(), autocast:
            logits = model(ids, **fwd_kw, **pads)[:, :-1]
            loss = loss_def.fn(logits, ids[:, 1:], mask[:, 1:], **columns, **loss_kw, denominator=denominator)
        (loss * world).backward()
        step_loss += loss.detach()
        if ce is not None:
            ce += _plain_ce(model, logits.detach(), ids[:, 1:], mask[:, 1:], fwd_kw)
    return step_loss, ce


def _plain_ce(model, logits, targets, mask, fwd_kw) -> torch.Tensor:
    """The plain CE's (sum, count) over a micro-batch's real targets, logged for every loss so that
    runs compare (a weighted loss says nothing of the model's quality)."""
    with torch.no_grad():
        if fwd_kw:  # a hashed head's vocabulary scores
            model = getattr(model, "module", model)  # (under DDP)
            model = getattr(model, "_orig_mod", model)  # (compiled)
            logits = model.scores(logits)
        total = (per_token_ce(logits, targets) * mask).sum()
        return torch.stack([total.double(), mask.sum().double()])


def _log_window(saved: dict | None, grad_accum: int, world: int) -> dict:
    """The log window a checkpoint saved: each rank's share of its steps' losses and the steps. One
    saved before 2026-12 (`micro_steps`: each rank's sum of micro-batch means) is read as their mean."""
    if not saved:
        return {"loss_sums": [0.0] * world, "steps": 0}
    if "micro_steps" in saved:
        return {
            "loss_sums": [x / (grad_accum * world) for x in saved["loss_sums"]],
            "steps": saved["micro_steps"] // grad_accum,
        }
    return saved


def _log_row(step, lr, tokens, mean_loss, ce_sums, real, world, t0, t_run) -> tuple[dict, int]:
    """A metrics.jsonl row (the loss: the ranks' shares summed; the plain CE over every rank's real
    targets of the logged step; tokens/s over real, non-pad, tokens) and the real tokens of every rank
    since the last row. The run ends on a log row: its last collective is save()'s barrier, never one
    just before the process group is torn down (gloo can abort then)."""
    if ce_sums is None:  # (every log step computes them: never, but a row is still written)
        ce_sums = torch.tensor([math.nan, 1.0], dtype=torch.float64, device=real.device)
    values = torch.cat([mean_loss.double().reshape(1), ce_sums, real.double().reshape(1)])
    if world > 1:
        torch.distributed.all_reduce(values)
    loss, ce_total, ce_count, real = values.tolist()
    row = {
        "step": step,
        "loss": _finite(loss),
        "ce": _finite(ce_total / ce_count) if ce_count else None,
        "lr": lr,
        "tokens": tokens,
        "tokens_per_s": round(real / max(time.perf_counter() - t0, 1e-9), 1),
        "elapsed_s": round(time.perf_counter() - t_run, 3),
    }
    return row, int(real)


def _finite(x: float) -> float | None:
    """A metric as standard JSON: rounded, or None where it is not finite."""
    return round(x, 6) if math.isfinite(x) else None


def _show(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


@contextlib.contextmanager
def _failing(what: str, out: Path, saved: int):
    """An I/O error (disk full, read-only) while the run writes: stop with a message, not a traceback."""
    try:
        yield
    except (OSError, SafetensorError) as e:  # safetensors reports its write errors as its own
        raise TrainFailed(f"{what} in {out}: {e}; {_kept(out, saved)}") from None


def _kept(out: Path, saved: int) -> str:
    if saved and (out / STATE).is_file():
        return f"the checkpoint of step {saved} is intact: fix the cause and rerun with --resume"
    return "no checkpoint was saved"


def _stop_if_not_finite(bad: float | None, step: int, loss: str, out: Path, saved: int, world: int, device):
    """Stop the run (on every rank) when a rank's loss is NaN or infinite, before it reaches the weights."""
    if world > 1:  # every rank must stop together, or the others wait in the next all-reduce
        flag = torch.tensor([0.0 if bad is None else 1.0], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() and bad is None:
            bad = "not finite on another rank"
    if bad is not None:
        raise TrainFailed(
            f"training stopped: the {loss} loss is {bad} at step {step}; nothing of this step was applied, "
            f"{_kept(out, saved)} (lower --lr, keep --grad-clip, or check the data)"
        )


def _check_values(files: list, columns, rank: int, world: int, device, parts=None) -> None:
    """Refuse a shard whose bytes differ from its manifest, NaN/inf (and weights outside [0, 1]) in the
    loss's columns before the first step, and weights that are all 0 (the loss would be 0 at every
    step and the model learn nothing). Each rank reads its share of the files once (a stage's shard
    whole, its sha256 computed as it streams); then every rank raises, naming the first bad file."""
    problems, positive = value_problems(files[rank::world], columns, parts)
    if world > 1:
        first = torch.tensor([files.index(problems[0][0]) if problems else len(files)], device=device)
        torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MIN)
        if int(first.item()) < len(files) and not (problems and problems[0][0] == files[int(first.item())]):
            problems, _ = value_problems([files[int(first.item())]], columns, parts)
        count = torch.tensor([positive], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(count)
        positive = int(count.item())
    if problems:
        more = f" ({len(problems) - 1} more file(s) too)" if len(problems) > 1 else ""
        raise DataError(problems[0][1] + more)
    if "weight" in columns and positive == 0:
        dirs = {str(f).rsplit("/", 1)[0] for f in files}  # local paths or URLs, as strings
        where = (
            str(files[0]) if len(files) == 1 else dirs.pop() if len(dirs) == 1 else f"the {len(files)} files"
        )
        raise DataError(
            f"every weight in {where} is 0: a weighted loss would be 0 at every step and train nothing; "
            "weigh the data again (another --weighting), or train with --loss ce"
        )


def _trim_metrics(path: Path, step: int) -> None:
    """On resume, drop logged rows past the checkpoint's step (they will be logged again)."""
    if not path.exists():
        return
    text = path.read_text()
    keep = "".join(ln + "\n" for ln in text.splitlines() if ln.strip() and json.loads(ln)["step"] <= step)
    if keep != text:  # a resume with nothing to drop leaves the file as it was
        path.write_text(keep)
