"""The kinds of workflow step, each behind one protocol the runner drives (workflows/engine/runner.py):

- `upstream`: the steps whose output it reads (a dry run says "after X" while one of them would run);
- `done()`: a detail when its output is up to date (None: it must run); may refuse (WorkflowError);
- `plan()`: what a run would do (a dry run's "would run" detail);
- `run()`: do it; (status, detail), status "ran" or "up to date".

Each step is incremental: a data stage skips the shards whose manifest matches (the stage planner
decides, in a dry run too); a step that writes a command's output (a trained tokenizer, a trained
model) asks that command's record, through the output contract (entroweight.output), as the command
run by hand does; the steps that are no command (the held-out split, the accuracy items, an
evaluation, the tables) skip when the key recorded with their output (their settings and a
fingerprint of their input) is this run's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from entroweight import output
from entroweight.options import setting_changes
from entroweight.pipelines import StageError, run_stage
from entroweight.pipelines.stage import preview_run, read_manifests
from entroweight.pipelines.verify import verify_dir
from entroweight.schemas.tokenizer import TOKENIZER_FILE
from entroweight.trainers.accuracy import ITEMS_FILE
from entroweight.trainers.checkpoint import STATE
from entroweight.trainers.outputs import TRAIN
from entroweight.transforms.train_tokenizer import TRAIN_TOKENIZER, TRAINED_FROM
from entroweight.transforms.writer import sha256_file, write_json_atomic

from ..report.html import read_metrics, write_report
from ..results import STEP_FILE, edited, sealed, step_record, weights_damage

if TYPE_CHECKING:
    from ..spec import Workflow


class WorkflowError(RuntimeError):
    """A step cannot run (refused before its work); the message says what to do. Exit code 2."""


class StepFailed(RuntimeError):
    """A step started and failed (shards failed, verification found problems). Exit code 1."""


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _result(path: Path) -> dict:
    """A step's result (`_record`), or {} where it is not as its step wrote it (`results.edited`): an
    edit by hand, or a result written before seals, is made again."""
    record = step_record(path)
    return {} if edited(record) else record


def _recorded_key(marker: Path) -> str | None:
    return step_record(marker).get("key")


def data_fingerprint(data_dir: Path) -> str:
    """What a model trained on `data_dir` depends on: each shard's output checksum."""
    return _key([(m.shard, m.output_sha256) for m in read_manifests(data_dir)])


@dataclass
class RunContext:
    """What a step knows of the run it belongs to. The runner fills it in and keeps it current; a step
    reads it and never calls back into the runner (steps.py does not import runner.py)."""

    wf: Workflow
    engine: str = "local"
    engine_options: dict = field(default_factory=dict)
    dry_run: bool = False
    overwrite: bool = False
    steps: list[Step] = field(default_factory=list)  # this run's steps so far, in order
    #: writes run.json with the steps so far (the report step reads it)
    write_record: Any = None
    #: the plan of a run about to start here (not a --dry-run, which may plan a GPU cluster's run on a
    #: laptop): the devices it names must be on this machine
    here: bool = False
    #: whether run_dir held its record (run.json) before this run wrote its first one: the report read
    #: it, so a report made before the record was removed is not this run's (the dry run's view too)
    had_record: bool = False

    def tokenizer_file(self) -> str:
        """The tokenizer.json of the run (a directory's file, or a file given as is)."""
        d = self.wf.tokenizer_dir()
        return str(d / TOKENIZER_FILE) if d.is_dir() else str(d)


