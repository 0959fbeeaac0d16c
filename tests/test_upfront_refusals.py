"""Refusals that came as raw tracebacks or late (issue 26): each now exit 2, one line naming what is
wrong, before any output. On the loopback S3 server (tests/s3server.py) where it applies."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")


def cli(args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "entroweight.workflows.cli", *args],
        capture_output=True,
        text=True,
        env=env if env is not None else os.environ.copy(),
        timeout=300,
    )


def no_credentials() -> dict:
    """This environment without any AWS credential (and no config file to find one in)."""
    env = {k: v for k, v in os.environ.items() if k not in AWS_VARS}
    env["AWS_SHARED_CREDENTIALS_FILE"] = env["AWS_CONFIG_FILE"] = os.devnull
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    return env


def _cases():
    """(id, argv builder(tmp, bucket, data), env builder, what the line must name)."""
    return [
        (
            "s3-no-credentials",
            lambda t, b, d: ["tokenize", d["src"], "--tokenizer", d["tok"], "--out", f"{b}/out"],
            no_credentials,
            "cannot write to --out",
        ),
        (
            "s3-empty-key-part",
            lambda t, b, d: ["tokenize", d["src"], "--tokenizer", d["tok"], "--out", f"{b}//out"],
            None,
            "empty part between slashes",
        ),
        # a store keeps '.' and '..' as literal key parts: `--out INPUT/.` wrote inside the input
        *[
            (
                f"s3-{name}-part",
                lambda t, b, d, out=out: ["tokenize", d["src"], "--tokenizer", d["tok"], "--out", out(b)],
                None,
                "has a '.' or '..' part",
            )
            for name, out in (("dot", lambda b: f"{b}/out/."),)  # each form: the parser's test below
        ],
        # a store read (not written) without credentials: its client's traceback, exit 1
        *[
            (
                f"s3-{name}-no-credentials",
                argv,
                no_credentials,
                "cannot reach object storage: NoCredentialsError",
            )
            for name, argv in (
                (
                    "source",
                    lambda t, b, d: [
                        "tokenize",
                        f"{b}/src.jsonl",
                        "--tokenizer",
                        d["tok"],
                        "--out",
                        str(t / "o"),
                    ],
                ),
                (
                    "train-tokenizer-flag",
                    lambda t, b, d: ["train", d["tokens"], "--tokenizer", f"{b}/tok", "--out", str(t / "o")],
                ),
            )
        ],
        (  # a store's glob that may match inside --out: the rerun read the first run's output
            "s3-glob-may-match-out",
            lambda t, b, d: ["train-tokenizer", f"{b}/src/**", "--out", f"{b}/src/tk"],
            None,
            "may match files",
        ),
        (
            "export-data-missing-bucket",
            lambda t, b, d: [
                "export-data",
                d["tokens"],
                "--format",
                "hf",
                "--out",
                "s3://no-such-bucket-ew/export",
            ],
            None,
            "no-such-bucket-ew",
        ),
        (
            "train-out-missing-bucket",
            lambda t, b, d: ["train", d["tokens"], "--steps", "2", "--out", "s3://no-such-bucket-ew/run"],
            None,
            "no-such-bucket-ew",
        ),
        (
            "stage-json-not-json",
            lambda t, b, d: ["tokenize", d["src"], "--tokenizer", d["tok"], "--out", d["bad"]],
            None,
            ".stage.json is not a stage record",
        ),
    ]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_refused_up_front(case, tmp_path, s3_bucket, c4_60, tokenizer_dir, tokenized_dir):
    name, argv, env, named = case
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".stage.json").write_text("not json {")
    data = {"src": str(c4_60), "tok": str(tokenizer_dir), "tokens": str(tokenized_dir), "bad": str(bad)}
    before = sorted(p.name for p in bad.iterdir())
    r = cli(argv(tmp_path, s3_bucket, data), env() if env else None)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], r.stderr
    assert sorted(p.name for p in bad.iterdir()) == before
    import fsspec

    s3 = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
    assert s3.find(s3_bucket) == []  # nothing written to the bucket


@pytest.mark.parametrize("url", ["s3://b/out/.", "s3://b/x/../out", "s3://b/./out", "gs://b/out/.."])
def test_a_dot_part_of_a_url_is_refused_by_the_one_parser(url):
    """Every location a command takes goes through storage.path (the subprocess case above shows a
    command's refusal): a store keeps '.' and '..' as literal key parts."""
    from entroweight import storage

    with pytest.raises(storage.StorageError, match=r"has a '\.' or '\.\.' part"):
        storage.path(url)
