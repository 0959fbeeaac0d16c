# ruff: noqa: F811 - pytest fixtures imported from test_weighted_inputs
"""A stage's bookkeeping (`.shards.json`, the shard manifests) is what shows a directory complete; every
reader trusts nothing it cannot show (schemas/datadir.py `DataDir`, the one place they all read through).

- A directory without `.shards.json` (copied without its dotfiles) cannot show that it is complete:
  every reader that needs the whole of it refuses it (exit 2, one line naming the file, nothing
  written), as `verify` does. Before, weigh, export-data, compare, score and train read what was left
  as the whole (a copy missing a shard too: 30 of 40 documents, exit 0, and `verify` of weigh's output
  said ok). The readers of a sample (`inspect`, `--quantiles-from`) read it, and `inspect` says that
  what is missing is unknown.
- A manifest or `.shards.json` that does not parse is refused by every reader (exit 2, one line naming
  the file), where most ended in a traceback, and by a stage rerun into that directory, which with
  --overwrite redoes what it committed.
- score and weigh record where they read absolutely (`pipelines/weighted.py` `part_locations`, as
  tokenize records its sources), so `verify` and a rerun from another working directory find the same
  inputs: before, both resolved the relative paths against the new directory.

The reading commands come from the click group: each has cases in READERS or a reason in EXEMPT, so a new
command fails `test_every_command_reads_through_the_checks_or_says_why_not`.
"""

from __future__ import annotations

import os
import shutil

import pytest
from click.testing import CliRunner
from test_weighted_inputs import model, scored, tokens, weighed  # noqa: F401 - fixtures

from entroweight.pipelines.verify import verify_dir
from entroweight.schemas.datadir import DataDir
from entroweight.schemas.manifest import SHARDS_FILE, STAGE_FILE, manifest_name
from entroweight.workflows.cli.main import main

SCORE = ["--scorer", "causal_loss", "--dtype", "fp32"]  # + --model: the config `scored` was made with

# case -> argv of (damaged directory, a sound weighted directory, the tokens, the model, --out)
READERS = {
    "inspect": lambda d, good, tokens, model, out: ["inspect", d],
    "compare A": lambda d, good, tokens, model, out: ["compare", d, good],
    "compare B": lambda d, good, tokens, model, out: ["compare", good, d],
    "export-data": lambda d, good, tokens, model, out: ["export-data", d, "--format", "hf", "--out", out],
    "weigh": lambda d, good, tokens, model, out: ["weigh", d, "--out", out],
    "weigh --quantiles-from": lambda d, good, tokens, model, out: [
        "weigh",
        good,
        "--weighting",
        "quantile",
        "--quantiles-from",
        d,
        "--out",
        out,
    ],  # fmt: skip
    "score": lambda d, good, tokens, model, out: ["score", d, *SCORE, "--model", model, "--out", out],
    "score --quantiles-from": lambda d, good, tokens, model, out: [
        "score",
        tokens,
        *SCORE,
        "--model",
        model,
        "--weighting",
        "quantile",
        "--quantiles-from",
        d,
        "--out",
        out,
    ],  # fmt: skip
    "train": lambda d, good, tokens, model, out: ["train", d, "--steps", "1", "--out", out],
    "synthesize": lambda d, good, tokens, model, out: [
        "synthesize",
        "--model",
        model,
        "--prefix-from",
        d,
        "--prefix-tokens",
        "2",
        "--sequences",
        "1",
        "--n-ctx",
        "8",
        "--out",
        out,
    ],  # fmt: skip
}
# a reader of what there is: a directory whose completeness is unknown is read (--quantiles-from,
# read as a sample until 2026-11-28, reads its reference whole: tests/test_read_checks.py)
PARTIAL = {"inspect"}
EXEMPT = {
    "verify": "reports every problem itself, exit 1 (tests/test_verify.py)",
    "eval-bpb": "--unigram reads data through trainers/data.py's data_files, as train does",
    "eval-quant": "--data reads data through trainers/data.py's data_files, as train does",
    "report": "reads a workflow run, whose runner verifies every data step",
    "run": "a workflow: its steps are these commands' stages",
    "tokenize": "reads raw documents",
    "train-tokenizer": "reads raw documents",
    "evaluate": "reads a checkpoint",
    "export-hf": "reads a checkpoint",
}


def test_every_command_reads_through_the_checks_or_says_why_not():
    assert {case.split()[0] for case in READERS} | set(EXEMPT) == set(main.commands)


def no_registry(d):
    """The hostile case: a copy without its dotfiles' registry, and one shard short."""
    part = DataDir(d).parts[1]
    (d / SHARDS_FILE).unlink()
    (d / manifest_name(part.manifest.shard)).unlink()
    (d / part.name).unlink()
    return SHARDS_FILE


def bad_manifest(d):
    name = manifest_name(DataDir(d).parts[1].manifest.shard)
    (d / name).write_text("{not json")
    return name


