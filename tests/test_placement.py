"""Placement (CPU-only): what a scoring worker asks each engine for (one accelerator, its CPUs), how Ray
actors survive a lost node, one model copy per Beam worker process, and device and dtype resolved in
the worker (a driver may have no accelerator), with the weights loaded in the compute dtype."""

from __future__ import annotations

import os
import pickle
import platform
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from entroweight.models.checkpoint import save_checkpoint
from entroweight.models.llama import Llama
from entroweight.pipelines import run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.stage import Stage, StageError, read_manifests
from entroweight.schemas import read_file_metadata


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory, tokenizer_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)  # fmt: skip
    out = tmp_path_factory.mktemp("hf")
    LlamaForCausalLM(cfg).save_pretrained(out)
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    return str(out)


@pytest.fixture(scope="module")
def ours(tmp_path_factory, tokenized_dir):
    sha = read_file_metadata(next(tokenized_dir.glob("part-*.parquet")))["tokenizer_sha256"]
    torch.manual_seed(0)
    model = Llama(Llama.Config(vocab_size=1024, n_ctx=128, d_model=32, n_layers=1, n_heads=2, d_ff=64))
    out = tmp_path_factory.mktemp("ours")
    return str(save_checkpoint(model.eval(), "llama", out, tokenizer_sha256=sha, n_ctx=128, pad_id=0))