@dataclass
class Step:
    """One step of a run: what it is, where it writes, and then what happened (run.json's record)."""

    kind: str  # holdout | tokenizer | tokenize | model | score | agreement | train | eval | report
    name: str
    out: Path
    run_ctx: RunContext = field(repr=False)
    upstream: list[tuple[str, str]] = field(default_factory=list)  # the `ref`s of the steps it reads
    status: str = "pending"  # up to date | ran | would run | failed
    #: (dry run) the step would run, but only to write what its records already say it holds (a data
    #: step's shards that went missing): a step that plans from those records alone plans as if it
    #: were up to date
    output_as_recorded = False
    #: whether `done` reads of its upstream's output the records alone (manifests), not its files
    plans_from_records: ClassVar[bool] = False
    timed = True  # "ran" is said with the seconds it took
    # the command whose output `out` is, as its declaration knows its files (entroweight.output) (None: not checked)
    command: ClassVar[str | None] = None
    detail: str = ""
    seconds: float = 0.0
    manifests: list[dict] | None = None

    @property
    def ref(self) -> tuple[str, str]:
        """What names the step among a run's: its kind and name (a train run and its evaluation share
        a name, and a model may be named as a score is)."""
        return self.kind, self.name

    @property
    def wf(self):
        return self.run_ctx.wf

    def prepare(self) -> None:
        """Resolve what the step needs that may be refused (a dry run refuses it too)."""

    def done(self) -> str | None:
        return None

    def plan(self) -> str:
        return ""

    def run(self) -> tuple[str, str]:
        raise NotImplementedError

    def record(self) -> dict:
        d = {"kind": self.kind, "name": self.name, "out": str(self.out), "status": self.status}
        d |= {"detail": self.detail, "seconds": round(self.seconds, 3)}
        if self.manifests is not None:
            d["manifests"] = self.manifests
        return d


def split_holdout(wf: Workflow) -> tuple[list[str], list[str]]:
    """(the documents trained on, the held-out ones): the sources' last `holdout.docs` documents are
    held out. The one rule: the holdout step writes both, the accuracy items read the held-out ones."""
    from entroweight.transforms.train_tokenizer import corpus_texts

    docs = wf.holdout.docs
    texts = list(corpus_texts(list(wf.sources)))
    if len(texts) <= docs:
        raise WorkflowError(f"holdout.docs is {docs}, but the sources hold only {len(texts)} documents")
    return texts[:-docs], texts[-docs:]


class HoldoutStep(Step):
    """Split the sources: the last `docs` documents become the held-out text, never trained on."""

    def key(self) -> str:
        return _key({"sources": list(self.wf.sources), "docs": self.wf.holdout.docs})

    def done(self):
        return str(self.out) if _recorded_key(self.out / STEP_FILE) == self.key() else None

    def plan(self):
        return f"set aside the last {self.wf.holdout.docs} documents"

    def run(self):
        import gzip

        out = self.out
        train, held = split_holdout(self.wf)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "train.jsonl.gz.tmp"
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            for t in train:
                f.write(json.dumps({self.wf.tokenize.text_column: t}) + "\n")
        tmp.replace(out / "train.jsonl.gz")
        (out / "heldout.txt.tmp").write_text("\n\n".join(held), encoding="utf-8")
        (out / "heldout.txt.tmp").replace(out / "heldout.txt")
        record = {"key": self.key(), "train_docs": len(train), "heldout_docs": len(held)}
        write_json_atomic(record, out / STEP_FILE)
        return "ran", f"{len(train)} documents to train on, {len(held)} held out"


