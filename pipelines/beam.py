"""The Beam engine: shards as elements of a real Beam pipeline, on any runner.

    Create([tasks file]) | FlatMap(its lines) | Reshuffle | ParDo(RunShard)

`RunShard.setup()` calls `stage.setup()` once per worker (the tokenizer or model stays loaded
across shards), `process` calls `run_task`, which never raises: a failing shard becomes a failed
ShardResult, so one bad input file cannot abort the other shards. Every result (errors included)
is written, one small file per shard, to this run's own directory, which the driver reads back
after the run, so it knows each shard's outcome on every runner (Dataflow workers cannot call
back). The tasks go in through a file too, not as elements of `beam.Create`: 100k shards pickled
into the pipeline graph would pass Dataflow's job-request size limit. Both files go through
entroweight.storage, so a run on gs:// or s3:// needs no mount and no Beam filesystem plugin.

Embedded default: the in-process Python FnApiRunner (the DirectRunner may try to download the
Prism binary, which fails offline); `workers > 1` runs it as that many SDK worker processes.
Any other runner comes from the options: {"runner": "DataflowRunner", "project": ..., ...}.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import threading
import uuid
from dataclasses import asdict

from entroweight import storage
from entroweight.schemas.manifest import ShardInput

from .stage import (
    EngineOption,
    RunPlan,
    ShardResult,
    ShardTask,
    Shuffle,
    Stage,
    manifest_name,
    reconcile_results,
    run_task,
)

OPTIONS = {
    "options": EngineOption(
        "--beam-option",
        dict,
        None,
        "Beam pipeline option, e.g. runner=DataflowRunner (repeatable). Default: in-process FnApiRunner.",
    ),
    "workers": EngineOption(
        "--workers",
        int,
        None,
        "SDK worker processes (embedded: direct_num_workers), or the runner's own "
        "(Dataflow max_num_workers, Flink parallelism).",
    ),
}

# per-run directories under the output directory (or temp_location), each deleted by its own run;
# hidden: datasets skips it
RESULTS_DIR = ".engine"
EMBEDDED = ("fnapirunner", "fnapi", "embedded")


def _import_beam():
    """Import Beam without its warning that the optional GCP clients are absent (they are not needed)."""

    def no_gcp_noise(record: logging.LogRecord) -> bool:
        return "apitools not found" not in record.getMessage()

    root = logging.getLogger()
    root.addFilter(no_gcp_noise)
    try:
        import apache_beam
    finally:
        root.removeFilter(no_gcp_noise)
    return apache_beam


def _dofn():
    """The DoFn class, built on first use so that importing this module does not import Beam."""
    beam = _import_beam()

    from apache_beam.utils import shared

    class RunShardFn(beam.DoFn):
        def __init__(self, stage: Stage, threads: int | None):
            self.stage = stage
            self.threads = threads
            # one loaded stage (one model copy) per worker process, whatever the DoFn threads there:
            # the mechanism RunInference uses for large models
            self._shared = shared.Shared()

        def setup(self):
            if self.threads:
                _limit_threads(self.threads)
            self.stage = self._shared.acquire(self._loaded)

        def _loaded(self) -> Stage:
            self.stage.setup()
            return self.stage

        def process(self, element):
            line, results = element
            try:
                result = run_task(self.stage, task_from_json(line))
            except KeyboardInterrupt as e:  # Beam turns it into a RuntimeError: kept for `run` to raise
                from entroweight.pipelines import beam  # this module itself: the DoFn is pickled by value

                beam._STOPS.append(e)
                raise
            storage.write_json_atomic(asdict(result), f"{results}/{result.shard}.json")
            yield result.shard

    return RunShardFn


def _limit_threads(threads: int) -> None:
    """N worker processes on one machine: each gets its share of the cores, not all of them."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(threads)


