# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""Bad input to `train` and `eval-bpb`, on real text and real token parquet: each case is refused
(exit 2, one clear line, no traceback, nothing written to --out) or, once a run has started, stops
with exit 1 and a message, never a green exit over wrong numbers.

eval-bpb: empty text, --max-bytes 0, invalid UTF-8, --stride 0 / > n_ctx; progress bar on stderr.
train: a resume whose settings differ (and --allow-config-change recording both), NaN/inf entropy
and weights found before the first step, a loss that turns NaN mid-run, a disk that fills while
the checkpoint is saved.
"""

from __future__ import annotations

import json
import math
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_trainer_fixtures import TINY, make_weighted, one_thread, tiny_ckpt, weighted_dir  # noqa: F401

from entroweight.trainers.bpb import eval_bpb
from entroweight.workflows.cli.main import main


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(r, *words):
    """Exit 2 with one `error:` line naming `words`, no traceback."""
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output and all(w in lines[0] for w in words), lines[0]
    return lines[0]


def strict_json_lines(path: Path) -> list[dict]:
    """JSON lines parsed as standard JSON: NaN / Infinity tokens are an error."""

    def reject(token):
        raise ValueError(f"non-standard JSON token {token} in {path}")

    return [json.loads(ln, parse_constant=reject) for ln in path.read_text().splitlines() if ln.strip()]


# ---------------------------------------------------------------- eval-bpb


def test_eval_bpb_refuses_empty_text_and_max_bytes_0(tiny_ckpt, tmp_path, wikitext_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    refused(cli("eval-bpb", tiny_ckpt, "--text", empty), "has no text")
    refused(cli("eval-bpb", tiny_ckpt, "--text", wikitext_path, "--max-bytes", 0), "--max-bytes")
    refused(cli("eval-bpb", tiny_ckpt, "--text", wikitext_path, "--max-bytes", -5), "--max-bytes")


@pytest.mark.parametrize(
    "name",
    [
        "docs.jsonl", "docs.json", "docs.parquet", "docs.jsonl.gz", "gz-no-suffix", "zst-no-suffix", "docs.txt",
        "blank-line-first.txt", "long-first-line.txt",
    ],
)  # fmt: skip
def test_the_text_to_evaluate_is_plain_text_not_a_file_of_documents(tiny_ckpt, tmp_path, name):
    """eval-bpb --text (and a workflow's eval.text) scores a file's bytes as they are: a file of
    documents (JSON lines, parquet, compressed: by name or first bytes) gave a BPB of its markup,
    exit 0. Refused, saying why, before the model is loaded."""
    import gzip

    import zstandard

    f = tmp_path / name
    line = json.dumps({"text": "A document of the user's."}) + "\n"
    if name.startswith("long"):  # a book per line: its first line far past any fixed head
        line = json.dumps({"text": "word " * 40_000}) + "\n" + line
    if name.startswith("blank"):
        line = "\n \n" + line
    pack = {"gz": gzip.compress, "zst": zstandard.compress}
    kind = next((k for k in pack if k in name), None)
    f.write_bytes(pack[kind](line.encode()) if kind else line.encode())
    refused(cli("eval-bpb", tiny_ckpt, "--text", f), "is a file of documents", "not plain text")
    from entroweight.workflows.spec import SpecError, parse_workflow

    spec = {"run_dir": str(tmp_path / "run"), "sources": [str(f)], "tokenizer": {"path": "t.json"}}
    with pytest.raises(SpecError, match="eval.text: .* is a file of documents"):
        parse_workflow({**spec, "eval": {"text": str(f)}})


def test_text_that_begins_with_json_is_still_text(tmp_path):
    """Only a first line that is a document (a JSON object with a string `text`) marks JSON lines: a
    text whose first line is other JSON (a config, code) is text."""
    from entroweight.transforms.sources import not_plain_text

    for first in ('{"a": 1}', '{"text": 3}', "[1, 2]", '"text"', "{ not json"):
        f = tmp_path / "t.txt"
        f.write_text(first + "\nand then prose.\n")
        assert not_plain_text(f) is None, first


def test_eval_bpb_refuses_invalid_utf8_naming_the_offset(tiny_ckpt, tmp_path, wikitext_path):
    raw = bytearray(wikitext_path.read_bytes()[:3000])
    raw[1234] = 0xFF  # one stray byte in real text: it used to vanish from the byte count
    bad = tmp_path / "latin.txt"
    bad.write_bytes(bytes(raw))
    refused(cli("eval-bpb", tiny_ckpt, "--text", bad), "not valid UTF-8", "offset 1234")
    # a --max-bytes cut inside a character is not invalid text: the partial character is left out
    cut = wikitext_path.read_bytes().index("–".encode()) + 1  # inside the 3-byte en dash
    res = eval_bpb(tiny_ckpt, wikitext_path, max_bytes=cut, n_ctx=32, device="cpu")
    assert res["bytes"] == cut - 1


def test_eval_bpb_refuses_a_stride_outside_1_to_n_ctx(tiny_ckpt, wikitext_path):
    for stride, n_ctx in [(0, 64), (-1, 64), (65, 64)]:
        refused(
            cli("eval-bpb", tiny_ckpt, "--max-bytes", 2000, "--n-ctx", n_ctx, "--stride", stride),
            "--stride must be in 1..n_ctx (64)",
        )
    refused(cli("eval-bpb", tiny_ckpt, "--max-bytes", 2000, "--n-ctx", 1), "--n-ctx must be at least 2")
    refused(cli("eval-bpb", tiny_ckpt, "--max-bytes", 2000, "--batch-size", 0), "--batch-size")


def test_eval_bpb_shows_progress_on_stderr(tiny_ckpt, capsys):
    eval_bpb(tiny_ckpt, max_bytes=3000, n_ctx=32, stride=16, device="cpu", progress=True)
    err = capsys.readouterr().err
    assert "eval-bpb" in err and "window" in err
    r = cli("eval-bpb", tiny_ckpt, "--max-bytes", 3000, "--json")  # not a terminal: no bar
    assert r.exit_code == 0 and json.loads(r.output)["bytes"] == 3000


# ---------------------------------------------------------------- train: resume settings


def train_args(data, out, *extra):
    mc = Path(out).parent / "tiny.yaml"
    mc.write_text("".join(f"{k}: {v}\n" for k, v in TINY.items()))
    return ["train", data, "--model-config", mc, "--out", out, "--batch-size", 4, "--device", "cpu", *extra]


@pytest.mark.parametrize("flag", ["--config", "--model-config"])
def test_a_key_given_twice_in_a_config_file_is_refused(weighted_dir, tmp_path, flag):
    """As in a workflow file: PyYAML keeps the last of two `steps:` silently, so an edit above a
    forgotten repeat would lose. Exit 2 naming the key and both lines; nothing written."""
    key, first, second = ("steps", 1, 2) if flag == "--config" else ("d_model", 64, 32)
    f = tmp_path / "c.yaml"
    f.write_text(f"{key}: {first}\n{key}: {second}\n")
    args = train_args(weighted_dir, tmp_path / "out", "--steps", 1)
    if flag == "--config":
        args += ["--config", f]
    else:
        args[args.index("--model-config") + 1] = f
    refused(cli(*args), f"duplicate key '{key}' (line 2; first given on line 1)")
    assert not (tmp_path / "out").exists()


def test_a_config_files_model_config_may_name_a_file(weighted_dir, tmp_path):
    """`model_config:` in a --config file takes what `--model-config` and a workflow's `model_config:`
    take, a file, as well as the fields inline: a path was refused ("Input should be a valid
    dictionary", a docs audit). Its file is read as the flag's is, and the path rule applies to it."""
    mc = tmp_path / "tiny.yaml"
    mc.write_text("".join(f"{k}: {v}\n" for k, v in TINY.items()))
    run = tmp_path / "run.yaml"
    run.write_text(f"model_config: {mc}\nsteps: 1\nbatch_size: 4\ndevice: cpu\n")
    r = cli("train", weighted_dir, "--config", run, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model"]["d_model"] == TINY["d_model"]
    run.write_text(f"model_config: {tmp_path / 'none.yaml'}\nsteps: 1\n")
    refused(
        cli("train", weighted_dir, "--config", run, "--out", tmp_path / "o2"), "model_config (in --config"
    )
    # its paths as the flags take them: a `..` after a missing directory makes no directory there
    run.write_text(f"model_config: {mc}\nsteps: 1\nout: {tmp_path}/new/../o3\n")
    assert cli("train", weighted_dir, "--config", run).exit_code == 0
    assert (tmp_path / "o3" / "config.json").exists() and not (tmp_path / "new").exists()
    inside = tmp_path / "cfgs" / "tiny.yaml"  # the path rule: --out holds the model_config it reads
    inside.parent.mkdir()
    inside.write_text(mc.read_text())
    run.write_text(f"model_config: {inside}\nsteps: 1\n")
    refused(cli("train", weighted_dir, "--config", run, "--out", inside.parent), "model_config (in --config")


def test_resume_with_other_settings_is_refused_naming_them(weighted_dir, tmp_path):
    out = tmp_path / "run"
    r = cli(*train_args(weighted_dir, out, "--steps", 6, "--stop-at", 3, "--lr", "1e-3"))
    assert r.exit_code == 0, r.output
    before = (out / "config.json").read_bytes()
    r = cli(*train_args(weighted_dir, out, "--steps", 8, "--lr", "2e-3", "--loss", "weighted_ce", "--resume"))
    line = refused(
        r, "lr 0.001 -> 0.002", "steps 6 -> 8", "loss 'ce' -> 'weighted_ce'", "--allow-config-change"
    )
    assert "batch_size" not in line  # only what differs is named
    assert (out / "config.json").read_bytes() == before  # nothing rewritten
    refused(
        cli(*train_args(weighted_dir, out, "--steps", 6, "--batch-size", 2, "--resume")), "batch_size 4 -> 2"
    )
    other = tmp_path / "other.yaml"  # the model's own config: each field that differs, not the whole dict
    other.write_text("".join(f"{k}: {v}\n" for k, v in {**TINY, "d_model": 32}.items()))
    argv = ["train", weighted_dir, "--model-config", other, "--out", out, "--batch-size", 4, "--steps", 6]
    line = refused(cli(*argv, "--resume"), "--model-config differs from the checkpoint's (d_model: 64 -> 32)")
    assert "n_layers" not in line
    # settings that do not change what is computed may differ (here the stop and logging)
    r = cli(
        *train_args(
            weighted_dir, out, "--steps", 6, "--lr", "1e-3", "--stop-at", 4, "--log-every", 2, "--resume"
        )
    )
    assert r.exit_code == 0, r.output
    assert "train_history" not in json.loads((out / "config.json").read_text())


def test_allowed_config_change_records_both_configs(weighted_dir, tmp_path):
    out = tmp_path / "run"
    assert cli(*train_args(weighted_dir, out, "--steps", 6, "--stop-at", 3)).exit_code == 0
    refused(cli(*train_args(weighted_dir, tmp_path / "new", "--allow-config-change")), "only with --resume")
    assert not (tmp_path / "new").exists()
    r = cli(*train_args(weighted_dir, out, "--steps", 8, "--lr", "1e-4", "--resume", "--allow-config-change"))
    assert r.exit_code == 0, r.output
    config = json.loads((out / "config.json").read_text())
    assert config["step"] == 8 and config["train"]["steps"] == 8 and config["train"]["lr"] == 1e-4
    first, second = config["train_history"]
    assert first["step"] == 0 and first["train"]["steps"] == 6 and first["train"]["lr"] == 2e-4
    assert second["step"] == 3 and second["changed"] == ["lr", "steps"] and second["train"] == config["train"]
    # a later resume under the new settings needs no flag and keeps the history
    r = cli(*train_args(weighted_dir, out, "--steps", 8, "--lr", "1e-4", "--stop-at", 8, "--resume"))
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["train_history"] == config["train_history"]
    # once more, at its last step: nothing is trained, and it says so (it said "loss None, 0 real tok/s")
    r = cli(*train_args(weighted_dir, out, "--steps", 8, "--lr", "1e-4", "--resume"))
    assert r.exit_code == 0 and f"nothing to train: {out} is at step 8 of 8" in r.output, r.output
    # a stop behind the checkpoint's step says so, and of the run's steps (it said "at step 8 of 8")
    later = ("--steps", 12, "--lr", "1e-4", "--stop-at", 5, "--resume", "--allow-config-change")
    r = cli(*train_args(weighted_dir, out, *later))
    assert r.exit_code == 0, r.output
    assert f"nothing to train: {out} is at step 8 of 12, past --stop-at 5" in r.output, r.output


# ---------------------------------------------------------------- train: non-finite values


def poisoned(tokenized_dir, dst, column: str, value: float) -> Path:
    """Real token data with random entropy/weight and one value of its LAST file set to `value`:
    the shuffled stream reaches it only after several steps."""
    files = sorted(Path(tokenized_dir).glob("*.parquet"))
    seen = []

    def edit(ids, w, e):
        seen.append(1)
        if len(seen) == len(files):
            (w if column == "weight" else e)[-1, -1] = value  # the last token of a left-padded row: real
        return ids, w, e

    make_weighted(tokenized_dir, dst, edit=edit)
    return dst / files[-1].name


@pytest.mark.parametrize(
    "column,value,loss,words",
    [
        ("entropy", math.inf, "rescaled", "entropy NaN or infinite"),
        ("entropy", math.nan, "rescaled", "entropy NaN or infinite"),
        ("weight", math.nan, "weighted_ce", "weight NaN or infinite"),
        ("weight", 1.5, "weighted_ce", "weights outside [0, 1]"),
    ],
)
def test_non_finite_data_is_refused_before_the_first_step(
    tokenized_dir, tmp_path, column, value, loss, words
):
    data = tmp_path / "data"
    bad = poisoned(tokenized_dir, data, column, value)
    out = tmp_path / "run"
    r = cli(*train_args(data, out, "--loss", loss, "--steps", 20, "--shuffle-buffer", 8))
    line = refused(r, str(bad), f"1 {words}")
    assert "re-run the scoring" in line
    assert not out.exists()  # refused before anything was written
    if column == "entropy":  # a loss that does not read the column does not care
        r = cli(*train_args(data, out, "--loss", "ce", "--steps", 1))
        assert r.exit_code == 0, r.output


def test_a_loss_that_turns_nan_stops_the_run_with_exit_1(weighted_dir, tmp_path):
    out = tmp_path / "run"
    # an absurd learning rate without clipping: the weights overflow within a few steps
    args = ["--steps", 20, "--lr", "1e30", "--warmup-steps", 1, "--grad-clip", 0, "--log-every", 1]
    r = cli(*train_args(weighted_dir, out, *args, "--save-every", 1))
    assert r.exit_code == 1, r.output
    assert "training stopped: the ce loss is nan at step" in r.output and "Traceback" not in r.output
    rows = strict_json_lines(out / "metrics.jsonl")  # standard JSON only
    assert rows and all(math.isfinite(row["loss"]) for row in rows)
    last = rows[-1]["step"]
    assert f"the checkpoint of step {last} is intact" in r.output
    assert json.loads((out / "trainer_state.json").read_text())["step"] == last < 20


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--steps", 3, "--warmup-steps", 10], "warmup_steps (--warmup-steps) 10 is past steps (--steps) 3"),
        (["--steps", 4, "--stop-at", 5], "stop_at (--stop-at) 5 is past steps (--steps) 4"),
    ],
    ids=["warmup", "stop-at"],
)
def test_a_step_count_past_the_runs_steps_is_refused(weighted_dir, tmp_path, flags, says):
    """A warmup longer than the run (its peak lr never reached) or a stop after its last step (it
    stops nothing) was accepted without a word."""
    out = tmp_path / "run"
    refused(cli(*train_args(weighted_dir, out, *flags)), says)
    assert not out.exists()


@pytest.mark.parametrize("error", ["cpu", "cuda"])
def test_out_of_memory_stops_the_run_on_one_line(weighted_dir, tmp_path, monkeypatch, error):
    """A batch that does not fit (the CPU allocator's RuntimeError; CUDA's OutOfMemoryError): exit 1,
    one line naming --batch-size and what to do, no traceback (it was one)."""
    import torch

    from entroweight.trainers import loop

    raised = {
        "cpu": RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"),
        "cuda": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    }[error]
    real = loop.build_model

    def too_big(*a, **kw):
        model = real(*a, **kw)

        def forward(*a, **kw):
            raise raised

        model.forward = forward
        return model

    monkeypatch.setattr(loop, "build_model", too_big)
    r = cli(*train_args(weighted_dir, tmp_path / "run", "--steps", 2))
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: out of memory on cpu with --batch-size 4") and "lower --batch-size" in line


# ---------------------------------------------------------------- train: disk full while saving


def _limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_disk_full_while_saving_leaves_no_staging(weighted_dir, tokenizer_dir, tmp_path):
    out = tmp_path / "run"
    args = train_args(weighted_dir, out, "--steps", 2, "--tokenizer", tokenizer_dir)
    # tokenizer.json (54 kB) and metrics fit; model.safetensors (~1 MB) does not: a real EFBIG
    proc = subprocess.run(
        [sys.executable, "-m", "entroweight.workflows.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limit_file_size(300_000),
    )
    assert proc.returncode == 1, proc.stderr
    assert "cannot save the checkpoint at step 2" in proc.stderr and "File too large" in proc.stderr
    assert "no checkpoint was saved" in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / ".staging").exists()
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "tokenizer.json"]
    assert np.all([math.isfinite(row["loss"]) for row in strict_json_lines(out / "metrics.jsonl")])