class TokenizerStep(Step):
    """A given tokenizer (checked), or one trained on the sources (less the held-out documents) as
    `train-tokenizer` trains it, under that command's contract (entroweight.output): one record, so
    a rerun with the same settings and sources has nothing to do, and one with others is refused
    unless --overwrite (everything downstream depends on the tokenizer), in the plan as in the run."""

    @property
    def command(self) -> str | None:  # type: ignore[override]
        return "train-tokenizer" if self.wf.tokenizer.train is not None else None  # a given one: the user's

    def _reads(self) -> list[tuple[str, str | None]]:
        return [("the source", s) for s in self.wf.train_sources()] + [
            ("tokenizer.train.base", self.wf.tokenizer.train.base)
        ]

    def _made_of(self) -> dict | None:
        from entroweight.transforms.train_tokenizer import trained_from

        t = self.wf.tokenizer.train
        sources = self.wf.train_sources()
        return trained_from(
            sources, t.vocab_size, t.base, t.max_docs, t.algorithm, self.wf.tokenize.text_column
        )

    def done(self):
        spec, out = self.wf.tokenizer, self.out
        if spec.path is not None:
            from entroweight.schemas.tokenizer import resolve_tokenizer_path

            try:
                resolve_tokenizer_path(spec.path)
            except (ValueError, OSError) as e:
                raise WorkflowError(f"tokenizer.path: {e}") from None
            return f"given: {spec.path}"
        if self.wf.holdout is not None and not self.wf.holdout_dir().joinpath("train.jsonl.gz").is_file():
            return None  # (a dry run) its sources are the holdout step's, not written yet
        made_of = self._made_of()
        if made_of is not None and self._taken_as_recorded(made_of):
            return str(out / TOKENIZER_FILE)
        try:
            state = output.standing(
                out, TRAIN_TOKENIZER, made_of, self.run_ctx.overwrite, "a tokenizer", "tokenizer"
            )
        except output.OutputRefused as e:
            raise WorkflowError(f"{e} (everything downstream depends on it)") from None
        return str(out / TOKENIZER_FILE) if state == "same" else None

    def _taken_as_recorded(self, made_of: dict) -> bool:
        """A tokenizer this workflow trained before train-tokenizer kept its record (its step's own
        `.workflow-step.json`, until 2026-12-07), with the settings of now and its file as written: taken
        as it is, its record sealed now (not in a dry run), rather than refused for want of one."""
        legacy = self.out / STEP_FILE
        made = step_record(legacy)
        if not made or (self.out / TRAINED_FROM).exists():
            return False
        key = {"train": self.wf.tokenizer.train.model_dump(mode="json")}
        if self.wf.holdout is not None:
            key["holdout"] = self.wf.holdout.docs
        if made.get("key") != _key(key) or made.get("sha256") != sha256_file(self.out / TOKENIZER_FILE):
            return False
        if not self.run_ctx.dry_run:
            output.seal(self.out, TRAIN_TOKENIZER, made_of)
            legacy.unlink()
        return True

    def plan(self):
        t = self.wf.tokenizer.train
        return f"train a {t.vocab_size}-token {t.algorithm}"

    def run(self):
        from entroweight.transforms.train_tokenizer import corpus_texts, save_tokenizer, train_tokenizer

        t, r = self.wf.tokenizer.train, self.run_ctx
        texts = corpus_texts(self.wf.train_sources(), t.max_docs, self.wf.tokenize.text_column)
        tok = train_tokenizer(texts, t.vocab_size, t.algorithm, t.base)
        with output.writing(
            TRAIN_TOKENIZER, self.out, self._reads(), self._made_of, overwrite=r.overwrite, what="a tokenizer",
            flag="tokenizer", apart=False,
        ) as w:  # fmt: skip
            if w.nothing_to_do:
                return "up to date", str(self.out / TOKENIZER_FILE)
            path, _ = save_tokenizer(tok, w.dest)
        return "ran", f"{tok.get_vocab_size()} tokens -> {self.out / path.name}"


class DataStep(Step):
    """A data stage (tokenize, score): the stage planner says which shards are done; a run verifies
    every shard against its manifest afterwards."""

    timed = False  # the stage's summary line has its own throughput

    @property
    def command(self) -> str:  # type: ignore[override]
        return self.kind  # tokenize, score: the stage's name

    def __init__(self, *args, build, **kw):
        super().__init__(*args, **kw)
        self.build = build  # () -> Stage: built only when its upstream is there

    def stage(self):
        try:
            return self.build()
        except StageError as e:  # refusals that are not ValueErrors (e.g. the data's tokenizer)
            raise WorkflowError(f"{self.kind} {self.name}: {e}") from None

    def done(self):
        if not self.run_ctx.dry_run:
            return None  # a run always goes through the stage: it skips done shards and verifies
        try:  # refused here as the run would refuse it (another config's shards, without --overwrite)
            self._plan, note = preview_run(self.stage(), self.out, self.run_ctx.overwrite)
        except StageError as e:
            raise WorkflowError(f"{self.kind} {self.name}: {e}") from None
        todo, done = len(self._plan.todo), len(self._plan.done)
        self.output_as_recorded = bool(todo) and self._plan.remakes_as_recorded()
        again = " (their output went missing: remade as their manifests record it)"
        self._plan_detail = (
            f"{todo} part(s) of the input to run{again if self.output_as_recorded else ''}, {done} done{note}"
        )
        return None if todo else f"all {done} part(s) of the input done"

    def plan(self):
        return self._plan_detail

    def run(self):
        r = self.run_ctx
        summary = run_stage(
            self.stage(), self.out, engine=r.engine, overwrite=r.overwrite, progress=False, **r.engine_options
        )
        self.manifests = [json.loads(m.model_dump_json()) for m in read_manifests(self.out)]
        problems = verify_dir(self.out)
        if problems:
            self.status = "failed"
            raise StepFailed(
                f"{self.kind} {self.name}: {self.out} failed verification:\n  " + "\n  ".join(problems)
            )
        return ("ran" if summary.shards_run else "up to date"), summary.line() + "; verified"