def build_runner(options: dict, workers: int | None):
    """(runner, PipelineOptions, threads per worker or None) from the user's KEY=VALUE options."""
    _import_beam()
    from apache_beam.options.pipeline_options import PipelineOptions

    opts = {k.replace("-", "_"): v for k, v in (options or {}).items()}
    name = str(opts.pop("runner", "FnApiRunner"))
    threads = None
    if name.lower() in EMBEDDED:
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        n = int(opts.get("direct_num_workers") or workers or 1)
        if n > 1:
            opts.setdefault("direct_num_workers", n)
            opts.setdefault("direct_running_mode", "multi_processing")
            opts.setdefault("default_sdk_harness_log_level", "WARNING")
            if opts["direct_running_mode"] == "multi_processing":
                threads = max(1, (os.cpu_count() or 1) // n)
        else:
            opts.setdefault("direct_running_mode", "in_memory")
        runner = FnApiRunner()
    else:
        from apache_beam.runners.runner import create_runner

        if workers:  # the runner's own name for "how many workers"
            key = {"dataflowrunner": "max_num_workers", "flinkrunner": "parallelism"}.get(
                name.lower().split(".")[-1], "direct_num_workers"
            )
            opts.setdefault(key, workers)
        runner = create_runner(name)
    return runner, PipelineOptions.from_dictionary(opts), threads


# the resource hint of a stage that needs a GPU (Dataflow's syntax; `--engine-option accelerator=...`)
DEFAULT_ACCELERATOR = "type:nvidia-l4;count:1;install-nvidia-driver"


def with_hints(transform, stage: Stage, accelerator: str):
    """The shard transform with a hint requesting one accelerator when the stage runs on one."""
    if stage.resources().get("num_gpus"):
        return transform.with_resource_hints(accelerator=accelerator)
    return transform


def results_root(out_dir, options: dict) -> str:
    """Where workers write results: the run's temp_location if given (gs://...), else the output dir."""
    temp = (options or {}).get("temp_location") or (options or {}).get("temp-location")
    base = temp.rstrip("/") if temp else storage.key(out_dir)
    return f"{base}/{RESULTS_DIR}"


def _read_lines(element):
    """The tasks file's lines, paired with where their results go (a worker reads it from the store)."""
    tasks_file, results = element
    for line in storage.path(tasks_file).read_bytes().decode().splitlines():
        if line:
            yield line, results


# a stop (Ctrl-C, or SIGTERM as the CLI raises it) inside a DoFn this process ran (the in-memory
# runner runs them on the main thread, where signals arrive), raised again as itself by `run`
_STOPS: list[BaseException] = []


class _NotAStop(logging.Filter):
    """Beam logs a DoFn's exception with its traceback before it raises it again; a stop is no error
    (the command says in one line what stays)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt))


NOT_A_STOP = _NotAStop()  # one instance: addFilter keeps a filter once


def run(
    plan: RunPlan, options: dict | None = None, workers: int | None = None, progress: bool = True
) -> list[ShardResult]:
    beam = _import_beam()
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    _quiet_beam()
    options = dict(options or {})
    accelerator = options.pop("accelerator", DEFAULT_ACCELERATOR)
    runner, pipeline_options, threads = build_runner(options, workers)
    root = results_root(plan.out_dir, options)
    in_out = root == f"{storage.key(plan.out_dir)}/{RESULTS_DIR}"  # --out's own, under the driver's lock
    if in_out:
        storage.remove_tree(root)  # a killed run's leftovers
    # this run's own directory: a temp_location shared by other runs is never listed or cleared
    run_dir = f"{root}/beam-{uuid.uuid4().hex}"
    results, tasks_file = f"{run_dir}/results", f"{run_dir}/tasks.jsonl"
    tasks = list(plan.todo)
    storage.write_text_atomic("".join(task_to_json(t) + "\n" for t in tasks), tasks_file)
    if progress:  # the runner reports nothing until the end: say what started where
        mode = pipeline_options.get_all_options().get("direct_running_mode")
        where = type(runner).__name__ + (f" ({mode})" if isinstance(runner, FnApiRunner) else "")
        print(f"{plan.stage.name}: {len(tasks)} shard(s) on Beam {where}", file=sys.stderr, flush=True)
    error, stop = None, None
    _STOPS.clear()
    quiet = _filtered_stderr() if threads else contextlib.nullcontext()  # threads: worker processes
    try:
        with quiet, _progress(plan, progress), beam.Pipeline(runner=runner, options=pipeline_options) as p:
            _ = (
                p
                | "TasksFile" >> beam.Create([(tasks_file, results)])
                | "Shards" >> beam.FlatMap(_read_lines)
                | "Spread" >> beam.Reshuffle()
                | "RunShard" >> with_hints(beam.ParDo(_dofn()(plan.stage, threads)), plan.stage, accelerator)
            )
    except Exception as e:  # the runner itself failed: shards without a manifest are reported failed
        stop = _STOPS[-1] if _STOPS else None
        error = f"the Beam pipeline failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    found = []
    if error is None:
        paths = [storage.path(results) / n for n in sorted(storage.listing(results)) if n.endswith(".json")]
        found = [ShardResult(**json.loads(b)) for b in storage.read_many(paths)]
    storage.remove_tree(root if in_out else run_dir)
    if storage.is_local(root):  # an empty local .engine/ left in a shared temp_location: gone too
        with contextlib.suppress(OSError):  # not empty: another run's directory is in it
            os.rmdir(root)
    if stop is not None:  # stopped, not failed: what is committed stays, as with the other engines
        raise stop
    return reconcile_results(plan, found, error or "no result came back from the Beam workers")


def shuffle(job: Shuffle, out_dir, options: dict | None = None, workers: int | None = None, progress=True):
    """A whole-input plan (`Stage.whole_plan`) as a Beam pipeline: the items' file | FlatMap(map) |
    GroupByKey (Beam's own shuffle: a partition's tables meet on one worker) | Map(group), each
    group's table written to this run's directory, which the driver reads back (as `run` does)."""
    beam = _import_beam()
    import pyarrow as pa

    _quiet_beam()
    options = dict(options or {})
    options.pop("accelerator", None)
    runner, pipeline_options, threads = build_runner(options, workers)
    root = results_root(out_dir, options)
    run_dir = f"{root}/plan-{uuid.uuid4().hex}"
    results, items_file = f"{run_dir}/results", f"{run_dir}/items.jsonl"
    storage.write_text_atomic("".join(i + "\n" for i in job.items), items_file)
    quiet = _filtered_stderr() if threads else contextlib.nullcontext()
    try:
        with quiet, beam.Pipeline(runner=runner, options=pipeline_options) as p:
            _ = (
                p
                | "ItemsFile" >> beam.Create([(items_file, results)])
                | "Items" >> beam.FlatMap(_read_lines)
                | "Spread" >> beam.Reshuffle()
                | "Map" >> beam.FlatMap(lambda element: job.map(element[0]))
                | "Partition" >> beam.GroupByKey()
                | "Group" >> beam.Map(_group_to, job.group, results)
            )
        paths = [storage.path(results) / n for n in sorted(storage.listing(results)) if n.endswith(".arrow")]
        return [pa.ipc.open_stream(b).read_all() for b in storage.read_many(paths)]
    finally:
        storage.remove_tree(run_dir)
        if storage.is_local(root):  # an empty .engine/ left behind: gone too (another run's stays)
            with contextlib.suppress(OSError):
                os.rmdir(root)


def _group_to(element, group, results: str) -> None:
    """One partition's group, its table written (Arrow IPC) where the driver reads it back."""
    import pyarrow as pa

    part, tables = element
    table = group(part, list(tables))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    storage.write_bytes_atomic(sink.getvalue().to_pybytes(), f"{results}/{part:06d}.arrow")


@contextlib.contextmanager
def _progress(plan: RunPlan, enabled: bool, every: float = 0.5):
    """The progress bar of the other engines (`RunPlan.progress`): Beam reports nothing until the pipeline ends,
    so a thread counts the shard manifests as workers write them (one listing of --out a tick)."""
    if not enabled:
        yield
        return
    names = {manifest_name(t.shard) for t in plan.todo}
    every = every if storage.is_local(plan.out_dir) else max(every, 5.0)  # a LIST is not free

    def done() -> int:
        try:
            return len(names & set(storage.listing(plan.out_dir)))
        except OSError:
            return 0

    stop = threading.Event()
    with plan.progress("beam") as bar:

        def watch():
            while not stop.wait(every):
                bar.update(done() - bar.n)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            bar.update(done() - bar.n)


def task_to_json(task: ShardTask) -> str:
    return json.dumps(
        {
            "shard": task.shard,
            "out_dir": task.out_dir,
            "inputs": [i.model_dump() for i in task.inputs],
            "every": task.every,
            "plan": task.plan,
        }
    )


def task_from_json(line: str) -> ShardTask:
    d = json.loads(line)
    inputs = tuple(ShardInput.model_validate(i) for i in d["inputs"])
    return ShardTask(d["shard"], inputs, d["out_dir"], d["every"], tuple(map(tuple, d.get("plan", ()))))


def _quiet_beam() -> None:
    # the embedded runner logs every bundle at INFO; a CLI user wants the summary line only
    logger = logging.getLogger("apache_beam")
    if logger.level < logging.WARNING:
        logger.setLevel(logging.WARNING)
    logging.getLogger("apache_beam.runners.common").addFilter(NOT_A_STOP)


# What Beam's local SDK worker processes log at start and stop, before they read any option.
WORKER_NOISE = re.compile(
    rb"^(INFO:|WARNING:__main__:No semi_persistent|WARNING:root:apitools not found|.*Worker: severity: WARN .*semi_persistent)"
)


@contextlib.contextmanager
def _filtered_stderr():
    """Drop the SDK worker processes' start-up chatter from stderr (they inherit its file descriptor);
    every other line passes through."""
    read_fd, write_fd = os.pipe()
    saved = os.dup(2)
    os.dup2(write_fd, 2)
    os.close(write_fd)

    def pump():
        with os.fdopen(read_fd, "rb") as src:
            for line in src:
                if not WORKER_NOISE.match(line):
                    os.write(saved, line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the pump sees EOF
        thread.join(timeout=5)
        os.close(saved)