def test_a_config_json_without_a_checkpoint_is_not_called_one(weighted_dir, tiny_ckpt, tmp_path):
    """--out holding a config.json but no trainer_state.json: --resume could not continue it, so it is
    not advised. Another program's config.json is a user's file: refused with --overwrite too, never
    replaced. A run's own, left by a first save stopped half way, is what --overwrite starts over."""
    out = tmp_path / "run"
    out.mkdir()
    for mine in ('{"mine": 1}', "not json", "[1, 2]"):
        (out / "config.json").write_text(mine)
        for extra in ((), ("--overwrite",)):
            line = refused(cli(*train_args(weighted_dir, out, "--steps", 2, *extra)), "holds a config.json")
            assert "no training run wrote" in line and "--resume" not in line and "--overwrite" not in line
            assert sorted(p.name for p in out.iterdir()) == ["config.json"]
            assert (out / "config.json").read_text() == mine
    (out / "config.json").write_bytes((tiny_ckpt / "config.json").read_bytes())
    line = refused(cli(*train_args(weighted_dir, out, "--steps", 2)), "holds a config.json but no checkpoint")
    assert "--resume" not in line and "--overwrite" in line
    assert cli(*train_args(weighted_dir, out, "--steps", 2, "--overwrite")).exit_code == 0
    assert (out / "trainer_state.json").is_file()