class TrainStep(Step):
    """A model trained on a data step's output (an estimator, a causal scorer, an experiment run); up
    to date when its finished checkpoint was trained with this config on this data and its weights
    are the file it wrote (`damage`)."""

    command = "train"
    plans_from_records = True  # the data's fingerprint is its manifests' (`made_of`)

    def __init__(self, *args, make_config, nproc: int, **kw):
        super().__init__(*args, **kw)
        self.make_config, self.nproc = make_config, nproc
        self.damage: str | None = None  # why a finished checkpoint is trained again: its weights changed

    def prepare(self):
        from entroweight.models import config_of
        from entroweight.options import device_here

        self.config = self.make_config()  # a TrainError names this step
        config_of(self.config.model, self.config.model_cfg)  # refused before anything trains
        if self.run_ctx.here:  # a CUDA workflow on a machine without one: refused before, not after
            device_here(self.config.device)

    @functools.cached_property
    def made_of(self) -> dict | None:
        """What train records its checkpoint is made of (the contract's made_of, trainers/loop.py), the
        data's fingerprint from its manifests (a shard gone missing is remade as recorded first); asked
        once the step's upstream has run (its plan and its record check alike)."""
        from entroweight.trainers.loop import made_of, manifest_shards

        data = Path(self.config.data[0])
        if not data.is_dir():
            raise WorkflowError(f"{self.kind} {self.name}: no data at {data}")
        try:
            shards = manifest_shards(data)
        except (OSError, ValueError):  # (a manifest that does not parse: refused where it is read)
            return None
        return made_of(self.config, self.nproc, shards)

    def replaced_settings(self) -> list[str]:
        """What changed since the checkpoint in `out` was trained (`train.key: old -> new`), as its
        record says (train's config.json): a spec edited since. [] where it holds none. Known from the
        spec alone, so the plan refuses it before any step runs."""
        held = TRAIN.resumable(self.out)
        now = self.made_of if held is not None else None
        if now is None:
            return []
        # through JSON, as recorded: tuples are lists there
        now = json.loads(json.dumps(now["options"], default=str))
        return setting_changes(held[0]["options"], now, "train.")

    def done(self):
        """The contract's record check (train's `continues`): this very run, at its last step, its
        weights the file it wrote (`weights_damage`)."""
        if output.continues(self.out, TRAIN, lambda: self.made_of) != self.config.steps:
            return None
        self.damage = weights_damage(self.out, step_record(self.out / STATE))
        return None if self.damage else f"finished checkpoint {self.out}"

    def plan(self):
        cfg = self.config
        again = f"; again: {self.damage}" if self.damage else ""
        if changed := self.replaced_settings():  # (with --overwrite: the runner refuses it otherwise)
            again += f"; replaces the checkpoint trained with {', '.join(changed)}"
        return f"{cfg.steps} steps of {cfg.model}, loss {cfg.loss}, seed {cfg.seed}{again}"

    def run(self):
        cfg = self.config
        cfg.overwrite = True  # the run directory is the workflow's: a stale checkpoint is replaced
        if self.nproc > 1:
            torchrun(cfg, self.nproc)
        else:
            from entroweight.trainers import train

            train(cfg)  # a refusal (TrainError, DataError, CheckpointError) is reported by the runner
        ce = (read_metrics(self.out) or [{}])[-1].get("ce", float("nan"))
        return "ran", f"{cfg.steps} steps, ce {ce:.4f}"


def torchrun(cfg, nproc: int) -> None:
    """Multi-GPU training: the same `entroweight train` under torchrun, one process per device,
    handed the run's TrainConfig as a file."""
    config_file = Path(cfg.out) / ".train-config.json"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(cfg.model_copy(update={"quiet": False}).dump(), config_file)
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    args += ["-m", "entroweight.workflows.cli", "train", "--config", str(config_file)]
    if subprocess.run(args).returncode != 0:
        raise StepFailed(f"torchrun training of {cfg.out} failed (see its output above)")