def counts_off(d):
    """A manifest edited so that its counts do not add up (a string number is read as the number)."""
    import json

    name = manifest_name(DataDir(d).parts[1].manifest.shard)
    m = json.loads((d / name).read_text())
    (d / name).write_text(json.dumps({**m, "docs_out": str(m["docs_out"] + 10)}))
    return name


def carried_counts_off(d):
    """A manifest whose counts of an earlier stage (tokenize's, carried in its lineage) were edited."""
    import json

    name = manifest_name(DataDir(d).parts[1].manifest.shard)
    m = json.loads((d / name).read_text())
    m["extra"]["upstream"][0]["docs_out"] += 3
    (d / name).write_text(json.dumps(m))
    return name


def bad_registry(d):
    (d / SHARDS_FILE).write_text("{not json")
    return SHARDS_FILE


def registry_not_a_mapping(d):
    (d / SHARDS_FILE).write_text('["part-00000"]')
    return SHARDS_FILE


def no_stage_record(d):
    (d / STAGE_FILE).unlink()
    return STAGE_FILE


DAMAGES = {
    "no registry": no_registry,
    "no stage record": no_stage_record,  # not other tools' data, which train reads as it is
    "manifest does not parse": bad_manifest,
    "manifest counts do not add up": counts_off,  # an impossible count carried into weigh's and the card
    "carried counts do not add up": carried_counts_off,
    "registry does not parse": bad_registry,
    "registry not a mapping": registry_not_a_mapping,
}


def damaged(src, dst, damage: str):
    shutil.copytree(src, dst)
    return dst, DAMAGES[damage](dst)


def invoke(argv):
    return CliRunner().invoke(main, [str(a) for a in argv])


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("case", sorted(READERS))
def test_every_reader_refuses_a_directory_it_cannot_show_whole(
    case,
    damage,
    scored,
    tokens,
    model,
    tmp_path,
):
    d, name = damaged(scored, tmp_path / "damaged", damage)
    out = tmp_path / "out"
    r = invoke(READERS[case](d, scored, tokens, model, out))
    if damage == "no registry" and case in PARTIAL:  # a sample of what is there
        assert r.exit_code == 0, r.output
        if case == "inspect":
            assert f"unknown: {d} has no {SHARDS_FILE}" in r.output, r.output
        return
    assert r.exit_code == 2, (r.output, r.exception)
    line = r.output.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert (
        f"{d}/{name}" in line
        or (name == SHARDS_FILE and f"{d} has no {SHARDS_FILE}" in line)
        or (
            name == STAGE_FILE
            and f"{d} holds a stage's shards whose record is gone (no {STAGE_FILE})" in line
        )
    ), line
    assert not out.exists() or not any(out.iterdir()), "output written before the refusal"


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("which", ["scored", "weighed"])
def test_verify_finds_every_damage_the_readers_refuse(which, damage, scored, weighed, tmp_path):
    """`verify` is where a user is sent by every refusal above: what a reader refuses, it reports
    (exit 1), naming the file, by the same rules (before, an edited count carried from the stages
    before passed `verify` while every reader refused it)."""
    d, name = damaged({"scored": scored, "weighed": weighed}[which], tmp_path / "damaged", damage)
    r = invoke(["verify", d])
    assert r.exit_code == 1, r.output
    assert name in r.output or (name == STAGE_FILE and "no .stage.json" in r.output), r.output


STAGES = {  # stage -> (its input, its committed output, its argv but --out)
    "score": lambda tokens, scored, weighed, model: (
        scored,
        ["score", tokens, *SCORE, "--model", model],
    ),  # fmt: skip
    "weigh": lambda tokens, scored, weighed, model: (weighed, ["weigh", scored, "--weight-dtype", "uint8"]),
}


