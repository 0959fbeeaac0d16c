"""The synthesize stage: sequences drawn from a teacher causal LM, scored with their exact entropy.

A corpus of known entropy: each row is drawn by ancestral sampling from a teacher (one of our llama
checkpoints, or any Hugging Face causal LM, a .gguf file included) at a stated temperature, and its
values are the truth, each token's conditional entropy H_t = −Σ p log p of the distribution it was
drawn from (nats), with its surprisal −log p(x_t) beside it (`surprisal`). The output is weighted
sequences in the teacher's tokenizer, the table `score` writes (weighed by the same path,
`pipelines.weighted.WeightedShardWriter`), so `weigh` gives oracle weights, `compare` any
estimator's agreement with the truth, and `train`, `inspect`, `verify`, `export-data` read it as
they read `score`'s output.

Its input is a range of sequence numbers: shard k draws sequences [k·S, (k+1)·S) of `sequences`
(S = `shard_docs`), sequence i from its own seed (run seed, i) (scorers/teacher.py `uniforms`), so
the output does not depend on the engine, and a rerun or a larger `sequences` only draws what is
missing. A row is `n_ctx` wide, left-padded: its context (one pad, or a real document's first
`prefix_tokens` tokens after the pads: excluded, they carry no truth) and then the tokens drawn,
`n_ctx − 1 − prefix_tokens` of them (a document shorter than the prefix has more pads before it).
An end-of-text token drawn is a token like any other: the row goes on.
"""

from __future__ import annotations

import math
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from entroweight import __version__, storage
from entroweight.schemas import FileMetadata, ShardManifest
from entroweight.schemas.arrow import ROW_IN_DOC, check_n_ctx, ids_type
from entroweight.schemas.datadir import DataDir, DataDirError
from entroweight.schemas.manifest import ShardInput
from entroweight.schemas.tokenizer import TOKENIZER_FILE
from entroweight.schemas.weighted import SURPRISAL, lists, matrix
from entroweight.transforms.tokenizer import LoadedTokenizer, load_tokenizer, tokenizer_from_bytes
from entroweight.transforms.weigh import WeighConfig

from .stage import ShardTask, Stage, StageError
from .weighted import WeightedShardWriter, weighing_metadata

# the input every shard reads a range of: sequence numbers, not a file
SEQUENCES = "sequences"
DTYPES = ("fp32", "bf16", "fp16")