class EvalStep(Step):
    """BPB of a trained run on an evaluation text, cached as JSON keyed by the checkpoint's weights
    and the evaluation's settings."""

    def __init__(self, *args, run_spec, seed: int, text: str, **kw):
        super().__init__(*args, **kw)
        self.run_spec, self.seed, self.text = run_spec, seed, text
        self.ckpt = self.wf.run_ckpt(run_spec.name, seed)

    def _text(self) -> tuple[str | None, int | None]:
        e = self.wf.eval
        if self.text == "main":
            return e.text, e.max_bytes
        return str(self.wf.holdout_dir() / "heldout.txt"), self.wf.holdout.max_bytes

    def key(self) -> str:
        wf = self.wf
        settings = wf.eval.model_dump(mode="json", exclude={"out", "batch_size", "device"})
        if self.text != "main":
            settings |= {"text": self.text, "max_bytes": wf.holdout.max_bytes, "holdout": wf.holdout.docs}
        weights = step_record(self.ckpt / STATE).get("weights_sha256")
        from entroweight.trainers.bpb import BLOCK_BYTES  # a result of other clusters is made again

        return _key({"weights": weights, **settings, "block_bytes": BLOCK_BYTES})

    def done(self):
        if not (self.ckpt / STATE).exists():
            if self.run_ctx.dry_run:
                return None
            raise WorkflowError(f"eval {self.name}: no checkpoint at {self.ckpt}")
        cached = _result(self.out)
        return f"BPB {cached['bpb']:.4f}" if cached.get("key") == self.key() else None

    def plan(self):
        return "BPB"

    def run(self):
        from entroweight.trainers.bpb import eval_bpb

        e, r = self.wf.eval, self.run_spec
        text, max_bytes = self._text()
        res = eval_bpb(self.ckpt, text, e.n_ctx, e.stride, None, max_bytes, e.batch_size, e.device)
        res |= {"key": self.key(), "run": r.name, "seed": self.seed, "loss": r.loss, "data": r.data}
        write_json_atomic(sealed({**res, "checkpoint": str(self.ckpt)}), self.out)
        return "ran", f"BPB {res['bpb']:.4f}"


def check_eval_text(wf: Workflow) -> None:
    """eval.text, read as its steps will read it (there, valid UTF-8, not empty): refused before the
    models it evaluates are trained, not after."""
    from entroweight.trainers.bpb import read_text

    try:
        read_text(wf.eval.text, wf.eval.max_bytes)
    except (OSError, ValueError) as e:
        raise WorkflowError(f"eval.text: {e}") from None


class UnigramStep(Step):
    """The baseline a model must beat: the training tokens' frequencies as the prediction (BPB)."""

    def prepare(self):
        from entroweight.options import device_here

        check_eval_text(self.wf)
        if self.run_ctx.here:  # before the models it evaluates are trained
            device_here(self.wf.eval.device)

    def key(self) -> str:
        e = self.wf.eval
        return _key(
            {"data": data_fingerprint(self.wf.tokens_dir()), "text": e.text, "max_bytes": e.max_bytes}
        )

    def done(self):
        cached = _result(self.out)
        return f"BPB {cached['bpb']:.4f}" if cached.get("key") == self.key() else None

    def plan(self):
        return "unigram baseline"

    def run(self):
        from entroweight.trainers.bpb import unigram_bpb

        e = self.wf.eval
        res = unigram_bpb([str(self.wf.tokens_dir())], self.run_ctx.tokenizer_file(), e.text, e.max_bytes)
        write_json_atomic(sealed({**res, "key": self.key()}), self.out)
        return "ran", f"BPB {res['bpb']:.4f}"


