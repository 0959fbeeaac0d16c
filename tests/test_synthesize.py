"""The synthesize stage: a corpus drawn from a teacher, whose values are the exact entropy.

A tiny llama teacher (random weights, large enough init that its distributions are far from uniform)
in the 1k test tokenizer: the stored entropy and surprisal equal a hand computation from the
teacher's full forward over the rows as written; the stage holds the contract of every stage (engine
parity in bytes, rerun with nothing to do, kill and resume, object storage, refusals) and its output
is weighted data every reader takes: `weigh` gives oracle weights, `train` trains on them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from test_engines import cli  # the command in a process of its own, killable with its workers

from entroweight.pipelines import run_stage
from entroweight.pipelines.stage import read_manifests
from entroweight.pipelines.synthesize import SynthesizeStage
from entroweight.pipelines.verify import verify_dir
from entroweight.schemas.datadir import DataDir
from entroweight.schemas.weighted import ENTROPY, EXCLUDED, SURPRISAL, WEIGHT, excluded_mask, matrix
from entroweight.transforms.tokenizer import load_tokenizer
from entroweight.workflows.cli.main import main

N_CTX, TEACHER_CTX = 24, 64


def save_teacher(root: Path, tokenizer_dir: Path, kind: str = "llama", mask_pads: bool = False) -> Path:
    from entroweight.models import build_model
    from entroweight.models.checkpoint import save_checkpoint

    tok = load_tokenizer(tokenizer_dir)
    torch.manual_seed(0)
    fields = dict(vocab_size=tok.vocab_size, n_ctx=TEACHER_CTX, d_model=32, n_layers=2, n_heads=2, d_ff=64)
    if kind == "llama":
        fields.update(init_std=0.2, mask_pads=mask_pads)
    model = build_model(kind, fields)
    ckpt = save_checkpoint(
        model, kind, root, n_ctx=TEACHER_CTX, pad_id=tok.pad_id, tokenizer_sha256=tok.sha256
    )
    shutil.copy(tok.path, ckpt / "tokenizer.json")
    return ckpt


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tokenizer_dir) -> Path:
    return save_teacher(tmp_path_factory.mktemp("teacher") / "ckpt", tokenizer_dir)


def stage(teacher, **kw) -> SynthesizeStage:
    kw = {"sequences": 10, "n_ctx": N_CTX, "shard_docs": 4, "batch_size": 4, **kw}
    return SynthesizeStage(checkpoint=str(teacher), **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, teacher) -> Path:
    out = tmp_path_factory.mktemp("synth") / "out"
    run_stage(stage(teacher, temperature=0.8), out, progress=False)
    return out


def _concat(out: Path):
    import pyarrow as pa

    return pa.concat_tables([pq.read_table(p.location) for p in DataDir(out).parts])


def file_hashes(out: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.glob("part-*.parquet"))}


def hand_values(ckpt: Path, t, temperature: float):
    """(entropy, surprisal) of each row's tokens from the teacher's full forward over the rows as
    written (its padding is its context), fp64; position i is about token i."""
    from entroweight.models.checkpoint import load_checkpoint

    model = load_checkpoint(ckpt)[0]
    ids = torch.tensor(matrix(t.column("input_ids")).astype(np.int64))
    n_pad = t.column("n_pad").to_numpy()
    real = torch.tensor(np.arange(ids.shape[1])[None, :] >= n_pad[:, None])
    with torch.no_grad():
        mask = real if model.config.mask_pads else None
        logp = torch.log_softmax(model(ids, attention_mask=mask).double() / temperature, -1)
    H = torch.zeros(ids.shape, dtype=torch.float64)
    S = torch.zeros(ids.shape, dtype=torch.float64)
    H[:, 1:] = -(logp.exp() * logp).sum(-1)[:, :-1]
    S[:, 1:] = -logp[:, :-1].gather(2, ids[:, 1:, None])[..., 0]
    return H.numpy(), S.numpy()


def test_the_values_are_the_teachers_exact_entropy_and_surprisal(reference, teacher):
    """Each drawn token's stored entropy and surprisal are those of softmax(logits / T) of the teacher's
    forward over the row as written; pads are 0; no position is excluded without a prefix."""
    t = _concat(reference)
    assert t.num_rows == 10 and t.column_names[-4:] == [ENTROPY, SURPRISAL, EXCLUDED, WEIGHT]
    H, S = hand_values(teacher, t, 0.8)
    e, s = matrix(t.column(ENTROPY)), matrix(t.column(SURPRISAL))
    n_pad = t.column("n_pad").to_numpy()
    assert (n_pad == 1).all()  # one pad, then n_ctx − 1 tokens drawn
    np.testing.assert_allclose(e[:, 1:], H[:, 1:], atol=2e-4)
    np.testing.assert_allclose(s[:, 1:], S[:, 1:], atol=2e-4)
    assert (e[:, 0] == 0).all() and (s[:, 0] == 0).all()
    assert e[:, 1:].std() > 0.05 and (e[:, 1:] < np.log(1024)).all()  # a real spread, below uniform
    assert excluded_mask(t.column(EXCLUDED), N_CTX) is None
    assert verify_dir(reference) == []
    meta = DataDir(reference).metadata
    assert (
        meta["teacher"]["checkpoint_sha256"]
        == json.loads((teacher / "config.json").read_text())["weights_sha256"]
    )
    assert (meta["temperature"], meta["seed"], meta["unit"]) == (0.8, 0, "nats")


def test_a_mask_pads_teacher_and_a_prefix_of_real_documents(tmp_path, tokenizer_dir, tokenized_dir):
    """Rows continue the first tokens of real documents: those are excluded (weight 0, no value) and
    the drawn tokens' values are still the teacher's exact ones, for a teacher that masks its pads."""
    ckpt = save_teacher(tmp_path / "masked", tokenizer_dir, mask_pads=True)
    out = tmp_path / "out"
    run_stage(
        stage(ckpt, prefix_from=str(tokenized_dir), prefix_tokens=5, temperature=1.3), out, progress=False
    )
    t = _concat(out)
    excluded = excluded_mask(t.column(EXCLUDED), N_CTX)
    n_pad = t.column("n_pad").to_numpy()
    C = N_CTX - (N_CTX - 1 - 5)  # the context: a pad and the prefix
    assert excluded is not None and (excluded.sum(1) == C - n_pad).all() and (excluded[:, C:] == 0).all()
    docs = _concat(tokenized_dir).slice(0, 10)
    first = matrix(docs.column("input_ids"))
    ids = matrix(t.column("input_ids"))
    for r in range(10):  # each sequence continues its own document's first tokens
        doc = first[r, docs.column("n_pad")[r].as_py() :][:5]
        assert (ids[r, C - len(doc) : C] == doc).all()
    H, S = hand_values(ckpt, t, 1.3)
    np.testing.assert_allclose(matrix(t.column(ENTROPY))[:, C:], H[:, C:], atol=2e-4)
    np.testing.assert_allclose(matrix(t.column(SURPRISAL))[:, C:], S[:, C:], atol=2e-4)
    w = matrix(t.column(WEIGHT), np.float32)
    assert (w[excluded] == 0).all() and (matrix(t.column(ENTROPY))[excluded] == 0).all()
    assert verify_dir(out) == []


def test_rows_do_not_depend_on_shards_or_batches(reference, teacher, tmp_path):
    """Sequence i draws from its own seed: other shard and batch sizes give the same tokens (values to
    the rounding of a batched forward), a rerun has nothing to do, more sequences draw only theirs."""
    out = tmp_path / "out"
    run_stage(stage(teacher, temperature=0.8, shard_docs=3, batch_size=1), out, progress=False)
    a, b = _concat(reference), _concat(out)
    assert a.column("seq_id").to_pylist() == b.column("seq_id").to_pylist()
    assert (matrix(a.column("input_ids")) == matrix(b.column("input_ids"))).all()
    np.testing.assert_allclose(matrix(a.column(ENTROPY)), matrix(b.column(ENTROPY)), atol=1e-5)
    again = run_stage(stage(teacher, temperature=0.8, shard_docs=3, batch_size=1), out, progress=False)
    assert again.shards_run == 0 and "nothing to do" in again.line()
    grown = tmp_path / "grown"  # from a whole number of shards: the new shards alone are drawn
    run_stage(stage(teacher, temperature=0.8, shard_docs=3, sequences=6, batch_size=1), grown, progress=False)
    more = run_stage(stage(teacher, temperature=0.8, shard_docs=3, batch_size=1), grown, progress=False)
    assert (more.shards_done_before, more.shards_run) == (2, 2)
    assert file_hashes(grown) == file_hashes(out) and verify_dir(grown) == []


@pytest.fixture(scope="module")
def ray_session():
    pytest.importorskip("ray")
    from entroweight.pipelines.ray import start_ray

    ray, _ = start_ray(None)
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("engine", ["beam", "ray"])
def test_every_engine_writes_the_same_bytes(reference, teacher, tmp_path, engine, request):
    if engine == "ray":
        request.getfixturevalue("ray_session")
    out = tmp_path / engine
    run_stage(stage(teacher, temperature=0.8), out, engine=engine, progress=False)
    assert verify_dir(out) == []
    if engine == "beam":  # the same threads as the local engine here: the same bytes
        assert file_hashes(out) == file_hashes(reference)
    # a Ray actor computes on its one CPU's thread: float sums in another order (as score's parity)
    a, b = _concat(reference), _concat(out)
    assert (matrix(a.column("input_ids")) == matrix(b.column("input_ids"))).all()
    for c in (ENTROPY, SURPRISAL):
        np.testing.assert_allclose(matrix(a.column(c)), matrix(b.column(c)), atol=1e-5)


def test_object_storage(reference, teacher, s3_bucket):
    """Written to the loopback S3 server: the same bytes, verified there, read there by `weigh`."""
    from entroweight import storage

    out = f"{s3_bucket}/synth"
    run_stage(stage(teacher, temperature=0.8), out, progress=False)
    for name, sha in file_hashes(reference).items():
        assert storage.sha256(storage.path(out) / name) == sha
    assert verify_dir(out) == []
    res = CliRunner().invoke(main, ["weigh", out, "--out", f"{s3_bucket}/weighed"])
    assert res.exit_code == 0, res.output


def test_a_killed_run_resumes_to_the_same_bytes(teacher, tmp_path):
    """SIGKILL once a shard is committed: the rerun keeps it, draws the rest, and ends with the bytes of
    an uninterrupted run of the same command (a process of its own too: the float sums follow torch's
    thread count, which tests run earlier in this process may have changed)."""
    import time

    out = tmp_path / "out"
    args = ["synthesize", "--checkpoint", teacher, "--out", out, "--sequences", 10, "--n-ctx", N_CTX]
    args += ["--shard-docs", 4, "--batch-size", 4, "--temperature", 0.8]
    proc = cli(*args, env={"ENTROWEIGHT_TEST_SHARD_DELAY": "1.0"})
    deadline = time.monotonic() + 120
    while not (out.exists() and read_manifests(out)) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 1 <= len(read_manifests(out)) < 3 and verify_dir(out) != []
    rerun = cli(*args)
    stdout, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr
    assert "already done" in stdout and "0 already done" not in stdout, stdout
    whole = tmp_path / "whole"
    uninterrupted = cli(*[whole if a == out else a for a in args])
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.stderr.read()
    assert file_hashes(out) == file_hashes(whole) and len(file_hashes(whole)) == 3 and verify_dir(out) == []


def test_oracle_weights_from_weigh_and_training_on_them(reference, tmp_path):
    """`weigh` turns the truth into weights (1 − minmax of H), row by row as score's output; `train`
    trains on them, and `inspect` and `compare` read the synthetic directory."""
    weighed = tmp_path / "weighed"
    res = CliRunner().invoke(main, ["weigh", str(reference), "--out", str(weighed), "--weighting", "minmax"])
    assert res.exit_code == 0, res.output
    t = _concat(weighed)
    e, w = matrix(t.column(ENTROPY)), matrix(t.column(WEIGHT), np.float32)
    real = e != 0
    lo, hi = e[real].min(), e[real].max()
    assert SURPRISAL not in t.column_names
    row = 3
    r = real[row]
    expected = 1 - (e[row, r] - e[row, r].min()) / (e[row, r].max() - e[row, r].min())
    np.testing.assert_allclose(w[row, r], expected, atol=2e-3)
    assert lo < hi
    for argv in (["inspect", str(reference)], ["compare", str(reference), str(weighed)]):
        res = CliRunner().invoke(main, argv)
        assert res.exit_code == 0, (argv, res.output)
    ckpt = tmp_path / "student"
    config = tmp_path / "tiny.yaml"
    config.write_text("d_model: 32\nn_layers: 1\nn_heads: 2\nd_ff: 64\n")
    res = CliRunner().invoke(
        main,
        ["train", str(weighed), "--out", str(ckpt), "--model-config", str(config), "--loss", "weighted_ce"]
        + ["--steps", "2", "--batch-size", "4"],
    )
    assert res.exit_code == 0, res.output
    assert (ckpt / "config.json").exists()


BAD = {
    "a temperature of 0": ["--temperature", "0"],
    "a negative temperature": ["--temperature", "-1"],
    "a temperature NaN": ["--temperature", "nan"],
    "no sequence": ["--sequences", "0"],
    "rows wider than the teacher": ["--n-ctx", str(TEACHER_CTX + 1)],
    "no token left to draw": ["--n-ctx", "1"],
    "two teachers": ["--model", "HuggingFaceTB/SmolLM2-135M"],
    "a prefix without its length": ["--prefix-from", "{tokenized}"],
    "a prefix length without documents": ["--prefix-tokens", "3"],
    "a seed below 0": ["--seed", "-1"],
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_options_are_refused_in_one_line(case, teacher, tokenized_dir, tmp_path):
    out = tmp_path / "out"
    argv = ["synthesize", "--checkpoint", str(teacher), "--out", str(out), "--sequences", "4", "--n-ctx", "8"]
    argv += [a.format(tokenized=tokenized_dir) for a in BAD[case]]
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not out.exists()


def test_bad_teachers_are_refused_in_one_line(tmp_path, tokenizer_dir, tokenized_dir, llama3_tokenizer):
    """A teacher that is not there, of a kind that cannot sample (a masked mixer), without its
    tokenizer, or none at all; a prefix in another tokenizer or with too few documents."""
    mixer = save_teacher(tmp_path / "mixer", tokenizer_dir, kind="mixer")
    bare = save_teacher(tmp_path / "bare", tokenizer_dir)
    (bare / "tokenizer.json").unlink()
    good = save_teacher(tmp_path / "good", tokenizer_dir)
    out = tmp_path / "out"
    base = ["synthesize", "--out", str(out), "--n-ctx", "8"]
    cases = {
        "missing": ["--checkpoint", str(tmp_path / "nope"), "--sequences", "4"],
        "mixer": ["--checkpoint", str(mixer), "--sequences", "4"],
        "no tokenizer": ["--checkpoint", str(bare), "--sequences", "4"],
        "no teacher": ["--sequences", "4"],
        "too few documents": ["--checkpoint", str(good), "--sequences", "2000"]
        + ["--prefix-from", str(tokenized_dir), "--prefix-tokens", "2"],
    }
    for case, argv in cases.items():
        res = CliRunner().invoke(main, base + argv)
        assert res.exit_code == 2, (case, res.output)
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in res.output, (case, res.output)
        assert not out.exists(), case


def test_an_hf_teacher(tmp_path, tokenizer_dir):
    """A Hugging Face causal LM (a tiny random LlamaForCausalLM in the test tokenizer): rows drawn after
    its start token with `past_key_values`, values equal to its full forward's."""
    transformers = pytest.importorskip("transformers")
    tok = load_tokenizer(tokenizer_dir)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    d = tmp_path / "hf"
    model.save_pretrained(d)
    shutil.copy(tok.path, d / "tokenizer.json")
    out = tmp_path / "out"
    run_stage(SynthesizeStage(6, 16, model=str(d), shard_docs=3, batch_size=2), out, progress=False)
    t = _concat(out)
    ids = torch.tensor(matrix(t.column("input_ids")).astype(np.int64))[:, 1:]  # the pad left out
    from entroweight.scorers.hf import load_model_tokenizer

    start = load_model_tokenizer(d)[1]
    x = torch.cat([torch.full((ids.shape[0], 1), start), ids], 1)
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits.double(), -1)[:, :-1]
    H = -(logp.exp() * logp).sum(-1)
    S = -logp.gather(2, ids[..., None])[..., 0]
    np.testing.assert_allclose(matrix(t.column(ENTROPY))[:, 1:], H.numpy(), atol=2e-4)
    np.testing.assert_allclose(matrix(t.column(SURPRISAL))[:, 1:], S.numpy(), atol=2e-4)
    assert verify_dir(out) == []