def test_data_that_records_no_vocabulary_or_context_is_not_given_the_models_defaults(
    weighted_dir, tokenizer_dir, tmp_path
):
    """Rows with no stage metadata (another tool's parquet, a hub export's `data/`) record neither the
    vocabulary nor the row width: train asks for them (the model's defaults, 8k and 1024, were taken,
    exit 0), and takes the vocabulary from --tokenizer where given."""
    import pyarrow.parquet as pq

    rows = tmp_path / "rows"  # the rows as another tool writes them: no schema metadata
    rows.mkdir()
    for f in sorted(Path(weighted_dir).glob("*.parquet")):
        pq.write_table(pq.read_table(f).replace_schema_metadata(None), rows / f.name)
    out = tmp_path / "run"
    line = refused(cli(*train_args(rows, out, "--steps", 1)), "records no vocab_size or n_ctx")
    assert "set vocab_size and n_ctx in --model-config (or pass --tokenizer" in line and not out.exists()
    line = refused(
        cli(*train_args(rows, out, "--steps", 1, "--tokenizer", tokenizer_dir)), "records no n_ctx"
    )
    with_ctx = tmp_path / "tiny128.yaml"
    with_ctx.write_text("".join(f"{k}: {v}\n" for k, v in {**TINY, "n_ctx": 128}.items()))
    argv = ["train", rows, "--model-config", with_ctx, "--out", out, "--batch-size", 4, "--device", "cpu"]
    r = cli(*argv, "--steps", 1, "--tokenizer", tokenizer_dir)
    assert r.exit_code == 0, r.output
    model = json.loads((out / "config.json").read_text())["model"]
    assert (model["vocab_size"], model["n_ctx"]) == (1024, 128)  # the tokenizer's; the config's