class AgreementStep(Step):
    """The agreement table (`agreement:`): each pair's line and R² over the tokens both scored
    (transforms/agreement.py `compare_dirs`, as `entroweight compare`), cached as JSON keyed by the
    pairs and each score's shards."""

    def _dirs(self) -> dict[str, Path]:
        names = {n for p in self.wf.agreement.pairs for n in (p.y, p.x)}
        return {n: self.wf.score_dir(n) for n in sorted(names)}

    def key(self) -> str:
        spec = self.wf.agreement.model_dump(mode="json", exclude={"out"})
        return _key({"spec": spec, "data": {n: data_fingerprint(d) for n, d in self._dirs().items()}})

    def done(self):
        cached = _result(self.out)
        return str(self.out) if cached.get("key") == self.key() else None

    def plan(self):
        return f"{len(self.wf.agreement.pairs)} pair(s)"

    def run(self):
        from entroweight.transforms.agreement import WRITEUP, AgreementError, compare_dirs

        spec, rows = self.wf.agreement, []
        for pair in spec.pairs:
            try:  # the write-up's "y vs x": y's values on x's
                r = compare_dirs(self.wf.score_dir(pair.x), self.wf.score_dir(pair.y), spec.column)
            except AgreementError as e:
                raise WorkflowError(f"agreement {pair.y} vs {pair.x}: {e}") from None
            row = {"y": pair.y, "x": pair.x, **r}
            if pair.writeup is not None:
                what, m, b, r2 = WRITEUP[pair.writeup]
                row["writeup"] = {"key": pair.writeup, "what": what, "slope": m, "intercept": b, "r2": r2}
            rows.append(row)
        write_json_atomic(sealed({"key": self.key(), "column": spec.column, "pairs": rows}), self.out)
        said = [(r, "undefined" if r["r2"] is None else f"{r['r2']:.4f}") for r in rows]  # None: one value
        return "ran", "; ".join(f"{r['y']} vs {r['x']} R² {r2}" for r, r2 in said)


class TruthStep(Step):
    """The estimator benchmark (`truth:`): each score step's values on the synthetic corpus against its
    truth, with intervals (transforms/agreement.py `truth_table`), cached as JSON keyed by the settings
    and every directory's shards."""

    def _dirs(self) -> dict[str, Path]:
        return {n: self.wf.score_dir(n) for n in self.wf.truth.scores}

    def key(self) -> str:
        spec = self.wf.truth.model_dump(mode="json", exclude={"out"})
        data = {n: data_fingerprint(d) for n, d in self._dirs().items()}
        return _key({"spec": spec, "truth": data_fingerprint(self.wf.synthetic_dir()), "data": data})

    def done(self):
        cached = _result(self.out)
        return str(self.out) if cached.get("key") == self.key() else None

    def plan(self):
        return f"{len(self.wf.truth.scores)} score(s) against the truth"

    def run(self):
        from entroweight.transforms.agreement import AgreementError, truth_table

        t = self.wf.truth
        try:
            table = truth_table(self.wf.synthetic_dir(), self._dirs(), t.resamples, t.seed)
        except AgreementError as e:
            raise WorkflowError(f"truth: {e}") from None
        write_json_atomic(sealed({"key": self.key(), **table}), self.out)
        said = [(r["scorer"], r["entropy"]["spearman"]) for r in table["rows"]]
        return "ran", "Spearman with H: " + "; ".join(
            f"{n} {'undefined' if v is None else f'{v:.3f}'}" for n, v in said
        )


class ExcessStep(Step):
    """A train run at one seed on the held-out synthetic rows: the exact KL(teacher || student) and
    CE − H per token (scorers/teacher.py `excess_of_rows`), cached as JSON keyed by the checkpoint's
    weights and the held-out rows."""

    def __init__(self, *args, run_spec, seed: int, **kw):
        super().__init__(*args, **kw)
        self.run_spec, self.seed = run_spec, seed
        self.ckpt = self.wf.run_ckpt(run_spec.name, seed)

    def key(self) -> str:
        weights = step_record(self.ckpt / STATE).get("weights_sha256")
        return _key({"weights": weights, "heldout": data_fingerprint(self.wf.synthetic_dir(heldout=True))})

    def done(self):
        if not (self.ckpt / STATE).exists():
            if self.run_ctx.dry_run:
                return None
            raise WorkflowError(f"excess {self.name}: no checkpoint at {self.ckpt}")
        cached = _result(self.out)
        return f"KL {cached['kl']:.4f} nats" if cached.get("key") == self.key() else None

    def plan(self):
        return "KL to the teacher on the held-out synthetic rows"

    def run(self):
        from entroweight.scorers.teacher import TeacherError, excess_of_rows

        wf, r = self.wf, self.run_spec
        y, e = wf.synthesize, wf.excess
        try:
            res = excess_of_rows(
                str(wf.synthetic_dir(heldout=True)),
                str(self.ckpt),
                checkpoint=str(wf.model_dir(y.teacher)) if y.teacher else None,
                model=y.model,
                device=e.device,
                batch_size=e.batch_size,
            )
        except TeacherError as err:
            raise WorkflowError(f"excess {self.name}: {err}") from None
        res |= {"key": self.key(), "run": r.name, "seed": self.seed, "loss": r.loss, "data": r.data}
        write_json_atomic(sealed({**res, "checkpoint": str(self.ckpt)}), self.out)
        return "ran", f"KL {res['kl']:.4f} nats, CE − H {res['ce_minus_h']:.4f}"


