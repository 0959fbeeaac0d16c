"""Downstream accuracy of a trained checkpoint through lm-eval's own Python API.

The checkpoint is exported as a Hugging Face `LlamaForCausalLM` (export.py) into a scratch directory
and scored by `lm_eval.simple_evaluate` with lm-eval's HF model (`HFLM`) on named tasks: lm-eval's
own (hellaswag, arc_easy, ...: they download their data) and the offline task, `OFFLINE_TASK`, a
multiple-choice task over a JSON-lines file of items (transforms/choice_items.py builds them from
held-out documents) that lm-eval reads through a task YAML written here and found with
`TaskManager(include_path=...)`.

What comes back, per task: each metric's value and standard error as lm-eval computes them, the
number of items, the chance level of a multiple-choice task (the mean of 1/choices), and the
per-item 0/1 vector of every metric in item order (lm-eval's logged samples sorted by `doc_id`), so
two runs' answers can be paired item by item (McNemar). Groups (GLUE) keep their aggregate metrics.

lm-eval and HF datasets write their caches under `work_dir`, not the user's home; the Python,
numpy and torch random states lm-eval seeds are put back afterwards (the caller's runs stay as they
were). Needs the `eval` extra (`pip install 'entroweight[eval]'`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import tempfile
from pathlib import Path

from entroweight.options import device_here

from .outputs import ITEMS_FILE  # noqa: F401 - the offline task's items, where a workflow or `evaluate` keeps them

OFFLINE_TASK = "entroweight_heldout"
CHOICE_METRICS = ("acc", "acc_norm", "acc_mutual_info")
TASK_DIR = "tasks"  # under work_dir: the offline task's YAML (include_path)
CACHE_DIR = "hf-datasets"  # under work_dir: HF datasets' cache (the items file's Arrow copy, hub data)


class AccuracyError(ValueError):
    """The evaluation is refused before it runs (unknown task, items that do not fit, no lm-eval)."""


def require_lm_eval():
    try:
        import lm_eval  # noqa: F401
        from lm_eval.models.huggingface import HFLM  # noqa: F401 - needs accelerate
    except ImportError as e:
        raise AccuracyError(
            f"downstream accuracy needs lm-eval and accelerate ({e}): pip install 'entroweight[eval]'"
        ) from None


def offline_task_config(items_file: str | Path, cache_dir: str | Path) -> dict:
    """The offline task as an lm-eval task config: each JSON line's `prefix`, `choices` and `label`;
    every choice already holds its leading space, so no delimiter is added."""
    return {
        "task": OFFLINE_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {"test": str(Path(items_file).resolve())},
            "cache_dir": str(Path(cache_dir).resolve()),
        },
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "prefix",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": "",
        "num_fewshot": 0,
        "metric_list": [
            {"metric": m, "aggregation": "mean", "higher_is_better": True} for m in CHOICE_METRICS
        ],
        "metadata": {"version": 1},
    }


def read_items(items_file: str | Path) -> list[dict]:
    path = Path(items_file)
    if not path.is_file():
        raise AccuracyError(f"no items file {path}")
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def write_items(items: list[dict], items_file: str | Path) -> Path:
    path = Path(items_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items), encoding="utf-8")
    tmp.replace(path)
    return path


def task_manager(tasks: list[str], work_dir: Path, items_file: str | Path | None):
    """lm-eval's TaskManager over its own tasks (only when one is asked for: indexing them takes
    seconds) and the offline task's YAML; refuses unknown names and the offline task without items."""
    import yaml
    from lm_eval.tasks import TaskManager

    if OFFLINE_TASK in tasks and items_file is None:
        raise AccuracyError(f"the {OFFLINE_TASK} task needs its items (held-out documents): none given")
    _refuse_unknown(unknown_tasks(tasks))  # lm-eval's index, read once per process
    include = None
    if items_file is not None:
        include = work_dir / TASK_DIR
        include.mkdir(parents=True, exist_ok=True)
        config = offline_task_config(items_file, work_dir / CACHE_DIR)
        (include / f"{OFFLINE_TASK}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    online = [t for t in tasks if t != OFFLINE_TASK]
    return TaskManager(include_path=str(include) if include else None, include_defaults=bool(online))


def unknown_tasks(tasks: list[str]) -> list[str]:
    """The names in `tasks` that are neither lm-eval's (tasks, groups, tags) nor the offline task."""
    require_lm_eval()
    online = [t for t in tasks if t != OFFLINE_TASK]
    return [t for t in online if t not in lm_eval_tasks()] if online else []


@functools.cache
def lm_eval_tasks() -> frozenset[str]:
    """Every name lm-eval's own task index knows; built once per process (it parses thousands of YAML
    files: seconds)."""
    from lm_eval.tasks import TaskManager

    with _quiet_lm_eval():
        return frozenset(TaskManager().all_tasks)


def _refuse_unknown(unknown: list[str]) -> None:
    if unknown:
        raise AccuracyError(
            f"unknown task {', '.join(unknown)}: give lm-eval task names (`lm_eval ls tasks`) or "
            f"{OFFLINE_TASK} (docs/workflows.md, downstream accuracy)"
        )


def model_context(hf_dir: Path) -> int:
    """The exported model's context as lm-eval reads it: max_position_embeddings."""
    return int(json.loads((hf_dir / "config.json").read_text())["max_position_embeddings"])


def check_fit(items: list[dict], n_ctx: int) -> None:
    longest = max((it.get("tokens", 0) for it in items), default=0)
    if longest > n_ctx:
        raise AccuracyError(
            f"the items need up to {longest} tokens but the model's context is {n_ctx}: lm-eval would cut "
            "each prefix from the left without a word; build shorter items (prefix_tokens, continuation_tokens)"
        )


@contextlib.contextmanager
def _hf_caches(cache_dir: Path):
    """HF datasets' cache under `cache_dir` for the duration (its module reads the environment once, at
    import, so its settings are set as well as the variable)."""
    import datasets.config as dc

    names = ("HF_DATASETS_CACHE", "DOWNLOADED_DATASETS_PATH", "EXTRACTED_DATASETS_PATH")
    saved = {n: getattr(dc, n) for n in names}
    env = os.environ.get("HF_DATASETS_CACHE")
    root = Path(cache_dir).resolve()
    try:
        os.environ["HF_DATASETS_CACHE"] = str(root)
        dc.HF_DATASETS_CACHE = root
        dc.DOWNLOADED_DATASETS_PATH = root / dc.DOWNLOADED_DATASETS_DIR
        dc.EXTRACTED_DATASETS_PATH = root / dc.EXTRACTED_DATASETS_DIR
        yield root
    finally:
        for n, v in saved.items():
            setattr(dc, n, v)
        if env is None:
            os.environ.pop("HF_DATASETS_CACHE", None)
        else:
            os.environ["HF_DATASETS_CACHE"] = env


@contextlib.contextmanager
def _kept_random_state():
    """lm-eval seeds Python's, numpy's and torch's global generators: put them back after."""
    import numpy as np
    import torch

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def evaluate_checkpoint(
    ckpt_dir: str | Path,
    tasks: list[str],
    work_dir: str | Path,
    items_file: str | Path | None = None,
    batch_size: int = 32,
    device: str = "auto",
    num_fewshot: int | None = None,
    limit: int | None = None,
    allow_pickle: bool = False,
) -> dict:
    """Export `ckpt_dir` and run lm-eval's `simple_evaluate` on `tasks`; see `summarize` for the result.
    `work_dir`: lm-eval's scratch (the task YAML, HF datasets' cache, the temporary export)."""
    require_lm_eval()
    if not tasks:
        raise AccuracyError("no task to evaluate: name at least one")
    try:  # the one device check of every command, before the scratch directory is made
        device = str(device_here(device))
    except ValueError as e:
        raise AccuracyError(f"--device {e}") from None
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    items = read_items(items_file) if items_file is not None and OFFLINE_TASK in tasks else None
    from .export import export_hf

    # the export builds a model (random init) before loading the weights: its draws are put back too
    with _kept_random_state(), _hf_caches(work / CACHE_DIR), _quiet_lm_eval():
        tm = task_manager(tasks, work, items_file if items is not None else None)
        with tempfile.TemporaryDirectory(prefix=".hf-export-", dir=work) as tmp:
            hf_dir = export_hf(ckpt_dir, tmp, allow_pickle=allow_pickle)
            if items is not None:
                check_fit(items, model_context(hf_dir))
            results = _simple_evaluate(hf_dir, tasks, tm, batch_size, device, num_fewshot, limit)
    return summarize(results)


def _simple_evaluate(hf_dir, tasks, tm, batch_size, device, num_fewshot, limit) -> dict:
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    threads = torch.get_num_threads()
    if device == "cpu":  # resolved and checked by evaluate_checkpoint
        # lm-eval scores request by request (a slice, an argmax, a gather per choice): small ops whose
        # thread hand-offs cost more than they share; one thread took 6-7x less CPU time for the
        # same answers on 2 busy cores (docs/workflows.md, downstream accuracy)
        torch.set_num_threads(1)
    try:
        lm = HFLM(pretrained=str(hf_dir), device=device, batch_size=batch_size, dtype="float32")
        return simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=tm,
            num_fewshot=num_fewshot,
            limit=limit,
            log_samples=True,
        )
    except ConnectionError as e:  # `datasets` fetching a task's data: no network, or offline mode
        first = " ".join(str(e).split())
        others = [t for t in tasks if t != OFFLINE_TASK]
        raise AccuracyError(
            f"cannot fetch the data of {', '.join(others)} from the Hugging Face hub ({first}): check the "
            f"network and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE (a dataset read once is cached), or "
            f"evaluate {OFFLINE_TASK} alone, which reads no hub"
        ) from None
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _quiet_lm_eval():
    """lm-eval logs every step at INFO; a workflow step says its own one line. It also asks git for
    the hash of the current directory with git's stderr open, so outside a checkout a user reads
    "fatal: not a git repository": the probe is skipped (the results carry our code version)."""
    import lm_eval.evaluator as evaluator

    logger = logging.getLogger("lm_eval")
    level, probe = logger.level, evaluator.get_git_commit_hash
    logger.setLevel(logging.WARNING)
    evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        logger.setLevel(level)
        evaluator.get_git_commit_hash = probe