def test_a_loss_parameter_of_another_loss_is_refused(weighted_dir, tmp_path):
    """Every loss × every other loss's parameter, given a value other than its default: refused naming
    whose it is (it changed nothing, then refused a resume as a changed setting). Its own parameters,
    and any at its default, are taken."""
    from entroweight.trainers.config import LossSettings, TrainConfig, TrainError
    from entroweight.trainers.losses import LOSSES

    other = {"normalize": "weight", "margin": 5.0, "prefix_weight": 0.3}
    # a new parameter needs a value here; shuffle_weights is a control of the data, not a loss's parameter
    # (a loss that reads no weight refuses it: tests/test_controls.py)
    assert set(other) == set(LossSettings.model_fields) - {"loss", "shuffle_weights"}
    for loss, spec in LOSSES.items():
        for name, value in other.items():
            kw = {"data": str(weighted_dir), "out": str(tmp_path / "o"), "loss": loss, name: value}
            if name in spec.options:
                TrainConfig(**kw)
                continue
            with pytest.raises(
                TrainError, match=rf"{name} \(--{name.replace('_', '-')}\) is \w+'s; --loss {loss}"
            ):
                TrainConfig(**kw)
            default = LossSettings.model_fields[name].default
            TrainConfig(**{**kw, name: default})  # the default written out: harmless
    r = cli(*train_args(weighted_dir, tmp_path / "cli", "--loss", "ce", "--margin", "5"))
    assert r.exit_code == 2 and "margin (--margin) is hard_negative's" in r.output, r.output
    assert not (tmp_path / "cli").exists()


