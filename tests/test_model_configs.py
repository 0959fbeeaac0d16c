# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""workflows/configs: every config builds (the write-up's sizes checked); `entroweight train --model
mixer|estimator|autoencoder --model-config tiny-*.yaml` with every loss; `eval-quant` and the amortized
bits of `eval-bpb` on a tiny estimator checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from model_free import IdMod
from test_trainer_fixtures import one_thread, weighted_dir  # noqa: F401 - fixtures

from entroweight.models import build_model
from entroweight.scorers import register
from entroweight.workflows.cli.main import main

CONFIGS = Path(__file__).resolve().parent.parent / "workflows" / "configs"
KINDS = ("llama", "mixer", "estimator", "autoencoder")


def kind_of(path: Path) -> str:
    """tiny-estimator.yaml, estimator-mixer.yaml -> estimator."""
    return next(k for k in KINDS if path.stem.removeprefix("tiny-").split("-")[0] == k)


def params(m) -> int:
    return sum(p.numel() for p in m.parameters())


def test_every_config_builds():
    paths = sorted(CONFIGS.glob("*.yaml"))
    assert {f"tiny-{k}.yaml" for k in KINDS} <= {p.name for p in paths}
    for path in paths:
        cfg = yaml.safe_load(path.read_text())
        cfg["vocab_size"] = 256  # a small vocabulary keeps this fast; the sizes below are the stacks'
        cfg.setdefault("n_ctx", 128)  # tiny configs take n_ctx from the data
        with torch.device("meta"):  # shapes only, no init cost for the 100M-parameter ones
            m = build_model(kind_of(path), cfg)
        assert params(m) > 0, path.name
        if path.stem.startswith("tiny-"):
            assert params(m) < 1_000_000, path.name  # trains in seconds on CPU
            real = build_model(kind_of(path), cfg)
            assert real(torch.randint(0, 256, (2, 128))).shape == (2, 128, 256)


def test_write_up_sizes():
    load = lambda name: yaml.safe_load((CONFIGS / name).read_text())  # noqa: E731
    with torch.device("meta"):
        est = build_model("estimator", load("estimator.yaml"))
        llama = build_model("llama", load("llama.yaml"))
        mixer = build_model("mixer", load("mixer.yaml"))
    assert est.embed_dim == 64 and est.config.n_ctx == 1024
    assert (est.encoder.config.d_model, est.encoder.config.n_layers) == (256, 16)
    assert (est.decoder.config.d_model, est.decoder.config.n_layers) == (512, 16)
    c = llama.config
    assert (c.d_model, c.n_layers, c.n_heads, c.d_ff, c.vocab_size, c.n_ctx) == (512, 16, 4, 2048, 8000, 1024)
    assert (mixer.config.d_model, mixer.config.n_layers) == (512, 16)


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res


LOSS_ARGS = {
    "ce": [],
    "weighted_ce": [],
    "rescaled": [],
    "hard_negative": ["--margin", "2.0"],
    "prefix_smooth": ["--prefix-weight", "0.1"],
    # tfree_bce trains a T-FREE head only (--model tfree): not these kinds
}


@pytest.mark.parametrize("kind", ["mixer", "estimator", "autoencoder"])
@pytest.mark.parametrize("loss", list(LOSS_ARGS))
def test_cli_trains_each_kind_with_each_loss(kind, loss, weighted_dir, tokenizer_dir, tmp_path):
    out = tmp_path / "ck"
    res = cli(
        "train", weighted_dir, "--model", kind, "--model-config", CONFIGS / f"tiny-{kind}.yaml",
        "--loss", loss, *LOSS_ARGS[loss], "--tokenizer", tokenizer_dir, "--out", out,
        "--steps", 2, "--batch-size", 4, "--log-every", 1, "--device", "cpu",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["kind"] == kind and cfg["loss"] == loss and cfg["model"]["vocab_size"] == 1024
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


@pytest.fixture(scope="module")
def tiny_estimator(weighted_dir, tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_est")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    res = cli(
        "train", weighted_dir, "--model", "estimator", "--model-config", CONFIGS / "tiny-estimator.yaml",
        "--tokenizer", tokenizer_dir, "--out", out, "--steps", 30, "--batch-size", 8, "--lr", 3e-3,
        "--device", "cpu", "--overwrite",
    )  # fmt: skip
    torch.set_num_threads(before)
    assert res.exit_code == 0, res.output
    return out


def test_eval_quant(tiny_estimator, tokenized_dir):
    res = cli("eval-quant", tiny_estimator, "--data", tokenized_dir, "--max-sequences", 64, "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.output)
    assert r["sequences"] == 64 and r["embed_dim"] == 8 and r["kind"] == "estimator"
    for fmt in ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8"):
        q = r[fmt]
        assert math.isfinite(q["loss"]) and q["bpb"] == pytest.approx(q["embed_bpb"] + q["token_bpb"])
        assert abs(q["delta"]) < 0.5, (fmt, q)  # QAT-trained: casting barely moves the loss
    assert r["float32"]["delta"] == 0
    # 8-bit formats pay 8 values · 8 bits per sequence (+ a float32 scale for int8)
    assert r["float8_e4m3fn"]["embed_bpb"] == pytest.approx(64 * 8 * 8 / r["bytes"])
    assert r["int8"]["embed_bpb"] == pytest.approx(64 * (8 * 8 + 32) / r["bytes"])
    assert r["float32"]["embed_bpb"] == pytest.approx(4 * r["float8_e5m2"]["embed_bpb"])
    # no format to compare: refused, not a table of float32 alone
    res = cli("eval-quant", tiny_estimator, "--data", tokenized_dir, "--formats", " , ")
    assert res.exit_code == 2 and "--formats names no format" in res.output
    # the table form
    res = cli("eval-quant", tiny_estimator, "--data", tokenized_dir, "--max-sequences", 16)
    assert res.exit_code == 0 and "float8_e4m3fn" in res.output and "bpb" in res.output


def test_eval_quant_refusals(tiny_estimator, tokenized_dir, tokenizer_dir, c4_path, tmp_path):
    res = cli("eval-quant", tiny_estimator, "--data", tokenized_dir, "--formats", "float4")
    assert res.exit_code == 2 and "unknown --formats float4" in res.output
    llama = tmp_path / "llama"
    res = cli(
        "train", tokenized_dir, "--model", "llama", "--model-config", CONFIGS / "tiny-llama.yaml",
        "--out", llama, "--steps", 1, "--batch-size", 2, "--device", "cpu",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    res = cli("eval-quant", llama, "--data", tokenized_dir)
    assert res.exit_code == 2 and "no embedding to quantize" in res.output
    # eval-bpb's --embed-format on a model with no embedding: refused (it was ignored without a word)
    res = cli("eval-bpb", llama, "--max-bytes", 2000, "--embed-format", "int8")
    assert res.exit_code == 2 and "--embed-format is the format of an estimator" in res.output, res.output
    # rows wider than the estimator reads: one line (a traceback from the model's first batch before)
    from entroweight.pipelines import run_stage
    from entroweight.pipelines.tokenize import TokenizeStage

    wide = tmp_path / "wide"
    run_stage(
        TokenizeStage([str(c4_path)], str(tokenizer_dir), n_ctx=256, shard_docs=1000), wide, progress=False
    )
    res = cli("eval-quant", tiny_estimator, "--data", wide)
    assert res.exit_code == 2 and "holds rows of 256 tokens (n_ctx), longer than" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1


def test_eval_bpb_reports_amortized_bits_for_estimators(tiny_estimator):
    res = cli("eval-bpb", tiny_estimator, "--max-bytes", 4000, "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.output)
    assert r["amortized"] and r["embed_format"] == "float8_e4m3fn" and r["stride"] == r["n_ctx"] - 1
    assert r["bpb"] == pytest.approx(r["token_bpb"] + r["embed_bpb"])
    assert r["embed_bpb"] == pytest.approx(r["windows"] * 8 * 8 / r["bytes"])
    assert r["token_bpb"] == pytest.approx(r["nats"] / math.log(2) / r["bytes"])
    res = cli("eval-bpb", tiny_estimator, "--max-bytes", 4000)
    assert res.exit_code == 0 and "amortized: embedding" in res.output
    res = cli("eval-bpb", tiny_estimator, "--max-bytes", 4000, "--stride", 129)
    assert res.exit_code == 2 and "--stride must be in 1..n_ctx (128)" in res.output


def test_eval_quant_refuses_a_shard_that_differs_from_its_manifest(tiny_estimator, tokenized_dir, tmp_path):
    """eval-quant reads the tokens checked against their manifests, as every reader (exit 2, naming it)."""
    import shutil

    data = tmp_path / "tokens"
    shutil.copytree(tokenized_dir, data)
    shard = sorted(data.glob("part-*.parquet"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 1
    shard.write_bytes(bytes(raw))
    res = cli("eval-quant", tiny_estimator, "--data", data, "--max-sequences", 16)
    assert res.exit_code == 2 and shard.name in res.output and "differ from its manifest" in res.output, (
        res.output
    )
    assert "Traceback" not in res.output


def test_eval_quant_refuses_a_file_that_does_not_decode(tiny_estimator, tokenized_dir, tmp_path):
    raw = bytearray(sorted(tokenized_dir.glob("part-*.parquet"))[0].read_bytes())
    for i in range(64, len(raw) // 2):
        raw[i] ^= 0x5A
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(raw))
    res = cli("eval-quant", tiny_estimator, "--data", bad, "--max-sequences", 16)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output


@pytest.mark.parametrize(
    "args",
    [
        ["eval-bpb", "--text", ""],  # was: the bundled WikiText-2 measured instead, exit 0
        ["eval-bpb", "--unigram", ""],  # was: no baseline, silently
        ["eval-bpb", "--tokenizer", ""],  # was: a tokenizer.json in the working directory, if any
        ["eval-quant", "--data", ""],  # was: "." read as the data
    ],
    ids=lambda a: f"{a[0]}{a[1]}",
)
def test_an_empty_path_option_is_refused_not_defaulted(tiny_estimator, tmp_path, monkeypatch, args):
    """An unset variable (`--text "$HELDOUT"`) is refused: never the default, nor the working directory."""
    (tmp_path / "tokenizer.json").write_text("{}")  # what "" would have found
    monkeypatch.chdir(tmp_path)
    res = cli(args[0], tiny_estimator, *args[1:])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and ("is empty" in res.output or "does not exist" in res.output), (
        res.output
    )


# every command that reads several data inputs of one role (click: DATA... or a repeatable --data)
DATA_TWICE = {
    "train": lambda ckpt, a, b, out: ["train", a, b, "--steps", 1, "--batch-size", 2, "--out", out],
    "eval-quant": lambda ckpt, a, b, out: ["eval-quant", ckpt, "--data", a, "--data", b],
}


def test_every_command_with_repeatable_data_has_a_row():
    def repeats_data(c):
        return any(p.name == "data" and (p.nargs == -1 or getattr(p, "multiple", False)) for p in c.params)

    assert sorted(n for n, c in main.commands.items() if repeats_data(c)) == sorted(DATA_TWICE)


@pytest.mark.parametrize("command", sorted(DATA_TWICE))
@pytest.mark.parametrize("how", ["same directory twice", "a directory and a file in it"])
def test_data_given_twice_is_refused_not_read_twice(tiny_estimator, tokenized_dir, tmp_path, command, how):
    """Rule: every row is read once. A directory given twice, or with one of its files, was read twice
    (train trained on each row twice, eval-quant counted 1,800 sequences of 900); refused, exit 2."""
    b = tokenized_dir if how.startswith("same") else sorted(tokenized_dir.glob("part-*.parquet"))[0]
    res = cli(*DATA_TWICE[command](tiny_estimator, tokenized_dir, b, tmp_path / "out"))
    assert res.exit_code == 2 and "would be read twice" in res.output, res.output
    assert not (tmp_path / "out").exists()


class IdModFive(IdMod):  # a second model-free scoring of the same tokens
    name = "test_id_mod_five"
    modulus = 5


class IdModSeven(IdMod):
    name = "test_id_mod_seven"


register(IdModFive)
register(IdModSeven)


@pytest.fixture(scope="module")
def lineage(tokenized_dir, tmp_path_factory):
    """tokens -> two scorings of them -> the first weighed again: stage outputs whose shards record
    what they were made from."""
    from entroweight.pipelines import run_stage
    from entroweight.pipelines.score import ScoreStage
    from entroweight.pipelines.weigh import WeighStage
    from entroweight.transforms.weigh import WeighConfig

    root = tmp_path_factory.mktemp("lineage")
    for name in ("test_id_mod_seven", "test_id_mod_five"):
        run_stage(ScoreStage(tokenized_dir, name, {}), root / name, progress=False)
    run_stage(
        WeighStage(root / "test_id_mod_seven", WeighConfig(invert=True)), root / "weighed", progress=False
    )
    return {
        "tokens": tokenized_dir,
        **{k: root / k for k in ("test_id_mod_seven", "test_id_mod_five", "weighed")},
    }


@pytest.mark.parametrize("command", sorted(DATA_TWICE))
@pytest.mark.parametrize(
    "a, b",
    [
        ("tokens", "test_id_mod_seven"),  # one made from the other
        ("test_id_mod_seven", "weighed"),
        ("tokens", "weighed"),  # two stages apart
        ("test_id_mod_seven", "test_id_mod_five"),  # both from the same shards
    ],
)
def test_the_same_documents_under_other_files_are_refused(tiny_estimator, lineage, tmp_path, command, a, b):
    """Rule: every document is read once, whatever files hold it. Tokens and their scores, or two
    scorings of the same tokens, were trained on as different data: each document twice. Refused
    by the shards' lineage (their manifests), exit 2, nothing written."""
    res = cli(*DATA_TWICE[command](tiny_estimator, lineage[a], lineage[b], tmp_path / "out"))
    assert res.exit_code == 2 and "hold the same documents" in res.output, res.output
    assert f"{lineage[a]} and {lineage[b]}" in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_a_model_config_file_as_json_writes_it_is_read():
    """`"norm_eps": 1e-05` (json.dump's spelling, our own config.json's) is a string to YAML 1.1: it was
    refused as "not a number". A number in a string is taken; a non-finite one is not."""
    from entroweight.models import config_of

    assert config_of("llama", {"norm_eps": "1e-05"}).norm_eps == 1e-05
    for bad in ("inf", "nan", "x"):
        with pytest.raises(ValueError, match="not a finite number"):
            config_of("llama", {"norm_eps": bad})