@pytest.mark.parametrize(
    "damage", ["manifest does not parse", "registry does not parse", "registry not a mapping"]
)
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_rerun_refuses_its_damaged_output_and_overwrite_redoes_it(
    stage,
    damage,
    tokens,
    scored,
    weighed,
    model,
    tmp_path,
):
    done, argv = STAGES[stage](tokens, scored, weighed, model)
    d, name = damaged(done, tmp_path / "out", damage)
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    r = invoke([*argv, "--out", d])
    assert r.exit_code == 2, (r.output, r.exception)
    line = r.output.strip()
    assert "\n" not in line and f"{d}/{name}" in line and "--overwrite" in line, line
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == before  # nothing touched
    r = invoke([*argv, "--out", d, "--overwrite"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert verify_dir(d) == []
    shas = {p.name: p.manifest.output_sha256 for p in DataDir(d).parts}
    assert shas == {p.name: p.manifest.output_sha256 for p in DataDir(done).parts}  # the same bytes


def test_a_lost_registry_is_planned_again_by_a_rerun(tokens, scored, model, tmp_path):
    """The refusal says "rerun the command that writes it": the rerun finds the committed shards, redoes
    the missing one and writes the registry again."""
    d, _ = damaged(scored, tmp_path / "out", "no registry")
    r = invoke(["score", tokens, *SCORE, "--model", model, "--out", d])
    assert r.exit_code == 0 and "1 shard(s) run" in r.output, r.output
    assert verify_dir(d) == [] and not DataDir(d).missing


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_inputs_are_recorded_absolutely_whatever_the_working_directory(
    stage,
    tokens,
    scored,
    weighed,
    model,
    tmp_path,
    monkeypatch,
):
    """Run from the input's parent with a relative path, then verify and rerun from elsewhere. Before,
    score and weigh recorded `DIR/part-….parquet` as typed: verify from another directory checked (or
    skipped) the wrong input, and a rerun refused "shards of inputs this run does not read"."""
    _, argv = STAGES[stage](tokens, scored, weighed, model)
    src = argv[1]
    monkeypatch.chdir(src.parent)
    out = tmp_path / "out"
    r = invoke([argv[0], src.name, *argv[2:], "--out", out])
    assert r.exit_code == 0, (r.output, r.exception)
    uris = [i.uri for m in DataDir(out).manifests for i in m.inputs]
    keys = list(DataDir(out).registry)
    assert uris and all(os.path.isabs(u) and u.startswith(str(src.resolve())) for u in uris), uris
    assert all(os.path.isabs(k) for k in keys), keys
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert verify_dir(out) == []
    r = invoke([*argv, "--out", out])
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # the size kept: only the sha256 tells it
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        "a shard's bytes changed",
        "a rejects file removed",
        "a manifest's count edited",
        "a carried count edited",
    ],
)
@pytest.mark.parametrize("stage", ["tokenize", *sorted(STAGES)])
def test_overwrite_redoes_a_shard_whose_files_changed_since_its_manifest(
    stage, damage, tokens, scored, weighed, model, tokenizer_dir, c4_path, tmp_path
):
    """`verify`'s advice for a shard whose bytes no longer match its manifest, whose rejects file is
    gone, or whose manifest's counts do not add up ("rerun with --overwrite"), and every reader's for a
    damaged shard, redoes that shard: a rerun with --overwrite checks the committed shards' sha256 and
    counts and plans a changed one as never done. It said "nothing to do, all up to date", and
    `verify` still failed. A rerun without --overwrite still trusts the listing (no shard read)."""
    if stage == "tokenize":  # its own output, with a rejects file in each shard
        import gzip

        src = tmp_path / "c4.jsonl"
        with gzip.open(c4_path, "rt", encoding="utf-8") as f:
            lines = [next(f) for _ in range(12)]
        src.write_text("".join(line if i % 4 else "not json\n" for i, line in enumerate(lines)))
        argv = ["tokenize", src, "--tokenizer", tokenizer_dir, "--n-ctx", 32, "--shard-docs", 6]
        done = tmp_path / "done"
        assert invoke([*argv, "--out", done]).exit_code == 0
    else:
        done, argv = STAGES[stage](tokens, scored, weighed, model)
    d = tmp_path / "out"
    shutil.copytree(done, d)
    part = DataDir(d).parts[-1].manifest  # the last: a streamed input redoes its shards from the damaged one
    if damage == "a rejects file removed":
        if not part.rejects_file:
            pytest.skip(f"{stage}'s output here rejects nothing")
        (d / part.rejects_file).unlink()
    elif damage == "a manifest's count edited":
        import json

        path = d / manifest_name(part.shard)
        path.write_text(json.dumps({**json.loads(path.read_text()), "docs_in": part.docs_in + 1}))
    elif damage == "a carried count edited":
        if stage == "tokenize":
            pytest.skip("tokenize is the first stage: it carries no counts")
        carried_counts_off(d)
    else:
        _flip_a_byte(d / part.output)
    assert verify_dir(d) != []
    r = invoke([*argv, "--out", d])
    if damage == "a rejects file removed":  # seen in the listing: redone (it said "up to date")
        assert r.exit_code == 0 and "1 shard(s) run" in r.output, r.output
    elif "count edited" in damage:  # refused as every reader refuses it, naming it
        assert r.exit_code == 2 and "its counts do not add up" in r.output and "--overwrite" in r.output
    else:
        assert r.exit_code == 0 and "up to date" in r.output, r.output  # trusted: no shard read
    r = invoke([*argv, "--out", d, "--overwrite"])
    if damage != "a rejects file removed":  # (redone by the plain rerun above)
        assert r.exit_code == 0 and "1 shard(s) run" in r.output, r.output
    assert verify_dir(d) == []
    want = {p.name: p.read_bytes() for p in done.rglob("*.parquet")}
    assert {p.name: p.read_bytes() for p in d.rglob("*.parquet")} == want