def test_refusals_about_the_data_say_what_is_wrong_before_anything_is_written(
    tmp_path, tokenizer_dir, llama3_tokenizer, tiny_ckpt, c4_path
):
    """Data of no rows (every document rejected): refused as such (it was refused with "use fewer"
    ranks, after the run's tokenizer.json was written). Data of another tokenizer: the refusal names
    what differs, the data or --tokenizer, and advises what fits the run (new or resumed)."""
    import gzip
    import shutil

    from entroweight.transforms.train_tokenizer import corpus_texts, save_tokenizer, train_bpe

    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": "   "}\n')
    rows = tmp_path / "c4.jsonl"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        rows.write_text("".join(next(f) for _ in range(20)))
    other = tmp_path / "tok300"  # another tokenizer (with a pad)
    save_tokenizer(train_bpe(corpus_texts([str(c4_path)], max_docs=100), 300, llama3_tokenizer), other)
    for src, tok, name in ((empty, tokenizer_dir, "none"), (rows, other, "other")):
        r = cli("tokenize", src, "--tokenizer", tok, "--n-ctx", 64, "--out", tmp_path / name)
        assert r.exit_code == 0, r.output
    mc = tmp_path / "tiny.yaml"
    mc.write_text("".join(f"{k}: {v}\n" for k, v in TINY.items()))
    tiny = ("--model-config", mc, "--steps", 2, "--batch-size", 2, "--device", "cpu")
    out = tmp_path / "run"
    r = cli("train", tmp_path / "none", *tiny, "--out", out)
    refused(r, "holds no rows", "every document was rejected")
    assert not out.exists()
    line = refused(cli("train", tmp_path / "other", *tiny, "--tokenizer", tokenizer_dir, "--out", out))
    assert "drop --tokenizer" in line and "not --resume" not in line and not out.exists()
    resumed = tmp_path / "resumed"
    shutil.copytree(tiny_ckpt, resumed)
    line = refused(
        cli("train", tmp_path / "other", *tiny, "--out", resumed, "--resume"), "the data's tokenizer"
    )
    assert "--tokenizer differs" not in line


