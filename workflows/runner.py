"""Run a workflow: holdout -> tokenizer -> tokenize -> models -> scores -> experiment training -> eval
-> report.

Every step is incremental. Data stages skip shards whose manifest matches their config (the
stage machinery); a trained model skips when its directory holds a finished checkpoint whose
recorded step key (its training config plus a fingerprint of its data) is this run's; an
evaluation is cached as JSON keyed by the checkpoint's weights and the eval settings. The run
holds `RUN_DIR/.lock` throughout and records `RUN_DIR/run.json`: the resolved config, the code
version, what each step did and every data stage's manifests.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from entroweight import __version__
from entroweight.pipelines import StageError, run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.stage import SHARDS_FILE, STAGE_FILE, read_manifests, run_lock
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.pipelines.verify import verify_dir
from entroweight.pipelines.weigh import WeighStage
from entroweight.schemas import StageRecord
from entroweight.schemas.tokenizer import TOKENIZER_FILE
from entroweight.transforms.writer import write_json_atomic

from .report import read_metrics, write_report
from .spec import TOKENS, ModelSpec, TrainSettings, Workflow

STEP_FILE = ".workflow-step.json"  # in a tokenizer or checkpoint directory: the key it was built with
RUN_FILE = "run.json"


class WorkflowError(RuntimeError):
    """A step cannot run (refused before its work); the message says what to do. Exit code 2."""


class StepFailed(RuntimeError):
    """A step started and failed (shards failed, verification found problems). Exit code 1."""


class LimitedScoreStage(ScoreStage):
    """The score stage over the first `limit` input shards only: slow scorers score a subset. Raising
    the limit later scores the rest incrementally (the shard config does not change)."""

    def __init__(self, *args, limit: int | None = None, **kw):
        super().__init__(*args, **kw)
        self.limit = limit

    def plan_inputs(self):
        inputs = super().plan_inputs()
        return inputs[: self.limit] if self.limit else inputs


@dataclasses.dataclass
class Step:
    kind: str  # tokenizer | tokenize | model | score | train | eval | report
    name: str
    out: Path
    status: str = "pending"  # up to date | ran | would run | failed
    detail: str = ""
    seconds: float = 0.0
    manifests: list[dict] | None = None

    def record(self) -> dict:
        d = {"kind": self.kind, "name": self.name, "out": str(self.out), "status": self.status}
        d |= {"detail": self.detail, "seconds": round(self.seconds, 3)}
        if self.manifests is not None:
            d["manifests"] = self.manifests
        return d


@functools.cache
def code_version() -> str:
    """The package version, plus `git describe` of the checkout when it is one."""
    repo = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty", "--tags"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if out.returncode == 0 and out.stdout.strip():
            return f"{__version__}+git.{out.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    return __version__


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def data_fingerprint(data_dir: Path) -> str:
    """What a model trained on `data_dir` depends on: each shard's output checksum."""
    return _key([(m.shard, m.output_sha256) for m in read_manifests(data_dir)])


def preview(stage, out: Path) -> tuple[int, int, str]:
    """(shards done, shards to run, note) of a stage, without writing anything (plan_run's rules)."""
    inputs = stage.plan_inputs()
    note = ""
    stage_file = out / STAGE_FILE
    if stage_file.exists():
        old = StageRecord.model_validate_json(stage_file.read_text())
        if old.config_hash != stage.config_hash:
            return 0, len(inputs), " (config changed: needs --overwrite)"
    registry = json.loads((out / SHARDS_FILE).read_text()) if (out / SHARDS_FILE).exists() else {}
    manifests = {m.shard: m for m in read_manifests(out)} if out.is_dir() else {}
    done = 0
    for inp in inputs:
        m = manifests.get(registry.get(inp.key, ""))
        if m and m.config_hash == stage.config_hash and (out / m.output).exists() and list(m.inputs) == [inp]:
            done += 1
    return done, len(inputs) - done, note