def cuda_stage(tokenized_dir, hf_model, **kw):
    return ScoreStage(tokenized_dir, "causal_loss", {"model": hf_model, "device": "cuda"}, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a worker without CUDA")
def test_device_is_resolved_in_the_worker_not_on_the_driver(tokenized_dir, hf_model):
    stage = cuda_stage(tokenized_dir, hf_model)  # a driver without a GPU plans the run...
    assert stage.scorer.dtype is None and stage.config()["dtype"] == "auto"  # ...resolving nothing
    with pytest.raises(StageError, match="no CUDA device is visible here"):
        pickle.loads(pickle.dumps(stage)).setup()  # the worker that runs it is where CUDA is checked


def test_a_scoring_worker_asks_for_one_accelerator_and_its_cpus(tokenized_dir, hf_model):
    assert cuda_stage(tokenized_dir, hf_model, cpus_per_worker=4).resources() == {
        "num_cpus": 4,
        "num_gpus": 1,
    }
    cpu = ScoreStage(tokenized_dir, "causal_loss", {"model": hf_model})
    assert cpu.resources() == {"num_cpus": 1, "num_gpus": 0}
    with pytest.raises(StageError, match="--cpus-per-worker"):
        cuda_stage(tokenized_dir, hf_model, cpus_per_worker=0)


class Placed(Exception):
    pass


def test_ray_actors_get_the_resources_and_restart_after_a_lost_node(tokenized_dir, hf_model):
    """`_run_pool` creates its actors with one GPU each, the CPUs asked for, restarts and task retries."""
    from entroweight.pipelines import ray as engine

    asked = {}

    class Remote:
        def options(self, **kw):
            asked.update(kw)
            raise Placed

    fake = SimpleNamespace(cluster_resources=lambda: {"CPU": 16, "GPU": 2}, remote=lambda cls: Remote())
    stage = cuda_stage(tokenized_dir, hf_model, cpus_per_worker=4)
    plan = SimpleNamespace(stage=stage, todo=[1, 2, 3])
    with pytest.raises(Placed):
        engine._run_pool(fake, plan, workers=None, progress=False, embedded=False)
    assert asked["num_gpus"] == 1 and asked["num_cpus"] == 4
    assert asked["max_restarts"] >= 1 and asked["max_task_retries"] >= 1
    # an actor's thread pools are sized to its CPUs
    assert engine.actor_env({"num_cpus": 4})["OMP_NUM_THREADS"] == "4"
    # two GPUs in the cluster: two actors (one model per accelerator), however many shards
    assert engine.pool_size(fake, {"num_cpus": 4, "num_gpus": 1}, None, 3) == 2


class CountingStage(Stage):
    name = "counting"
    loads = 0

    def __init__(self, gpus=0):
        self.gpus = gpus

    def setup(self):
        CountingStage.loads += 1

    def resources(self):
        return {"num_cpus": 1, "num_gpus": self.gpus}

    def config(self):
        return {}

    def plan_inputs(self):
        return []

    def process(self, task):
        raise NotImplementedError


def test_beam_loads_one_model_per_worker_process_and_hints_the_accelerator():
    import apache_beam as beam
    from apache_beam.internal import pickler

    from entroweight.pipelines import beam as engine

    fn = engine._dofn()(CountingStage(), None)
    # DoFn copies in one process (Beam's threads each deserialise their own): one setup() between them
    copies = [pickler.loads(pickler.dumps(fn)) for _ in range(3)]
    CountingStage.loads = 0
    for c in copies:
        c.setup()
    assert CountingStage.loads == 1 and all(c.stage is copies[0].stage for c in copies)
    # the shard transform requests one accelerator when the stage runs on one
    hint = "beam:resources:accelerator:v1"
    gpu = engine.with_hints(beam.ParDo(fn), CountingStage(gpus=1), "type:nvidia-l4;count:1")
    assert gpu.get_resource_hints()[hint] == b"type:nvidia-l4;count:1"
    assert hint not in engine.with_hints(beam.ParDo(fn), CountingStage(), "x").get_resource_hints()


@pytest.mark.parametrize("which", ["hf", "ours"])
def test_weights_load_in_the_compute_dtype(which, hf_model, ours, tokenized_dir, tmp_path):
    from entroweight.scorers import make_scorer

    spec = {"model": hf_model} if which == "hf" else {"checkpoint": ours}
    fp32 = make_scorer("causal_loss", dtype="fp32", **spec)
    bf16 = make_scorer("causal_loss", dtype="bf16", **spec)
    for s in (fp32, bf16):
        s.setup()
    assert {p.dtype for p in bf16._model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in fp32._model.parameters()} == {torch.float32}
    if which == "hf":
        assert bf16._model.config._attn_implementation == "sdpa"
    import pyarrow.parquet as pq

    t = pq.read_table(sorted(tokenized_dir.glob("part-*.parquet"))[0]).slice(0, 8)
    ids = np.stack(t.column("input_ids").to_numpy(zero_copy_only=False)).astype(np.int64)
    n_pad = t.column("n_pad").to_numpy().astype(np.int64)
    a, b = fp32.score(ids, n_pad).values, bf16.score(ids, n_pad).values
    real = np.arange(ids.shape[1])[None] >= n_pad[:, None]
    assert np.isfinite(b).all() and (b[~real] == 0).all()
    np.testing.assert_allclose(b[real], a[real], rtol=0.05, atol=0.05)  # bf16 rounding only
    # the manifest records what the worker resolved ('auto' in the config: resolved per machine)
    stage = ScoreStage(tokenized_dir, "causal_loss", {**spec, "batch_size": 64})
    run_stage(stage, tmp_path / "out", progress=False)
    extra = read_manifests(tmp_path / "out")[0].extra
    assert extra["device"] == "cpu" and extra["dtype"] in ("bf16", "fp32")
    assert read_file_metadata(next((tmp_path / "out").glob("part-*.parquet")))["dtype"] == "auto"


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU's flags from Linux")
def test_auto_takes_bf16_on_a_cpu_only_where_its_instructions_compute_in_bf16():
    """'auto' on a CPU is bf16 only with bf16 arithmetic in the instruction set (x86: AVX512-BF16 or
    AMX-BF16, as the kernel lists them): oneDNN also answers yes on AVX512 alone, where it emulates
    bf16 and scoring ran 3x slower than fp32. Checked against the kernel's flags, not torch's."""
    from entroweight.scorers.forward import native_bf16, resolve_dtype

    flags = set()
    for line in open("/proc/cpuinfo").read().splitlines():
        if line.startswith(("flags", "Features")):
            flags |= set(line.split(":", 1)[1].split())
    if platform.machine().lower() in ("x86_64", "amd64"):
        expected = bool(flags & {"avx512_bf16", "amx_bf16"})
    else:  # aarch64: the BF16 extension
        expected = "bf16" in flags
    assert native_bf16("cpu") is expected
    assert resolve_dtype("auto", "cpu") == ("bf16" if expected else "fp32")
    assert resolve_dtype("fp32", "cpu") == "fp32" and resolve_dtype("bf16", "cpu") == "bf16"  # asked: kept


def test_a_hub_model_is_pinned_to_its_commit(tmp_path, monkeypatch):
    """Offline here: the revision comes from the local hub cache's main ref, into the stage config."""
    from huggingface_hub import constants

    from entroweight.scorers import make_scorer

    sha = "0123456789abcdef0123456789abcdef01234567"
    ref = tmp_path / "models--meta-llama--Llama-3.2-1B" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    ref.write_text(sha)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    s = make_scorer("causal_loss", model="meta-llama/Llama-3.2-1B", dtype="fp32")
    assert s.config()["model_revision"] == sha and s.revision == sha
    # a network that fails with the hub client's own error (its HTTP library's, not an OSError): the
    # cache's ref too, where it was a traceback (a machine with no DNS, not told it is offline)
    import huggingface_hub

    class ConnectError(Exception):
        pass

    def unreachable(*a, **kw):
        raise ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    assert make_scorer("causal_loss", model="meta-llama/Llama-3.2-1B", dtype="fp32").revision == sha
    # cross_tokenizer (whose default model is this hub id) pins it the same way
    x = make_scorer("cross_tokenizer", dtype="fp32")
    assert x.config()["model_revision"] == sha and x.source.revision == sha
    # ... and its tokenizer is read at that commit too (the hub is out of reach here: stop at the call)
    import transformers

    asked = {}

    def from_pretrained(name, **kw):
        asked.update(name=name, **kw)
        raise OSError("offline")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    with pytest.raises(OSError):
        x.source.tokenizer()
    assert asked == {"name": "meta-llama/Llama-3.2-1B", "revision": sha}


def test_cross_tokenizer_resolves_its_dtype_in_the_worker(tokenized_dir, tokenizer_dir, hf_model, tmp_path):
    """The config records what was asked ('auto'), the same on any driver; the manifest what the
    worker resolved; a local model records no revision (its sha256)."""
    stage = ScoreStage(
        tokenized_dir, "cross_tokenizer", {"model": hf_model, "context": 64}, tokenizer=str(tokenizer_dir)
    )
    config = stage.scorer.config()
    assert config["dtype"] == "auto" and "model_revision" not in config and config["model_sha256"]
    run_stage(stage, tmp_path / "out", progress=False)
    assert read_manifests(tmp_path / "out")[0].extra["dtype"] in ("bf16", "fp32")