def _binary(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float) and v in (0, 1):
        return float(v)
    return None


def summarize(results: dict) -> dict:
    """lm-eval's results as plain values: {"tasks": {task: {"n", "chance", "metrics": {metric: {"value",
    "stderr"}}, "items": {metric: [0/1 per item, in item order], "margin": [nats per item]}}},
    "groups": {group: {"metrics"}},
    "lm_eval": version, "num_fewshot": {task: shots}}. A metric keeps lm-eval's filter in its name
    unless it is the default `none` (gsm8k: `exact_match,strict-match`)."""
    from lm_eval import __version__ as lm_version

    samples = results.get("samples") or {}
    configs = results.get("configs") or {}
    groups = set(results.get("groups") or {})
    out: dict = {"tasks": {}, "groups": {}, "lm_eval": lm_version, "num_fewshot": results.get("n-shot", {})}
    for task, res in (results.get("results") or {}).items():
        metrics = {}
        for key, value in res.items():
            if "," not in key or "_stderr," in key or not isinstance(value, int | float):
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else key
            err = res.get(f"{metric}_stderr,{filt}")
            metrics[name] = {
                "value": float(value),
                "stderr": float(err) if isinstance(err, int | float) else None,
            }
        if task in groups or task not in samples:
            out["groups"][task] = {"metrics": metrics}
            continue
        logged = sorted(samples[task], key=lambda s: (s["doc_id"], s.get("filter", "none")))
        items: dict[str, list[float]] = {}
        for s in logged:
            filt = s.get("filter", "none")
            for metric in s.get("metrics", []):
                v = _binary(s.get(metric))
                if v is not None:
                    items.setdefault(metric if filt == "none" else f"{metric},{filt}", []).append(v)
            m = margin(s) if filt == "none" else None
            if m is not None:
                items.setdefault(MARGIN, []).append(m)
        n = len({s["doc_id"] for s in logged})
        entry = {
            "n": n,
            "chance": None,
            "metrics": metrics,
            "items": {k: v for k, v in items.items() if len(v) == n},
        }
        if configs.get(task, {}).get("output_type") == "multiple_choice" and logged:
            entry["chance"] = float(sum(1 / _n_choices(s) for s in logged) / len(logged))
        out["tasks"][task] = entry
    return out


# Each multiple-choice item's log-likelihood margin: the true continuation's over the mean of the
# distractors' (nats; lm-eval's conditional log-likelihoods). A continuous endpoint beside 0/1
# accuracy: at small scale it carries more signal per item (docs/experiments.md).
MARGIN = "margin"


def margin(sample: dict) -> float | None:
    """The sample's margin (MARGIN), or None where it has no single gold choice among numbers."""
    gold = sample.get("target")
    resps = sample.get("filtered_resps") or []
    n = _n_choices(sample) if "arguments" in sample else len(resps)
    try:
        lls = [float(r[0] if isinstance(r, list | tuple) else r) for r in resps[:n]]
    except (TypeError, ValueError, IndexError):
        return None
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(lls) or len(lls) < 2:
        return None
    return lls[gold] - (sum(lls) - lls[gold]) / (len(lls) - 1)


def _n_choices(sample: dict) -> int:
    """One loglikelihood request per choice, two with acc_mutual_info (the unconditional one too)."""
    n = len(sample["arguments"])
    return n // 2 if "acc_mutual_info" in sample.get("metrics", []) else n