class ReportStep(Step):
    """The HTML report; rewritten whenever any step ran, or the workflow changed in a way no step
    sees (the seeds or runs it lists, its primary comparison): its key is the whole workflow's."""

    @property
    def marker(self) -> Path:
        return self.out.with_name(f".{self.out.name}.json")

    def key(self) -> str:
        return _key(self.wf.model_dump(mode="json"))

    def done(self):
        ran = any(s.status in ("ran", "would run") for s in self.run_ctx.steps)
        fresh = (
            self.out.exists()
            and not ran
            and self.run_ctx.had_record
            and _recorded_key(self.marker) == self.key()
        )
        return str(self.out) if fresh else None

    def plan(self):
        return str(self.out)

    def run(self):
        self.run_ctx.write_record(0.0)  # the report reads run.json: give it this run's steps
        write_report(
            self.wf.root, self.out, samples=self.wf.report.samples, max_tokens=self.wf.report.max_tokens
        )
        write_json_atomic({"key": self.key()}, self.marker)
        return "ran", str(self.out)


def check_accuracy(spec) -> None:
    """What every accuracy step would refuse, refused before a workflow writes anything (the runner
    calls it first, dry run or not; lm-eval's task index is read once per process): lm-eval not
    installed, a task name it does not know."""
    import importlib.util

    from entroweight.trainers.accuracy import OFFLINE_TASK, AccuracyError, unknown_tasks

    if importlib.util.find_spec("lm_eval") is None:
        raise WorkflowError("accuracy needs lm-eval: pip install 'entroweight[eval]' (make installs it)")
    if any(t != OFFLINE_TASK for t in spec.tasks):  # indexing lm-eval's tasks takes seconds
        try:
            unknown = unknown_tasks(spec.tasks)
        except AccuracyError as e:
            raise WorkflowError(f"accuracy.tasks: {e}") from None
        if unknown:
            raise WorkflowError(
                f"accuracy.tasks: lm-eval knows no task {', '.join(unknown)} (`lm_eval ls tasks`)"
            )


class AccuracyItemsStep(Step):
    """The offline task's items (transforms/choice_items.py) from the held-out documents, built once
    per workflow and kept as `items.jsonl`; up to date when its key (the held-out split, the tokenizer's
    sha256 and the item settings) is this run's and the file is the one it wrote. What every accuracy
    step would refuse (lm-eval missing, an unknown task) the runner refuses first: `check_accuracy`."""

    @property
    def spec(self):
        return self.wf.accuracy

    def prepare(self):
        from entroweight.options import device_here

        if self.run_ctx.here:  # before the runs it evaluates are trained
            device_here(self.spec.device)

    @property
    def offline(self) -> bool:
        from entroweight.trainers.accuracy import OFFLINE_TASK

        return OFFLINE_TASK in self.spec.tasks

    def items_file(self) -> Path | None:
        return self.out / ITEMS_FILE if self.offline else None

    def key(self) -> str:
        a, tok = self.spec, Path(self.run_ctx.tokenizer_file())
        if not tok.is_file():
            return ""  # no tokenizer yet (a dry run): not up to date
        settings = a.model_dump(
            include={"items", "prefix_tokens", "continuation_tokens", "choices", "stride", "seed"}
        )
        hold = {"sources": list(self.wf.sources), "docs": self.wf.holdout.docs}
        return _key(
            {**settings, "holdout": hold, "tokenizer": sha256_file(tok), "n_ctx": self.wf.tokenize.n_ctx}
        )

    def done(self):
        if not self.offline:
            return "no offline task"
        f, marker = self.out / ITEMS_FILE, self.out / STEP_FILE
        if f.is_file() and _recorded_key(marker) == self.key():
            made = step_record(marker)
            if made.get("sha256") == sha256_file(f):  # a file changed since (by hand, a bad disk): rebuilt
                return f"{made['items']} items"
        return None

    def plan(self):
        a = self.spec
        return f"{a.choices}-choice items, {a.prefix_tokens}-token prefixes, {a.continuation_tokens}-token continuations"

    def run(self):
        from tokenizers import Tokenizer

        from entroweight.schemas.tokenizer import text_as_data
        from entroweight.trainers.accuracy import write_items
        from entroweight.transforms.choice_items import ItemError, build_items

        a = self.spec
        _, held = split_holdout(self.wf)
        path = self.run_ctx.tokenizer_file()
        tok = text_as_data(Tokenizer.from_file(path), path)  # as the exported model's tokenizer reads text
        try:
            items = build_items(
                held,
                tok,
                a.prefix_tokens,
                a.continuation_tokens,
                a.choices,
                a.seed,
                a.items,
                self.wf.tokenize.n_ctx,
                a.stride,
            )
        except ItemError as e:
            raise WorkflowError(f"accuracy items: {e}") from None
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / STEP_FILE).unlink(missing_ok=True)
        write_items(items, self.out / ITEMS_FILE)
        docs = len({it["doc"] for it in items})
        made = {
            "key": self.key(),
            "items": len(items),
            "documents": docs,
            "sha256": sha256_file(self.out / ITEMS_FILE),
        }
        write_json_atomic(made, self.out / STEP_FILE)
        return "ran", f"{len(items)} items from {docs} of {len(held)} held-out documents"