class Runner:
    def __init__(
        self,
        wf: Workflow,
        engine: str = "local",
        engine_options: dict | None = None,
        dry_run: bool = False,
        overwrite: bool = False,
        wait: float = 0,
        echo: Callable[[str], None] = print,
        workflow_file: str | None = None,
    ):
        self.wf, self.engine, self.engine_options = wf, engine, engine_options or {}
        self.dry_run, self.overwrite, self.wait, self.echo = dry_run, overwrite, wait, echo
        self.workflow_file = workflow_file
        self.steps: list[Step] = []
        self.stale: set[str] = set()  # outputs that are not up to date (dry run: downstream must wait)

    # -- the whole run
    def run(self) -> list[Step]:
        root = self.wf.root
        if self.dry_run:
            self.echo(f"plan for {root} (dry run: nothing is written)")
            self._all_steps()
            n = sum(s.status == "would run" for s in self.steps)
            self.echo(
                f"{n} of {len(self.steps)} step(s) would run"
                if n
                else "nothing to do: all steps are up to date"
            )
            return self.steps
        lock = run_lock(root, self.wait)  # LockHeld -> exit 3
        start = time.perf_counter()
        try:
            self._all_steps()
        finally:
            self._write_record(time.perf_counter() - start)
            lock.release()
        ran = [s for s in self.steps if s.status == "ran"]
        if not ran:
            self.echo(f"nothing to do: all {len(self.steps)} step(s) of {root} are up to date")
        else:
            self.echo(f"done: {len(ran)} step(s) ran in {time.perf_counter() - start:.1f} s -> {root}")
        return self.steps

    def _all_steps(self) -> None:
        try:
            self._each_step()
        except (
            ValueError
        ) as e:  # input refused below (SourceError, TokenizerError, ScorerError, TrainError...)
            step = self.steps[-1] if self.steps else None
            if step is None:
                raise WorkflowError(str(e)) from None
            step.status = "failed"
            raise WorkflowError(f"{step.kind} {step.name}: {e}") from None

    def _each_step(self) -> None:
        wf = self.wf
        if wf.holdout is not None:
            self._holdout()
        self._tokenizer()
        self._tokenize()
        for m in wf.models:
            self._model(m)
        for s in wf.scores:
            self._score(s)
        if wf.train:
            if wf.eval:
                self._unigram()
            # seed by seed, each run evaluated once trained: a run stopped part way has every run at
            # the same number of seeds, and those are complete
            for seed in wf.train.seeds:
                for r in wf.train.runs:
                    self._experiment(r, seed)
                    if wf.eval:
                        for text in wf.eval_texts():
                            self._eval_one(r, seed, text)
        if wf.report is not None:
            self._report()

    def _write_record(self, seconds: float) -> None:
        record = {
            "workflow_file": self.workflow_file,
            "config": self.wf.model_dump(mode="json", by_alias=True),
            "code_version": code_version(),
            "engine": self.engine,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(seconds, 3),
            "python": sys.version.split()[0],
            "steps": [s.record() for s in self.steps],
        }
        write_json_atomic(record, self.wf.root / RUN_FILE)

    def _begin(self, kind: str, name: str, out: Path) -> Step:
        step = Step(kind, name, out)
        self.steps.append(step)
        return step

    def _say(self, step: Step, status: str, detail: str) -> None:
        step.status, step.detail = status, detail
        self.echo(f"{step.kind} {step.name}: {status}{' - ' + detail if detail else ''}")

    # -- held-out documents
    def _holdout(self) -> None:
        """Split the sources: the last `docs` documents become the held-out text, never trained on."""
        import gzip

        from entroweight.transforms.train_tokenizer import corpus_texts

        h, out = self.wf.holdout, self.wf.holdout_dir()
        step = self._begin("holdout", "holdout", out)
        key = _key({"sources": list(self.wf.sources), "docs": h.docs})
        marker = out / STEP_FILE
        if marker.exists() and json.loads(marker.read_text()).get("key") == key:
            return self._say(step, "up to date", str(out))
        if self.dry_run:
            self.stale.add("holdout")
            return self._say(step, "would run", f"set aside the last {h.docs} documents")
        texts = list(corpus_texts(list(self.wf.sources)))
        if len(texts) <= h.docs:
            raise WorkflowError(f"holdout.docs is {h.docs}, but the sources hold only {len(texts)} documents")
        train, held = texts[: -h.docs], texts[-h.docs :]
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "train.jsonl.gz.tmp"
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            for t in train:
                f.write(json.dumps({self.wf.tokenize.text_column: t}) + "\n")
        tmp.replace(out / "train.jsonl.gz")
        (out / "heldout.txt.tmp").write_text("\n\n".join(held), encoding="utf-8")
        (out / "heldout.txt.tmp").replace(out / "heldout.txt")
        write_json_atomic({"key": key, "train_docs": len(train), "heldout_docs": len(held)}, marker)
        self._say(step, "ran", f"{len(train)} documents to train on, {len(held)} held out")

    # -- tokenizer
    def _tokenizer(self) -> None:
        spec, out = self.wf.tokenizer, self.wf.tokenizer_dir()
        step = self._begin("tokenizer", "tokenizer", out)
        if spec.path is not None:
            from entroweight.schemas.tokenizer import resolve_tokenizer_path

            try:
                resolve_tokenizer_path(spec.path)
            except (ValueError, OSError) as e:
                raise WorkflowError(f"tokenizer.path: {e}") from None
            return self._say(step, "up to date", f"given: {spec.path}")
        key = {"train": spec.train.model_dump(mode="json")}
        if self.wf.holdout is not None:  # trained on the sources less the held-out documents
            key["holdout"] = self.wf.holdout.docs
        key = _key(key)
        marker = out / STEP_FILE
        built = (out / TOKENIZER_FILE).exists()
        old = json.loads(marker.read_text()).get("key") if marker.exists() else None
        if built and old == key:
            return self._say(step, "up to date", str(out / TOKENIZER_FILE))
        if built and not self.overwrite:
            raise WorkflowError(
                f"{out} holds a tokenizer trained with other settings; everything downstream depends on it. "
                "Use another run_dir, or pass --overwrite to retrain it (and redo what depends on it)"
            )
        if self.dry_run:
            self.stale.add("tokenizer")
            return self._say(
                step, "would run", f"train a {spec.train.vocab_size}-token {spec.train.algorithm}"
            )
        from entroweight.transforms.train_tokenizer import corpus_texts, save_tokenizer, train_tokenizer

        t0 = time.perf_counter()
        t = spec.train
        tok = train_tokenizer(
            corpus_texts(self.wf.train_sources(), t.max_docs, self.wf.tokenize.text_column),
            t.vocab_size,
            t.algorithm,
            t.base,
        )
        path, sha = save_tokenizer(tok, out)
        write_json_atomic({"key": key, "sha256": sha}, marker)
        step.seconds = time.perf_counter() - t0
        self._say(step, "ran", f"{tok.get_vocab_size()} tokens -> {path} ({step.seconds:.1f} s)")

    def tokenizer_file(self) -> str:
        d = self.wf.tokenizer_dir()
        return str(d / TOKENIZER_FILE) if d.is_dir() else str(d)

    # -- data stages
    def _stage(self, step: Step, build: Callable[[], Any], upstream: list[str]) -> None:
        out = step.out
        if self.dry_run and any(u in self.stale for u in upstream):
            self.stale.add(step.name)
            return self._say(step, "would run", f"after {', '.join(u for u in upstream if u in self.stale)}")
        try:
            stage = build()
        except StageError as e:  # refusals that are not ValueErrors (e.g. the data's tokenizer)
            raise WorkflowError(f"{step.kind} {step.name}: {e}") from None
        if self.dry_run:
            done, todo, note = preview(stage, out)
            if todo:
                self.stale.add(step.name)
                return self._say(step, "would run", f"{todo} shard(s) to run, {done} done{note}")
            return self._say(step, "up to date", f"all {done} shard(s) done")
        t0 = time.perf_counter()
        summary = run_stage(
            stage, out, engine=self.engine, overwrite=self.overwrite, progress=False, **self.engine_options
        )
        step.seconds = time.perf_counter() - t0
        step.manifests = [json.loads(m.model_dump_json()) for m in read_manifests(out)]
        note = self._verify(step)
        self._say(step, "ran" if summary.shards_run else "up to date", summary.line() + note)

    def _verify(self, step: Step) -> str:
        """Every shard against its manifest after each data stage (`entroweight verify`)."""
        problems = verify_dir(step.out)
        if problems:
            step.status = "failed"
            raise StepFailed(
                f"{step.kind} {step.name}: {step.out} failed verification:\n  " + "\n  ".join(problems)
            )
        return "; verified"

    def _tokenize(self) -> None:
        t, wf = self.wf.tokenize, self.wf
        step = self._begin("tokenize", TOKENS, wf.tokens_dir())

        def build():
            return TokenizeStage(
                wf.train_sources(),
                self.tokenizer_file(),
                t.n_ctx,
                t.pack,
                t.shard_docs,
                t.text_column,
                t.reject_duplicates,
                t.overflow,
            )

        self._stage(step, build, ["tokenizer", "holdout"])

    def _score(self, s) -> None:
        from entroweight.transforms.weigh import WeighConfig, entropy_quantiles

        wf = self.wf
        step = self._begin("score", s.name, wf.score_dir(s.name))
        upstream = [TOKENS, s.checkpoint_from or "", s.weighting.quantiles_from or "", s.values_from or ""]

        def build():
            w = s.weighting
            quantiles = entropy_quantiles(wf.score_dir(w.quantiles_from)) if w.quantiles_from else None
            weigh = WeighConfig(
                method=w.method,
                quantiles=quantiles,
                keep=w.keep,
                clip=w.clip,
                floor=w.floor,
                invert=w.invert,
                dtype=w.dtype,
            )
            if s.values_from:  # an earlier step's values, weighed anew: no second scoring
                return WeighStage(wf.score_dir(s.values_from), weigh, s.with_entropy)
            options = dict(s.options)  # validated with the spec (the scorer's Options model)
            if s.checkpoint_from:
                options["checkpoint"] = str(wf.model_dir(s.checkpoint_from))
            return LimitedScoreStage(
                wf.tokens_dir(),
                s.scorer,
                options,
                weigh,
                s.with_entropy,
                self.tokenizer_file(),
                limit=s.limit_shards,
            )

        self._stage(step, build, upstream)

    # -- training
    def _train_config(
        self, settings: TrainSettings, kind: str, cfg_file, inline: dict, data: Path, out: Path, **kw
    ):
        from entroweight.trainers import TrainConfig

        model_config = {}
        if cfg_file:
            try:
                model_config = yaml.safe_load(Path(cfg_file).read_text()) or {}
            except (OSError, yaml.YAMLError) as e:
                raise WorkflowError(f"cannot read model config {cfg_file}: {e}") from None
            if not isinstance(model_config, dict):
                raise WorkflowError(f"model config {cfg_file} must hold a mapping of model fields")
        model_config = {**model_config, **inline}
        fields = settings.model_dump(include=set(TrainSettings.model_fields) - {"nproc"})
        return TrainConfig(
            data=[str(data)],
            out=str(out),
            model=kind,
            model_config=model_config,
            tokenizer=self.tokenizer_file(),
            quiet=True,
            **fields,
            **kw,
        )

    def _train_step(self, step: Step, cfg, nproc: int, upstream: list[str]) -> None:
        out = step.out
        if self.dry_run and any(u in self.stale for u in upstream):
            self.stale.add(step.name)
            return self._say(
                step,
                "would run",
                f"{cfg.steps} steps, after {', '.join(u for u in upstream if u in self.stale)}",
            )
        data = Path(cfg.data[0])
        if not data.is_dir():
            raise WorkflowError(f"{step.kind} {step.name}: no data at {data}")
        hashed = {
            k: v
            for k, v in dataclasses.asdict(cfg).items()
            if k not in ("out", "quiet", "overwrite", "resume", "device", "log_every", "data")
        }
        key = _key({"train": hashed, "data": data_fingerprint(data), "nproc": nproc})
        if self._finished(out, key, cfg.steps):
            return self._say(step, "up to date", f"finished checkpoint {out}")
        if self.dry_run:
            self.stale.add(step.name)
            return self._say(
                step, "would run", f"{cfg.steps} steps of {cfg.model}, loss {cfg.loss}, seed {cfg.seed}"
            )
        t0 = time.perf_counter()
        (out / STEP_FILE).unlink(missing_ok=True)
        cfg.overwrite = True  # the run directory is the workflow's: a stale checkpoint is replaced
        if nproc > 1:
            self._torchrun(cfg, nproc)
        else:
            from entroweight.trainers import train

            train(cfg)  # a refusal (TrainError, DataError, CheckpointError) is reported by _all_steps
        write_json_atomic({"key": key, "steps": cfg.steps}, out / STEP_FILE)
        step.seconds = time.perf_counter() - t0
        last = _last_metrics(out)
        self._say(
            step, "ran", f"{cfg.steps} steps, ce {last.get('ce', float('nan')):.4f} ({step.seconds:.1f} s)"
        )

    @staticmethod
    def _finished(out: Path, key: str, steps: int) -> bool:
        marker, state = out / STEP_FILE, out / "trainer_state.json"
        if not (marker.exists() and state.exists()):
            return False
        return (
            json.loads(marker.read_text()).get("key") == key
            and json.loads(state.read_text()).get("step") == steps
        )

    def _torchrun(self, cfg, nproc: int) -> None:
        """Multi-GPU training: the same `entroweight train` under torchrun, one process per device."""
        args = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "-m",
            "entroweight.workflows.cli",
            "train",
        ]
        args += list(cfg.data)
        cfg_file = Path(cfg.out) / ".model-config.json"
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        cfg_file.write_text(json.dumps(cfg.model_config))  # JSON is YAML: --model-config reads it
        args += ["--model", cfg.model, "--model-config", str(cfg_file), "--loss", cfg.loss, "--out", cfg.out]
        for name in (
            "steps",
            "batch_size",
            "lr",
            "seed",
            "tokenizer",
            "grad_accum",
            "warmup_steps",
            "min_lr_ratio",
            "weight_decay",
            "grad_clip",
            "normalize",
            "margin",
            "prefix_weight",
            "shuffle_buffer",
            "log_every",
            "device",
        ):
            value = getattr(cfg, name)
            if value is not None:
                args += [f"--{name.replace('_', '-')}", str(value)]
        args += ["--overwrite"] + (["--compile"] if cfg.compile else [])
        if subprocess.run(args).returncode != 0:
            raise StepFailed(f"torchrun training of {cfg.out} failed (see its output above)")

    def _model(self, m: ModelSpec) -> None:
        wf = self.wf
        out = wf.model_dir(m.name)
        step = self._begin("model", m.name, out)
        cfg = self._train_config(
            m, m.kind, m.model_config_file, m.config, wf.tokens_dir(), out, loss=m.loss, seed=m.seed
        )
        self._train_step(step, cfg, m.nproc, [TOKENS])

    def _experiment(self, r, seed: int) -> None:
        wf, t = self.wf, self.wf.train
        out = wf.run_ckpt(r.name, seed)
        step = self._begin("train", f"{r.name}/seed-{seed}", out)
        cfg = self._train_config(
            t,
            t.kind,
            t.model_config_file,
            t.config,
            wf.data_dir(r.data),
            out,
            loss=r.loss,
            seed=seed,
            normalize=r.normalize,
            margin=r.margin,
            prefix_weight=r.prefix_weight,
        )
        self._train_step(step, cfg, t.nproc, [r.data])

    # -- evaluation and report
    def _eval_one(self, r, seed: int, text: str) -> None:
        from entroweight.trainers.bpb import eval_bpb

        wf, e = self.wf, self.wf.eval
        if text == "main":
            text_path, max_bytes, label = e.text, e.max_bytes, ""
        else:
            text_path = str(wf.holdout_dir() / "heldout.txt")
            max_bytes, label = wf.holdout.max_bytes, f" ({text})"
        ckpt, path = wf.run_ckpt(r.name, seed), wf.eval_file(r.name, seed, text)
        step = self._begin("eval", f"{r.name}/seed-{seed}{label}", path)
        if self.dry_run and step.name in self.stale:
            return self._say(step, "would run", "BPB after training")
        state = ckpt / "trainer_state.json"
        if not state.exists():
            if self.dry_run:
                return self._say(step, "would run", "BPB after training")
            raise WorkflowError(f"eval {step.name}: no checkpoint at {ckpt}")
        settings = e.model_dump(mode="json", exclude={"out", "batch_size", "device"})
        if text != "main":
            settings |= {"text": text, "max_bytes": max_bytes, "holdout": wf.holdout.docs}
        key = _key({"weights": json.loads(state.read_text())["weights_sha256"], **settings})
        if path.exists() and json.loads(path.read_text()).get("key") == key:
            return self._say(step, "up to date", f"BPB {json.loads(path.read_text())['bpb']:.4f}")
        if self.dry_run:
            return self._say(step, "would run", "BPB")
        t0 = time.perf_counter()
        res = eval_bpb(ckpt, text_path, e.n_ctx, e.stride, None, max_bytes, e.batch_size, e.device)
        res |= {
            "key": key,
            "run": r.name,
            "seed": seed,
            "loss": r.loss,
            "data": r.data,
            "checkpoint": str(ckpt),
        }
        write_json_atomic(res, path)
        step.seconds = time.perf_counter() - t0
        self._say(step, "ran", f"BPB {res['bpb']:.4f} ({step.seconds:.1f} s)")

    def _unigram(self) -> None:
        """The baseline a model must beat: the training tokens' frequencies as the prediction (BPB)."""
        from entroweight.trainers.bpb import unigram_bpb

        wf, e = self.wf, self.wf.eval
        path = wf.root / e.out / "unigram.json"
        step = self._begin("eval", "unigram", path)
        if self.dry_run and TOKENS in self.stale:
            return self._say(step, "would run", "unigram baseline after tokenize")
        key = _key({"data": data_fingerprint(wf.tokens_dir()), "text": e.text, "max_bytes": e.max_bytes})
        if path.exists() and json.loads(path.read_text()).get("key") == key:
            return self._say(step, "up to date", f"BPB {json.loads(path.read_text())['bpb']:.4f}")
        if self.dry_run:
            return self._say(step, "would run", "unigram baseline")
        t0 = time.perf_counter()
        res = unigram_bpb([str(wf.tokens_dir())], self.tokenizer_file(), e.text, e.max_bytes)
        write_json_atomic({**res, "key": key}, path)
        step.seconds = time.perf_counter() - t0
        self._say(step, "ran", f"BPB {res['bpb']:.4f} ({step.seconds:.1f} s)")

    def _report(self) -> None:
        wf = self.wf
        out = wf.root / wf.report.out
        step = self._begin("report", "report", out)
        ran = any(s.status in ("ran", "would run") for s in self.steps)
        if out.exists() and not ran and (wf.root / RUN_FILE).exists():
            return self._say(step, "up to date", str(out))
        if self.dry_run:
            return self._say(step, "would run", str(out))

        t0 = time.perf_counter()
        self._write_record(0.0)  # the report reads run.json: give it this run's steps
        write_report(wf.root, out, samples=wf.report.samples, max_tokens=wf.report.max_tokens)
        step.seconds = time.perf_counter() - t0
        self._say(step, "ran", f"{out} ({step.seconds:.1f} s)")


def _last_metrics(out: Path) -> dict:
    return (read_metrics(out) or [{}])[-1]