@pytest.mark.parametrize("command", ["train", "eval-bpb --unigram", "inspect"])
def test_a_quoted_glob_as_data_is_refused_as_a_glob(
    weighted_dir, tokenized_dir, tiny_ckpt, tmp_path, command
):
    """The readers of data take directories and files, not globs (the shell expands an unquoted one):
    a quoted glob was refused as "does not exist (no .stage.json); tokenize data first" (train), or
    "Path ... does not exist" (the commands whose argument click checks)."""
    glob = f"{weighted_dir}/*.parquet"
    if command == "train":
        r = cli("train", glob, "--steps", 1, "--device", "cpu", "--out", tmp_path / "run")
    elif command == "inspect":
        r = cli("inspect", glob)
    else:
        r = cli("eval-bpb", tiny_ckpt, "--unigram", glob)
    line = refused(r, "does not exist; as a glob it is not expanded here")
    assert glob in line and not (tmp_path / "run").exists()
    # a directory whose name holds glob characters is read as named, through a `..` too
    import shutil

    odd = shutil.copytree(tokenized_dir, tmp_path / "exp[1]")
    r = cli("inspect", f"{tmp_path}/nowhere/../exp[1]")
    assert r.exit_code == 0, r.output
    assert cli("inspect", odd).exit_code == 0


