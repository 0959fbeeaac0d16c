"""Run a workflow: holdout -> tokenizer -> tokenize -> models -> scores -> agreement -> experiment
training -> eval (BPB) and accuracy (lm-eval) -> report.

Every step is incremental. Data stages skip shards whose manifest matches their config (the
stage machinery); a trained tokenizer or model skips when its command's record (the output
contract, entroweight.output) says this very output: its settings and its inputs' fingerprints; an
evaluation is cached as JSON keyed by the checkpoint's weights and the eval settings. The run
holds `RUN_DIR/.lock` throughout and records `RUN_DIR/run.json`: the resolved config, the code
version, what each step did and every data stage's manifests.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from entroweight import __version__, output, storage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.stage import LOCK_FILE, LockHeld, has_shards, run_lock
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.pipelines.weigh import WeighStage
from entroweight.trainers.config import LossSettings, TrainSettings
from entroweight.transforms.sources import SourceError, expand_sources, relation_to
from entroweight.transforms.writer import write_bytes_atomic, write_json_atomic

from ..spec import SYNTHETIC, TOKENS, ModelSpec, TrainSpec, Workflow, load_yaml
from .outputs import RUN_FILE, RUN_OUTPUTS, run_outputs
from .steps import (
    AccuracyItemsStep,
    AccuracyStep,
    AgreementStep,
    DataStep,
    EvalStep,
    ExcessStep,
    HoldoutStep,
    ReportStep,
    RunContext,
    Step,
    StepFailed,
    TokenizerStep,
    TrainStep,
    TruthStep,
    UnigramStep,
    WorkflowError,
    check_accuracy,
    data_fingerprint,
)

# the steps others read, by their `Step.ref` (kind, name): a run's data is the tokens or a score step's
TOKENS_STEP, TOKENIZER_STEP, HOLDOUT_STEP = (
    ("tokenize", TOKENS),
    ("tokenizer", "tokenizer"),
    ("holdout", "holdout"),
)
SYNTHETIC_STEP = ("synthesize", SYNTHETIC)


def _as_found(root) -> tuple[Path | None, set[str], set[str]]:
    """What `_put_back` restores: the first directory of `root`'s path the run will make (local; None
    where `root` is there, or on a store, which has no directories), and the files and directories
    `root` holds now (a user's `.gitkeep`)."""
    p = storage.path(root)
    if not storage.is_local(p):
        return None, set(storage.walk(p)), set()
    made = None
    if not p.exists():
        made = p
        while not made.parent.exists():
            made = made.parent
    dirs = {str(d.relative_to(p)) for d in p.rglob("*") if d.is_dir()} if p.is_dir() else set()
    return made, set(storage.walk(p)), dirs


def _put_back(root, found: tuple[Path | None, set[str], set[str]]) -> None:
    """Remove what a run that could not start wrote (`_as_found`): the directories it made, or the
    files and directories that were not in `root` before (its record, its lock, a step's temp files)."""
    made, files, dirs = found
    if made is not None:
        storage.remove_tree(made)
        return
    p = storage.path(root)
    for rel in set(storage.walk(p)) - files:
        storage.remove(p / rel)
    if storage.is_local(p):
        for d in sorted((d for d in p.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
            if str(d.relative_to(p)) not in dirs:
                shutil.rmtree(d, ignore_errors=True)


def data_step(name: str) -> tuple[str, str]:
    """The step that writes the data a workflow names `name`: the tokens, the synthetic corpus, or a
    score step's."""
    if name == SYNTHETIC:
        return SYNTHETIC_STEP
    return TOKENS_STEP if name == TOKENS else ("score", name)


__all__ = [
    "RUN_FILE",
    "Runner",
    "StepFailed",
    "WorkflowError",
    "code_version",
    "data_fingerprint",
]


@functools.cache
def code_version() -> str:
    """The package version, plus `git describe` of the checkout when it is one."""
    repo = Path(__file__).resolve().parents[2]  # workflows/engine/ -> the checkout
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty", "--tags"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # outside a checkout git says "fatal: not a git repository"
            text=True,
            timeout=5,
        )
        if out.returncode == 0 and out.stdout.strip():
            return f"{__version__}+git.{out.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    return __version__


class Runner:
    """Runs a workflow's steps in order, each through the step protocol (workflows/engine/steps.py): a dry
    run asks each step what it would do and writes nothing; a run holds the run directory's lock."""

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
        # what the steps see of this run (they never call back into the runner)
        self.ctx = RunContext(wf, engine, self.engine_options, dry_run, overwrite, [], self.write_record)
        self.steps: list[Step] = self.ctx.steps
        self.outputs: list[str] = []  # the names the steps write directly in run_dir (run.json's)
        self.started = False  # whether run.json marks this run yet (`_start_record`)
        # the steps (Step.ref) that would run (dry run: what reads them must wait)
        self.stale: set[tuple[str, str]] = set()
        # ... and those that would run only to remake what their records hold (`Step.output_as_recorded`)
        self.remade: set[tuple[str, str]] = set()

    # -- the whole run
    def run(self) -> list[Step]:
        root = self.wf.root
        self._check_sources_apart()
        notes: list[str] = []
        try:  # listings only, no file opened: a missing source is refused by the dry run as well
            expand_sources(list(self.wf.sources), notes)
        except SourceError as e:
            raise WorkflowError(f"sources: {e}") from None
        for note in notes:
            self.echo(f"note: {note}")
        if self.wf.train is not None and self.wf.accuracy is not None:
            check_accuracy(self.wf.accuracy)  # before any step writes (its step would, after hours)
        self._check_run_dir()
        self.ctx.had_record = (storage.path(root) / RUN_FILE).exists()
        if self.dry_run:
            try:  # a run holds it now: the run would exit 3 (asked as every command asks it)
                storage.wait_unheld(root)
            except storage.OutputHeld as e:
                raise LockHeld(str(e)) from None
            self.echo(f"plan for {root} (dry run: nothing is written)")
            self._all_steps()
            self._say_left_behind(self.steps)
            n = sum(s.status == "would run" for s in self.steps)
            self.echo(
                f"{n} of {len(self.steps)} step(s) would run"
                if n
                else "nothing to do: all steps are up to date"
            )
            return self.steps
        # every refusal a dry run gives, given before the lock is taken or anything is written: a
        # step refused half way would leave the steps before it redone for a run that cannot finish
        plan = Runner(self.wf, self.engine, self.engine_options, True, self.overwrite, echo=lambda _: None)
        plan.ctx.here = True  # ... and the devices it names are on this machine
        plan.ctx.had_record = self.ctx.had_record
        plan._all_steps()
        self._say_left_behind(plan.steps)
        # what earlier runs here wrote too (a step since removed from the workflow left its output)
        self.outputs = sorted(
            set(_names_in(root, [s.out for s in plan.steps])) | set(run_outputs(root) or [])
        )
        found = _as_found(root)  # what a run that could not start puts back
        lock = run_lock(root, self.wait)  # LockHeld -> exit 3
        start = time.perf_counter()
        gone = False
        as_is = self._recorded_as_is()  # (bytes, times) of a finished run's record of this workflow
        if as_is is None:
            self._start_record()  # a run killed part way is still known as a workflow run
        try:
            self._all_steps()
        except WorkflowError:  # refused by a step's own work (what no plan can see: a count of documents)
            gone = not self.ctx.had_record and not any(s.status == "ran" for s in self.steps)
            raise
        finally:
            if not gone:
                self._end_record(as_is, time.perf_counter() - start)
            lock.release()
            if gone:  # a run that could not start leaves run_dir as it found it
                _put_back(root, found)
        ran = [s for s in self.steps if s.status == "ran"]
        if not ran:
            self.echo(f"nothing to do: all {len(self.steps)} step(s) of {root} are up to date")
        else:
            self.echo(f"done: {len(ran)} step(s) ran in {time.perf_counter() - start:.1f} s -> {root}")
        return self.steps

    def _say_left_behind(self, steps: list[Step]) -> None:
        """Say what earlier runs left in run_dir that no step writes now (`left_behind`): kept (it may
        be wanted), but the report and the experiment's tables leave it out."""
        if old := left_behind(self.wf.root, [s.out for s in steps], run_outputs(self.wf.root) or []):
            self.echo(
                f"note: {len(old)} output(s) in {self.wf.root} that no step of this workflow writes (an "
                "earlier run's, renamed or removed since; kept, and left out of the report): "
                f"{storage.some_of(old, 5)}"
            )

    def _check_sources_apart(self) -> None:
        """No source is, holds, lies inside run_dir or may match a file in it: the run writes there (a
        held-out split's train.jsonl.gz, a tokenizer) and removes what it made (--overwrite, a run that
        could not start), so it would read its own output as documents or delete the documents."""
        for where, src in [
            (f"sources[{i}]", s) for i, s in enumerate(self.wf.sources)
        ] + self._local_inputs():
            how = relation_to(self.wf.root, src)
            if how:
                how += "" if how.endswith("match") else " it"  # a glob: "holds files it may match"
                raise WorkflowError(
                    f"{where} {src}: run_dir {self.wf.root} {how}, and a run writes and removes files "
                    "in run_dir: keep what the run reads outside run_dir, or give another run_dir"
                )

    def _local_inputs(self) -> list[tuple[str, str]]:
        """(key, path) of every other file or directory on this machine the run reads: a tokenizer, a
        model config, a scorer's model or reference given as a path (a hub id is none: only paths
        that exist are taken)."""
        wf, found = self.wf, []
        if wf.tokenizer.path:
            found.append(("tokenizer.path", wf.tokenizer.path))
        for i, m in enumerate(wf.models):
            found.append((f"models[{i}].model_config", m.model_config_file))
        if wf.train is not None:
            found.append(("train.model_config", wf.train.model_config_file))
        for i, sc in enumerate(wf.scores):
            for k in ("model", "reference", "checkpoint"):
                found.append((f"scores[{i}].options.{k}", sc.options.get(k)))
        return [(k, str(p)) for k, p in found if isinstance(p, str) and p and Path(p).exists()]

    def _check_run_dir(self) -> None:
        """run_dir is new, empty, or a workflow run's (run.json, or the lock of one killed before its
        record): the steps would write among another directory's files, and its stages would then
        refuse them (a data step's output holding a user's file) on every rerun."""
        try:
            # a run_dir inside another output (a run's, a step's) would mix into what that one reads
            storage.check_place(self.wf.root, "run_dir")
            output.check_apart(self.wf.root, "run_dir")
            owner = output.output_owner(self.wf.root)
        except storage.OutputRefused as e:
            msg = str(e)
            raise WorkflowError(msg if msg.startswith("run_dir") else f"run_dir: {msg}") from None
        if owner not in (None, "run"):  # a stage's shards hold a lock too: not one of a run's
            raise WorkflowError(
                f"run_dir {self.wf.root} holds the output of {output.named(owner)}, not a workflow run's: "
                "give a new or empty run_dir"
            )
        marks = storage.listing(self.wf.root)
        names = [] if owner or LOCK_FILE in marks else output.foreign_files(self.wf.root, None, "run")
        if names:
            raise WorkflowError(
                f"run_dir {self.wf.root} holds files that are not a workflow run's ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}): give a new or empty run_dir"
            )

    def _all_steps(self) -> None:
        try:
            for step in self._each_step():
                self._do(step)
        except (
            ValueError
        ) as e:  # input refused below (SourceError, TokenizerError, ScorerError, TrainError...)
            step = self.steps[-1] if self.steps else None
            if step is None:
                raise WorkflowError(str(e)) from None
            step.status = "failed"
            raise WorkflowError(f"{step.kind} {step.name}: {e}") from None

    def _do(self, step: Step) -> None:
        """One step through the protocol; the dry run is decided here, once for every kind."""
        self.steps.append(step)
        step.prepare()
        self._refuse_users_files(step)
        self._refuse_retraining(step)
        waiting = [
            u for u in step.upstream if u in self.stale or (u in self.remade and not step.plans_from_records)
        ]
        if self.dry_run and waiting:
            self._refuse_redoing(step, waiting)
            self.stale.add(step.ref)
            return self._say(step, "would run", f"after {', '.join(name for _, name in waiting)}")
        detail = step.done()
        if detail is not None:
            return self._say(step, "up to date", detail)
        if self.dry_run:
            (self.remade if step.output_as_recorded else self.stale).add(step.ref)
            return self._say(step, "would run", step.plan())
        if not self.started:  # the record as found says a finished run: no longer, from here
            self._start_record()
        t0 = time.perf_counter()
        status, detail = step.run()
        step.seconds = time.perf_counter() - t0
        timed = f" ({step.seconds:.1f} s)" if status == "ran" and step.timed else ""
        self._say(step, status, detail + timed)

    def _refuse_redoing(self, step: Step, waiting: list[str]) -> None:
        """A data step whose output holds shards, downstream of a model or tokenizer this run will
        (re)train, would be made again from the new one: its stage would refuse the old shards after
        the training it waited for. Refused now instead, unless --overwrite (which redoes it). So is a
        command's `kept` output (a trained tokenizer) made from what a step this run will redo (the
        held-out split): its inputs would change, and what was made with it depends on it."""
        declared = output.declaration(step.command) if step.command else None
        if (
            declared is not None
            and declared.kept
            and not self.overwrite
            and declared.holds_its_files(step.out)
        ):
            raise WorkflowError(
                f"{step.kind} {step.name}: {step.out} holds the output of `{step.command}` made from what "
                f"{' and '.join(name for _, name in waiting)} would make again this run, and what was made "
                "with it depends on it: pass --overwrite to redo it (and what depends on it), or use another run_dir"
            )
        steps = {s.ref: s for s in self.steps}
        replaced = [u for u in waiting if u in steps and steps[u].kind in ("model", "tokenizer")]
        if not replaced or self.overwrite or not isinstance(step, DataStep) or not has_shards(step.out):
            return
        damaged = [f"{u[1]}: {steps[u].damage}" for u in replaced if getattr(steps[u], "damage", None)]
        raise WorkflowError(
            f"{step.kind} {step.name}: {step.out} holds output made with the {' and '.join(name for _, name in replaced)} this run "
            f"would train again ({'; '.join(damaged) or 'its settings or data changed'}), so it would be made "
            "again; pass --overwrite to redo it, or use another run_dir"
        )

    def _refuse_users_files(self, step: Step) -> None:
        """A step's output holding files no command wrote (a user's notes) is refused in the plan, by
        the dry run as by the run: the stage's verification failed on it after the run (exit 1, on
        every rerun), and --overwrite would remove it. The rule of every command's `--out`
        (`output.foreign_files`)."""
        if step.command is None or not step.out.is_dir():
            return
        try:
            theirs = output.foreign_files(step.out, output.output_owner(step.out), step.command)
        except storage.OutputRefused as e:
            raise WorkflowError(f"{step.kind} {step.name}: {e}") from None
        if theirs:
            shown = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
            raise WorkflowError(
                f"{step.kind} {step.name}: {step.out} holds files no command wrote ({shown}), which the "
                "step would write among or remove: move them out of the run directory first"
            )

    def _refuse_retraining(self, step: Step) -> None:
        """A finished checkpoint whose step's settings were edited since would be trained again and
        replaced: refused unless --overwrite, as a data step's output of another config is (the plan
        gives it, before any step runs)."""
        changed = step.replaced_settings() if isinstance(step, TrainStep) and not self.overwrite else []
        if changed:
            raise WorkflowError(
                f"{step.kind} {step.name}: {step.out} holds a checkpoint trained with other settings "
                f"({'; '.join(changed)}); pass --overwrite to train it again (it is replaced), or use "
                "another run_dir"
            )

    def _say(self, step: Step, status: str, detail: str) -> None:
        step.status, step.detail = status, detail
        self.echo(f"{step.kind} {step.name}: {status}{' - ' + detail if detail else ''}")

    def _each_step(self) -> Iterator[Step]:
        """The workflow's steps in order; each is built when the previous ones have run."""
        wf = self.wf
        if wf.holdout is not None:
            yield HoldoutStep(*HOLDOUT_STEP, wf.holdout_dir(), self.ctx)
        yield TokenizerStep(
            *TOKENIZER_STEP, wf.tokenizer_dir(), self.ctx, [HOLDOUT_STEP] if wf.holdout else []
        )
        yield self._tokenize()
        # the models of the tokens (a teacher among them), the synthetic corpus, the models of it
        for data in (TOKENS, SYNTHETIC):
            if data == SYNTHETIC and wf.synthesize is not None:
                yield self._synthesize(heldout=False)
                if wf.synthesize.heldout:
                    yield self._synthesize(heldout=True)
            for m in (m for m in wf.models if m.data == data):
                out = wf.model_dir(m.name)
                config = functools.partial(
                    self._train_config, m, wf.data_dir(data), out, loss=m.loss, seed=m.seed
                )
                upstream = [data_step(data)]
                yield TrainStep("model", m.name, out, self.ctx, upstream, make_config=config, nproc=m.nproc)
        for s in wf.scores:
            yield self._score(s)
        if wf.truth is not None:
            upstream = [SYNTHETIC_STEP, *(data_step(n) for n in wf.truth.scores)]
            yield TruthStep("truth", "truth", wf.root / wf.truth.out, self.ctx, upstream)
        if wf.agreement is not None:
            pairs = [n for p in wf.agreement.pairs for n in (p.y, p.x)]
            out = wf.root / wf.agreement.out
            yield AgreementStep(
                "agreement", "agreement", out, self.ctx, [data_step(n) for n in dict.fromkeys(pairs)]
            )
        if wf.train:
            t = wf.train
            if wf.eval:
                yield UnigramStep(
                    "eval", "unigram", wf.root / wf.eval.out / "unigram.json", self.ctx, [TOKENS_STEP]
                )
            items = None
            if wf.accuracy:
                out = wf.accuracy_items_dir()
                items = AccuracyItemsStep(
                    "accuracy", "heldout-items", out, self.ctx, [TOKENIZER_STEP, HOLDOUT_STEP]
                )
                yield items
            # seed by seed, each run evaluated once trained: a run stopped part way has every run at
            # the same number of seeds, and those are complete
            for seed in t.seeds:
                for r in t.runs:
                    name, out = f"{r.name}/seed-{seed}", wf.run_ckpt(r.name, seed)
                    loss = r.model_dump(include=set(LossSettings.model_fields))
                    config = functools.partial(
                        self._train_config, t, wf.data_dir(r.data), out, seed=seed, **loss
                    )
                    yield TrainStep(
                        "train", name, out, self.ctx, [data_step(r.data)], make_config=config, nproc=t.nproc
                    )
                    for text in wf.eval_texts() if wf.eval else ():
                        label = "" if text == "main" else f" ({text})"
                        yield EvalStep(
                            "eval",
                            name + label,
                            wf.eval_file(r.name, seed, text),
                            self.ctx,
                            [("train", name)],
                            run_spec=r,
                            seed=seed,
                            text=text,
                        )
                    if wf.excess is not None:
                        yield ExcessStep(
                            "excess",
                            name,
                            wf.excess_file(r.name, seed),
                            self.ctx,
                            [("train", name), ("synthesize", "heldout")],
                            run_spec=r,
                            seed=seed,
                        )
                    if items is not None:
                        out = wf.accuracy_file(r.name, seed)
                        yield AccuracyStep(
                            "accuracy",
                            name,
                            out,
                            self.ctx,
                            [("train", name), items.ref],
                            run_spec=r,
                            seed=seed,
                            items=items,
                        )
        if wf.report is not None:
            yield ReportStep("report", "report", wf.root / wf.report.out, self.ctx)

    def _start_record(self) -> None:
        self.write_record(0.0)
        self.started = True

    def _recorded_as_is(self) -> tuple[bytes, int, int] | None:
        """run.json's bytes and times where it records this workflow as it is now (its file, config,
        outputs and code), written at the end of a run (its seconds: the record a run writes before
        its first step that runs, or for its report, has 0); else None. A run in which every step
        is up to date puts it back as it was: one killed after a step ran leaves its start record,
        which the next run replaces."""
        path = self.wf.root / RUN_FILE
        old = storage.json_record(path)
        if not (
            old is not None
            and bool(old.get("seconds"))
            and old.get("workflow_file") == self.workflow_file
            and old.get("config") == self.wf.model_dump(mode="json", by_alias=True)
            and old.get(RUN_OUTPUTS) == self.outputs
            and old.get("code_version") == code_version()
        ):
            return None
        st = path.stat()
        return path.read_bytes(), st.st_atime_ns, st.st_mtime_ns

    def _end_record(self, as_is: tuple[bytes, int, int] | None, seconds: float) -> None:
        """run.json at the end of a run: this run's, or, where every step was up to date, put back as
        the run that made every output wrote it (where a step ran that found nothing to do, a stage's
        own "up to date", the start record written before it is undone)."""
        if as_is is None or any(s.status != "up to date" for s in self.steps):
            if self.started:
                self.write_record(seconds)
            return
        if self.started:
            data, atime_ns, mtime_ns = as_is
            path = self.wf.root / RUN_FILE
            write_bytes_atomic(data, path)
            os.utime(path, ns=(atime_ns, mtime_ns))

    def write_record(self, seconds: float) -> None:
        record = {
            "workflow_file": self.workflow_file,
            "config": self.wf.model_dump(mode="json", by_alias=True),
            "code_version": code_version(),
            "engine": self.engine,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(seconds, 3),
            "python": sys.version.split()[0],
            "steps": [s.record() for s in self.steps],
            # a user's file in run_dir is told apart by these: no command's --overwrite removes it
            RUN_OUTPUTS: self.outputs,
        }
        write_json_atomic(record, self.wf.root / RUN_FILE)

    # -- the data stages
    def _tokenize(self) -> DataStep:
        t, wf = self.wf.tokenize, self.wf

        def build():
            return TokenizeStage(
                wf.train_sources(),
                self.ctx.tokenizer_file(),
                t.n_ctx,
                t.pack,
                t.shard_docs,
                t.text_column,
                t.reject_duplicates,
                t.overflow,
            )

        return DataStep(*TOKENS_STEP, wf.tokens_dir(), self.ctx, [TOKENIZER_STEP, HOLDOUT_STEP], build=build)

    def _synthesize(self, heldout: bool) -> DataStep:
        from entroweight.pipelines.synthesize import SynthesizeStage
        from entroweight.transforms.weigh import WeighConfig

        wf, y = self.wf, self.wf.synthesize
        upstream = [("model", y.teacher)] if y.teacher else []

        def build():
            return SynthesizeStage(
                sequences=y.heldout if heldout else y.sequences,
                n_ctx=y.n_ctx or wf.tokenize.n_ctx,
                checkpoint=str(wf.model_dir(y.teacher)) if y.teacher else None,
                model=y.model,
                temperature=y.temperature,
                seed=y.heldout_seed if heldout else y.seed,
                shard_docs=y.shard_docs,
                weighting=WeighConfig(**y.weighting.model_dump()),
                device=y.device,
                dtype=y.dtype,
                batch_size=y.batch_size,
            )

        name = "heldout" if heldout else SYNTHETIC
        out = wf.synthetic_dir(heldout)
        return DataStep("synthesize", name, out, self.ctx, upstream, build=build)

    def _score(self, s) -> DataStep:
        from entroweight.transforms.select import document_steps
        from entroweight.transforms.weigh import WeighConfig

        from ..quantiles import reference_quantiles, scorer_unit, values_unit

        wf = self.wf
        sources = s.sources()
        upstream = [data_step(s.data), *(data_step(x) for x in sources)]
        upstream += [("model", s.checkpoint_from)] if s.checkpoint_from else []
        upstream += [("score", s.weighting.quantiles_from)] if s.weighting.quantiles_from else []

        def build():
            from entroweight.transforms.derive import derived_unit

            w = s.weighting
            quantiles = None
            if w.quantiles_from:  # in the unit of the values this step weighs, else refused
                if len(sources) == 2:
                    unit = derived_unit(s.op, *(values_unit(wf.score_dir(x)) for x in sources))
                elif sources:
                    unit = values_unit(wf.score_dir(sources[0]))
                else:
                    unit = scorer_unit(s.scorer, dict(s.options))
                quantiles = reference_quantiles(wf.score_dir(w.quantiles_from), unit, "quantiles_from")
            weigh = WeighConfig(**w.model_dump(exclude={"quantiles_from"}), quantiles=quantiles)
            steps = document_steps(s.min_mean_weight)  # as the commands' flag
            if sources:  # earlier steps' values, weighed anew (or combined first): no second scoring
                combine = (s.op, wf.score_dir(sources[1])) if len(sources) == 2 else None
                return WeighStage(
                    wf.score_dir(sources[0]), weigh, s.with_entropy, combine=combine, steps=steps
                )
            options = dict(s.options)  # validated with the spec (the scorer's Options model)
            if s.checkpoint_from:
                options["checkpoint"] = str(wf.model_dir(s.checkpoint_from))
            return ScoreStage(
                wf.data_dir(s.data),
                s.scorer,
                options,
                weigh,
                s.with_entropy,
                self._tokenizer_of(wf.data_dir(s.data)),
                limit=s.limit_shards,
                rows=s.limit_rows,
                steps=steps,
            )

        return DataStep("score", s.name, wf.score_dir(s.name), self.ctx, upstream, build=build)

    def _tokenizer_of(self, data: Path) -> str:
        """The tokenizer of a data directory the run made: the run's, but for a corpus drawn from an HF
        teacher (`synthesize.model`), which is in the teacher's own, carried beside its shards."""
        from entroweight.transforms.tokenizer import CARRIED_TOKENIZER

        y = self.wf.synthesize
        if (
            y is not None
            and y.model is not None
            and data in (self.wf.synthetic_dir(), self.wf.synthetic_dir(True))
        ):
            return str(data / CARRIED_TOKENIZER)
        return self.ctx.tokenizer_file()

    # -- training
    def _train_config(self, spec: ModelSpec | TrainSpec, data: Path, out: Path, **kw):
        """The TrainConfig of a model or experiment run: the workflow's knobs, its model config file
        with the inline fields over it, the run's loss and seed."""
        from entroweight.trainers import TrainConfig

        model_config, cfg_file = {}, spec.model_config_file
        if cfg_file:
            try:
                model_config = load_yaml(Path(cfg_file)) or {}  # as the workflow: duplicate keys refused
            except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
                raise WorkflowError(
                    f"cannot read model config {cfg_file}: {' '.join(str(e).split())}"
                ) from None
            if not isinstance(model_config, dict):
                raise WorkflowError(f"model config {cfg_file} must hold a mapping of model fields")
        return TrainConfig(
            data=[str(data)],
            out=str(out),
            model=spec.kind,
            model_config={**model_config, **spec.config},
            tokenizer=self._tokenizer_of(data),
            quiet=True,
            **spec.model_dump(include=set(TrainSettings.model_fields)),
            **kw,
        )


def left_behind(root: Path, outs: list[Path], recorded: list[str] = ()) -> list[str]:
    """What earlier runs wrote in `root` that no step of this workflow writes (a train run, a seed, a
    score step renamed or removed since, or every step of a kind), relative to `root`: the names in
    `root` they recorded (`recorded`, run.json's `outputs`) that no step writes in or under, and the
    entries of each directory below `root` that holds a step's output that are no step's output and
    hold none. Hidden names and temporary files are bookkeeping, not outputs."""
    root = Path(root)
    outs = {Path(p) for p in outs if Path(p).is_relative_to(root) and Path(p) != root}
    holders = {a for p in outs for a in p.parents if a.is_relative_to(root) and a != root}
    known = outs | holders
    found = [n for n in sorted(recorded) if root / n not in known and (root / n).exists()]
    for d in sorted(holders):
        for entry in sorted(d.iterdir()) if d.is_dir() else ():
            hidden = entry.name.startswith(".") or storage.TMP_MARK in entry.name
            if not hidden and entry not in known:
                found.append(str(entry.relative_to(root)))
    return found


def _names_in(root: Path, outs: list[Path]) -> list[str]:
    """The names directly in `root` that the paths `outs` are or lie under (those outside it: none)."""
    return sorted(
        {p.relative_to(root).parts[0] for p in map(Path, outs) if p.is_relative_to(root) and p != root}
    )