class AccuracyStep(Step):
    """lm-eval on one trained run at one seed (trainers/accuracy.py), cached as JSON keyed by the
    checkpoint's weights, the items and the task settings; lm-eval's scratch (the task YAML, HF
    datasets' cache, the temporary HF export) lies under the accuracy directory."""

    WORK = ".lm-eval"

    def __init__(self, *args, run_spec, seed: int, items: AccuracyItemsStep, **kw):
        super().__init__(*args, **kw)
        self.run_spec, self.seed, self.items = run_spec, seed, items
        self.ckpt = self.wf.run_ckpt(run_spec.name, seed)

    def key(self) -> str:
        from importlib.metadata import version

        a = self.wf.accuracy
        weights = step_record(self.ckpt / STATE).get("weights_sha256")
        items = self.items.items_file()
        settings = a.model_dump(mode="json", include={"tasks", "num_fewshot", "limit"})
        return _key(
            {
                "weights": weights,
                "items": sha256_file(items) if items is not None and items.is_file() else None,
                "lm_eval": version("lm_eval"),
                **settings,
            }
        )

    def done(self):
        if not (self.ckpt / STATE).exists():
            if self.run_ctx.dry_run:
                return None
            raise WorkflowError(f"accuracy {self.name}: no checkpoint at {self.ckpt}")
        cached = _result(self.out)
        return headline_metrics(cached) if cached.get("key") == self.key() else None

    def plan(self):
        return "lm-eval: " + ", ".join(self.wf.accuracy.tasks)

    def run(self):
        from entroweight.trainers.accuracy import AccuracyError, evaluate_checkpoint

        a, r = self.wf.accuracy, self.run_spec
        try:
            res = evaluate_checkpoint(
                self.ckpt,
                a.tasks,
                self.wf.accuracy_dir() / self.WORK,
                items_file=self.items.items_file(),
                batch_size=a.batch_size,
                device=a.device,
                num_fewshot=a.num_fewshot,
                limit=a.limit,
            )
        except AccuracyError as e:
            raise WorkflowError(f"accuracy {self.name}: {e}") from None
        items = self.items.items_file()
        res = {"key": self.key(), "run": r.name, "seed": self.seed, "loss": r.loss, "data": r.data, **res}
        # what pairs two results item by item: the same items file
        res["items_sha256"] = sha256_file(items) if items is not None else None
        write_json_atomic(sealed({**res, "checkpoint": str(self.ckpt)}), self.out)
        return "ran", headline_metrics(res)


def headline_metrics(res: dict) -> str:
    """The step's one line: each task's choice metrics (or its first metric)."""
    parts = []
    for task, t in res.get("tasks", {}).items():
        m = t["metrics"]
        shown = [k for k in ("acc", "acc_mutual_info") if k in m] or list(m)[:1]
        parts.append(f"{task} " + ", ".join(f"{k} {m[k]['value']:.3f}" for k in shown) + f" ({t['n']} items)")
    return "; ".join(parts)