def test_the_same_train_command_again_continues_its_run(tokenized_dir, weighted_dir, tmp_path):
    """A scheduler's retry, or the same command after a kill, continues the run its --out holds, as
    every stage's rerun does (it was refused "already holds a checkpoint; pass --resume"); at its last
    step it has nothing to train, exit 0, nothing rewritten. Other settings are still refused."""
    out = tmp_path / "run"
    args = train_args(tokenized_dir, out, "--steps", 4, "--seed", 1)
    r = cli(*args, "--stop-at", 2)  # as a kill after the checkpoint of step 2 leaves it
    assert r.exit_code == 0, r.output
    r = cli(*args)
    assert r.exit_code == 0 and "holds this run (the same settings) at step 2: continuing it" in r.output
    assert "trained 4 steps" in r.output, r.output
    reference = tmp_path / "reference"  # the same run without a stop: the same weights
    assert cli(*train_args(tokenized_dir, reference, "--steps", 4, "--seed", 1)).exit_code == 0
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    r = cli(*args)
    assert r.exit_code == 0 and "nothing to train" in r.output, r.output
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    for other in (["--seed", 2], ["--lr", "0.01"]):
        r = cli(*train_args(tokenized_dir, out, "--steps", 4, "--seed", 1, *other))
        refused(r, "already holds a checkpoint; pass --resume to continue it, or another --out")
    refused(
        cli(*args, "--resume", "--overwrite"), "continues the checkpoint, overwrite (--overwrite) replaces"
    )
    # data of other tools (parquet no stage wrote, known by its size alone): not told to be the same
    foreign = train_args(weighted_dir, tmp_path / "foreign", "--steps", 4)
    assert cli(*foreign, "--stop-at", 2).exit_code == 0
    refused(cli(*foreign), "already holds a checkpoint; pass --resume")
    # a run continued under other settings (`train_history`): the same command is not this run
    r = cli(*args, "--steps", 6, "--lr", "0.001", "--resume", "--allow-config-change", "--stop-at", 5)
    assert r.exit_code == 0, r.output
    refused(cli(*args, "--steps", 6, "--lr", "0.001"), "already holds a checkpoint; pass --resume")


def test_the_same_train_command_on_other_data_at_the_same_path_is_refused(
    weighted_dir, tokenized_dir, tmp_path
):
    """The data's shards are part of what makes the run: the same command on a directory rewritten
    since is refused as another run's checkpoint (it said "continuing it", then refused --resume)."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(weighted_dir, data)
    args = train_args(data, tmp_path / "run", "--steps", 4)
    assert cli(*args, "--stop-at", 2).exit_code == 0
    shutil.rmtree(data)
    shutil.copytree(tokenized_dir, data)  # other shards under the same path
    r = cli(*args)
    refused(r, "already holds a checkpoint; pass --resume")
    assert "continuing it" not in r.output
    # continued on it when asked: config.json records the change, and the same command is refused
    assert cli(*args, "--resume", "--allow-config-change", "--stop-at", 3).exit_code == 0
    history = json.loads((tmp_path / "run" / "config.json").read_text())["train_history"]
    assert [(h["step"], h.get("changed")) for h in history] == [(0, None), (2, ["data"])]
    refused(cli(*args), "already holds a checkpoint; pass --resume")


def test_the_same_train_command_names_its_tokenizer_any_way(
    tokenized_dir, tokenizer_dir, tmp_path, monkeypatch
):
    """The tokenizer is one by its content: named relatively from one directory, then absolutely (its
    file) from another, the same command continues (config.json keeps the path as typed)."""
    out = tmp_path / "run"
    monkeypatch.chdir(tokenizer_dir.parent)
    args = train_args(tokenized_dir, out, "--steps", 4)
    assert cli(*args, "--tokenizer", tokenizer_dir.name, "--stop-at", 2).exit_code == 0
    monkeypatch.chdir(tmp_path)
    r = cli(*args, "--tokenizer", tokenizer_dir / "tokenizer.json")
    assert r.exit_code == 0 and "continuing it" in r.output, r.output