class SynthesizeStage(Stage):
    """Constructed from its options (refused at once when they are out of range); the teacher's
    files are read by `prepare()` on the driver and the model loads in `setup()` on the worker."""

    name = "synthesize"
    _heavy = ("_tok", "_decoder", "_nbytes")

    def __init__(
        self,
        sequences: int,
        n_ctx: int,
        checkpoint: str | None = None,
        model: str | None = None,
        temperature: float = 1.0,
        seed: int = 0,
        shard_docs: int = 256,
        prefix_from: str | None = None,
        prefix_tokens: int = 0,
        weighting: WeighConfig | None = None,
        device: str = "cpu",
        dtype: str = "fp32",
        batch_size: int = 64,
        allow_pickle: bool = False,
        trust_remote_code: bool = False,
    ):
        for flag, value, least in (
            ("--sequences", sequences, 1),
            ("--shard-docs", shard_docs, 1),
            ("--batch-size", batch_size, 1),
            ("--prefix-tokens", prefix_tokens, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise StageError(f"{flag} must be a whole number of at least {least}, not {value!r}")
        try:
            check_n_ctx(n_ctx)
        except ValueError as e:
            raise StageError(str(e)) from None
        if isinstance(temperature, bool) or not (
            isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0
        ):
            raise StageError(f"--temperature must be a finite number above 0, not {temperature!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise StageError(f"--seed must be a whole number from 0 to 2**63 - 1, not {seed!r}")
        if dtype not in DTYPES:
            raise StageError(f"--dtype is one of {', '.join(DTYPES)}, not {dtype!r}")
        if (prefix_from is None) != (prefix_tokens == 0):
            raise StageError(
                "--prefix-from and --prefix-tokens go together: documents to continue, and how many of their tokens"
            )
        if n_ctx - 1 - prefix_tokens < 1:
            raise StageError(
                f"--n-ctx {n_ctx} leaves no token to draw after one pad and --prefix-tokens {prefix_tokens}"
            )
        if (checkpoint is None) == (model is None):
            raise StageError(
                "give exactly one teacher: --checkpoint (ours, a llama) or --model (HF id, directory or .gguf)"
            )
        self.sequences, self.n_ctx, self.shard_docs = sequences, n_ctx, shard_docs
        self.checkpoint, self.model_spec = checkpoint, model
        self.temperature, self.seed = float(temperature), seed
        self.prefix_from, self.prefix_tokens = prefix_from, prefix_tokens
        self.weighting = weighting or WeighConfig()
        self.device, self.dtype, self.batch_size = device, dtype, batch_size
        self.load_options = {"allow_pickle": allow_pickle, "trust_remote_code": trust_remote_code}
        self.lineages = {SEQUENCES: []}  # the first stage: nothing before it

    @property
    def length(self) -> int:
        """Tokens drawn per row."""
        return self.n_ctx - 1 - self.prefix_tokens

    # -- driver side
    @cached_property
    def source(self):
        from entroweight.scorers.teacher import teacher_source

        return teacher_source(self.checkpoint, self.model_spec)

    def _prepare(self) -> None:
        from entroweight.pipelines.score import check_device
        from entroweight.scorers.estimator_common import model_pad_id

        if self.device != "cpu":
            check_device(self.device)
        tok = self._teacher_tokenizer()
        self.tokenizer_path = storage.key(tok.path)
        self.tokenizer_json = storage.path(tok.path).read_bytes()
        self.tokenizer_sha256 = tok.sha256
        self.vocab_size = max(tok.vocab_size, self.source.vocab_size() or 0)
        if self.checkpoint is not None:  # the pad id it was trained with: its rows' context
            self.pad_id = model_pad_id(self.source.info, self.checkpoint)
            width = self.source.max_row_tokens()
            if width is not None and self.n_ctx > width:
                raise StageError(
                    f"--n-ctx {self.n_ctx} is wider than the teacher {self.checkpoint} reads ({width}, its n_ctx)"
                )
        else:  # masked: any id does, but the data contract asks for one
            self.pad_id = next((i for i in (tok.pad_id, tok.eos_id) if i is not None), 0)
        self.eos_id = tok.eos_id
        self._tok = tok
        self.prefix = self._prefix_parts() if self.prefix_from is not None else []

    def _teacher_tokenizer(self) -> LoadedTokenizer:
        """The teacher's tokenizer: the file beside our checkpoint (checked against the sha256 it was
        trained with), an HF model's own."""
        if self.checkpoint is None:
            return self.source.tokenizer()
        path = storage.path(self.checkpoint) / TOKENIZER_FILE
        if not path.is_file():
            raise StageError(
                f"the teacher {self.checkpoint} holds no {TOKENIZER_FILE}: the rows' bytes (BPB) and every "
                "reader need the tokenizer it was trained with; copy it beside its config.json"
            )
        tok = load_tokenizer(path)
        want = self.source.info.get("tokenizer_sha256")
        if want and want != tok.sha256:
            raise StageError(
                f"{path} is not the tokenizer the teacher {self.checkpoint} was trained with (sha256 "
                f"{tok.sha256[:12]}… vs {want[:12]}…)"
            )
        return tok

    def _prefix_parts(self) -> list[tuple[str, int, str, int]]:
        """(location, size, sha256, documents) of each part of the prefix directory, in order: sequence
        i continues the i-th document of it. Refused unless it holds enough documents, one row each at
        their start, in the teacher's tokenizer."""
        try:
            d = DataDir(self.prefix_from).require(hint="tokenize the documents to continue first")
            if d.kind not in ("sequences", "weighted"):
                raise DataDirError(f"{d.location} holds the output of `{d.stage}`, not tokens to continue")
            d.require_documents().require_one_config()
        except DataDirError as e:
            raise StageError(str(e)) from None
        meta = d.metadata
        if meta.get("tokenizer_sha256") != self.tokenizer_sha256:
            raise StageError(
                f"--prefix-from {self.prefix_from} is tokenized with another tokenizer "
                f"({str(meta.get('tokenizer_sha256'))[:12]}…) than the teacher's ({self.tokenizer_sha256[:12]}…): "
                "tokenize its documents with the teacher's tokenizer"
            )
        if meta.get("packed"):
            raise StageError(f"--prefix-from {self.prefix_from} holds packed rows: tokenize without --pack")
        parts = [(p.location, p.size, p.manifest.output_sha256, p.manifest.docs_out) for p in d.parts]
        total = sum(p[3] for p in parts)
        if total < self.sequences:
            raise StageError(
                f"--prefix-from {self.prefix_from} holds {total} documents, fewer than --sequences "
                f"{self.sequences}: each sequence continues a document of its own"
            )
        return parts

    def plan_inputs(self) -> list[ShardInput]:
        self.prepare()
        S = self.shard_docs
        return [
            ShardInput(uri=SEQUENCES, fmt="seeds", start=a, stop=min(a + S, self.sequences))
            for a in range(0, self.sequences, S)
        ]

    def input_paths(self) -> list[str]:
        teacher = self.checkpoint or self.model_spec
        local = Path(teacher).exists() or storage.is_url(teacher)
        return [p for p in (teacher if local else None, self.prefix_from) if p is not None]

    def carry(self, out_dir) -> None:
        from entroweight.transforms.tokenizer import carry_tokenizer

        carry_tokenizer(self.tokenizer_path, out_dir)

    def resources(self) -> dict[str, float]:
        return {"num_cpus": 1, "num_gpus": 1 if self.device.startswith("cuda") else 0}

    def config(self) -> dict[str, Any]:
        # device, batch size: speed, not values (to the float rounding of a batched forward)
        self.prepare()
        return {
            "teacher": self.source.config(),  # its sha256
            "tokenizer_sha256": self.tokenizer_sha256,
            "n_ctx": self.n_ctx,
            "temperature": self.temperature,
            "seed": self.seed,
            "dtype": self.dtype,
            **(
                {"prefix_tokens": self.prefix_tokens, "prefix_parts": [[p[0], p[2]] for p in self.prefix]}
                if self.prefix
                else {}
            ),
            **weighing_metadata(self.weighting, []),
            "with_entropy": True,
        }

    def file_metadata(self) -> dict[str, Any]:
        return {
            **FileMetadata(
                stage=self.name,
                tokenizer=self.tokenizer_path.rsplit("/", 1)[-1],
                tokenizer_sha256=self.tokenizer_sha256,
                vocab_size=self.vocab_size,
                n_ctx=self.n_ctx,
                padding_side="left",
                pad_id=self.pad_id,
                eos_id=self.eos_id,
                config_hash=self.config_hash,
                code_version=__version__,
            ).model_dump(),
            "scorer": "teacher",
            "unit": "nats",
            "teacher": self.source.config(),
            "temperature": self.temperature,
            "seed": self.seed,
            **weighing_metadata(self.weighting, []),
            "value_convention": (
                "value i is about predicting token i; pads 0. entropy: the exact entropy of the teacher's "
                "distribution token i was drawn from; surprisal: −log p of token i (nats)"
            ),
        }

    # -- worker side
    def setup(self) -> None:
        from entroweight.pipelines.score import check_device
        from entroweight.scorers.teacher import incremental

        self.prepare()
        check_device(self.device)
        if getattr(self, "_tok", None) is None:
            self._tok = tokenizer_from_bytes(self.tokenizer_json, self.tokenizer_path)
        model = self.source.load(self.device, self.dtype, self.load_options)
        self._decoder = incremental(self.source, model)
        nbytes = self._tok.token_nbytes
        self._nbytes = np.pad(nbytes, (0, max(0, self.vocab_size - len(nbytes))))  # ids past it: no bytes

    def process(self, task: ShardTask) -> ShardManifest:
        from entroweight.scorers.teacher import draw, uniforms

        (inp,) = task.inputs
        with WeightedShardWriter(
            self, task, self.file_metadata(), self.weighting, True, [], f"{task.shard}.parquet", True
        ) as out:
            for a in range(inp.start, inp.stop, self.batch_size):
                seqs = list(range(a, min(a + self.batch_size, inp.stop)))
                context, real = self._contexts(seqs)
                drawn = draw(
                    self._decoder,
                    context,
                    real,
                    uniforms(seqs, self.seed, self.length),
                    self.temperature,
                    self.device,
                    self.dtype,
                )
                rows, values, excluded = self._rows(seqs, context, real, drawn)
                out.add(rows, values, excluded, a - inp.start)
            return out.finish({"teacher": self.source.config(), "device": self.device})

    def _contexts(self, seqs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(B, C) each row's context, left-padded with the pad id, and its real (prefix) tokens."""
        C = self.n_ctx - self.length
        context = np.full((len(seqs), C), self.pad_id, dtype=np.int64)
        real = np.zeros((len(seqs), C), dtype=bool)
        for r, prefix in enumerate(self._prefixes(seqs)):
            if len(prefix):
                context[r, C - len(prefix) :] = prefix
                real[r, C - len(prefix) :] = True
        return context, real

    def _prefixes(self, seqs: list[int]) -> list[np.ndarray]:
        """The first `prefix_tokens` tokens of the documents sequences `seqs` continue (none without
        --prefix-from): document i of the prefix directory, its parts read checked by their sha256."""
        if not self.prefix:
            return [np.zeros(0, dtype=np.int64)] * len(seqs)
        import pyarrow.parquet as pq

        from entroweight.schemas.datadir import read_checked

        found: dict[int, np.ndarray] = {}
        first = 0
        lo, hi = seqs[0], seqs[-1] + 1
        for location, size, sha, docs in self.prefix:
            if first < hi and first + docs > lo:
                t = pq.read_table(
                    pa.BufferReader(read_checked(location, size, sha)),
                    columns=["input_ids", "n_pad", ROW_IN_DOC],
                )
                starts = np.flatnonzero(t.column(ROW_IN_DOC).to_numpy() == 0)
                ids = matrix(t.column("input_ids"))
                n_pad = t.column("n_pad").to_numpy()
                for k, row in enumerate(starts):
                    if lo <= first + k < hi:
                        found[first + k] = ids[row, n_pad[row] : n_pad[row] + self.prefix_tokens].astype(
                            np.int64
                        )
            first += docs
        return [found[i] for i in seqs]

    def _rows(self, seqs, context, real, drawn):
        """The weighted table's sequence columns (with `surprisal`), the entropy matrix, and the
        excluded (prefix) positions of the rows drawn."""
        B, C = context.shape
        ids = np.concatenate([context, drawn.tokens], axis=1)
        n_pad = C - real.sum(1)
        values = np.zeros(ids.shape, dtype=np.float32)
        surprisal = np.zeros(ids.shape, dtype=np.float32)
        values[:, C:], surprisal[:, C:] = drawn.entropy, drawn.surprisal
        excluded = np.concatenate([real, np.zeros_like(drawn.tokens, dtype=bool)], axis=1)
        positions = np.arange(self.n_ctx)[None, :] >= n_pad[:, None]
        n_bytes = (self._nbytes[ids] * positions).sum(1)
        names = [f"synthesized-{i}" for i in seqs]
        rows = pa.RecordBatch.from_pydict(
            {
                "seq_id": pa.array(names, pa.string()),
                "doc_id": pa.array(names, pa.string()),
                ROW_IN_DOC: pa.array(np.zeros(B, dtype=np.int32)),
                "input_ids": lists(
                    ids.astype(ids_type(self.vocab_size).to_pandas_dtype()), ids_type(self.vocab_size)
                ),
                "n_pad": pa.array(n_pad.astype(np.int32)),
                "n_bytes": pa.array(n_bytes.astype(np.int64)),
                SURPRISAL: lists(surprisal, pa.float32()),
            }
        )
        return rows, values, excluded if excluded.any() else None


__all__ = ["SynthesizeStage", "SEQUENCES"]
