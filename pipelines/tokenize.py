"""The tokenize stage: a shard of documents -> a shard of sequences (plus its rejects)."""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterator

import pyarrow as pa

from entroweight import __version__, storage
from entroweight.schemas import FileMetadata, ShardManifest, with_file_metadata
from entroweight.schemas.arrow import check_n_ctx
from entroweight.schemas.manifest import DUPLICATES_KEPT, ShardInput
from entroweight.transforms import duplicates
from entroweight.transforms.prefetch import prefetch
from entroweight.transforms.sources import (
    Cut,
    DocumentReader,
    check_text_column,
    is_glob,
    plan_inputs,
    rejects_table,
    resolve_hub,
    source_files,
)
from entroweight.transforms.tokenize import OVERFLOW, SequenceBuilder
from entroweight.transforms.tokenizer import (
    LoadedTokenizer,
    carry_tokenizer,
    load_tokenizer,
    tokenizer_from_bytes,
)
from entroweight.transforms.writer import AtomicParquetWriter, write_table_atomic

from .stage import REJECTS_DIR, ShardTask, Shuffle, Stage, next_shard


class TokenizeStage(Stage):
    name = "tokenize"
    # the listing and the duplicates found too: 100,000 paths need not travel to workers (a task
    # carries its own rows' duplicates)
    _heavy = ("_tok", "_listed", "_repeats")

    def __init__(
        self,
        sources: list[str],
        tokenizer: str,
        n_ctx: int = 512,
        pack: bool = False,
        shard_docs: int | None = None,
        text_column: str = "text",
        reject_duplicates: bool = False,
        overflow: str = "split",
        revision: str | None = None,
    ):
        check_n_ctx(n_ctx)
        if shard_docs is not None and shard_docs < 1:
            raise ValueError(f"--shard-docs must be at least 1, not {shard_docs}")
        if overflow not in OVERFLOW:
            raise ValueError(f"--overflow is one of {', '.join(OVERFLOW)}, not {overflow!r}")
        if pack and overflow == "truncate":
            raise ValueError("--overflow truncate does not apply to --pack (packing cuts no document)")
        if revision is not None and not any(str(s).startswith("hf:") for s in sources):
            # a pin that pins nothing would be recorded nowhere and read as if it held
            raise ValueError(f"--revision {revision} applies to hf: sources only; none is given")
        self.sources, self.n_ctx, self.pack, self.overflow = list(sources), n_ctx, pack, overflow
        self.shard_docs, self.reject_duplicates = shard_docs, reject_duplicates
        self.text_column = check_text_column(text_column)
        # hub datasets: one revision (commit sha) each, resolved once here, recorded in the config
        self.hub = resolve_hub(self.sources, revision)
        self._tok: LoadedTokenizer | None = load_tokenizer(tokenizer)  # fail early on a bad file
        self.tokenizer_path = str(self._tok.path)
        # its bytes travel with the stage: workers may share no disk with the driver (a Ray cluster)
        self.tokenizer_json = storage.path(self._tok.path).read_bytes()
        self.tokenizer_sha256 = self._tok.sha256
        if self._tok.pad_id is None:
            raise ValueError(
                f"the tokenizer {tokenizer} has no pad token; train one with `entroweight train-tokenizer` "
                "(it reserves <|pad|>, <|bos|>, <|eos|>)"
            )
        if pack and self._tok.eos_id is None:  # here, not per shard once --out exists
            raise ValueError(
                f"--pack needs an eos token between documents, and the tokenizer {tokenizer} has none"
            )

    @property
    def tok(self) -> LoadedTokenizer:
        if self._tok is None:
            self.setup()
        return self._tok

    def setup(self) -> None:
        if getattr(self, "_tok", None) is None:
            self._tok = tokenizer_from_bytes(self.tokenizer_json, self.tokenizer_path)

    def config(self) -> dict:
        # Paths are not part of the config: the same tokenizer bytes anywhere give the same shards.
        return {
            "tokenizer_sha256": self.tokenizer_sha256,
            "n_ctx": self.n_ctx,
            "pack": self.pack,
            "padding_side": "left",
            "text_column": self.text_column,
            "reject_duplicates": self.reject_duplicates,
            **({} if self.pack else {"overflow": self.overflow}),  # packing splits by nature
            # another upstream revision is another config: refused on the same --out (pin with --revision)
            **({"hub_revisions": {s: h.revision for s, h in self.hub.items()}} if self.hub else {}),
        }

    def _files(self) -> dict:
        """The source files, listed once per stage object (planning and the --out check share them)."""
        if getattr(self, "_listed", None) is None:
            self._listed = source_files(self.sources)
        return self._listed

    def plan_inputs(self):
        inputs = plan_inputs(self.sources, self.shard_docs, self.hub, files=self._files())
        if inputs and not getattr(self, "_head_checked", False):  # a wrong --text-column: refused once,
            # up front, from the first file's first rows (the only body planning reads)
            first = inputs[0].model_copy(update={"start": 0, "stop": None})
            DocumentReader(first, self.text_column).check_head()
            self._head_checked = True
        return inputs

    def whole_plan(self, inputs, order, shuffle) -> dict[str, list]:
        """The rows whose document id was seen before in the run (the first copy in `order`, then row
        order, is kept), each with where that first copy is: ids read, partitioned by a hash of the id
        and grouped on the engine (transforms/duplicates.py). With --reject-duplicates they are
        rejected as `duplicate_id`, else kept and counted (`duplicate_ids_kept`). Once per plan."""
        key = (tuple(inputs), tuple(order))
        cached = getattr(self, "_repeats", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        parts = duplicates.partitions(inputs)
        job = Shuffle(
            items=[duplicates.item(i, rank) for i, rank in duplicates.each_input(inputs, order)],
            map=functools.partial(duplicates.input_ids, text_column=self.text_column, parts=parts),
            group=duplicates.repeats,
            parts=parts,
        )
        found: dict[str, list] = {}
        for later in shuffle(job):
            columns = [later.column(c).to_pylist() for c in duplicates.LATER.names]
            for rank, row, first_rank, first_row in zip(*columns, strict=True):
                where = duplicates.first_copy(order[first_rank], first_row)
                found.setdefault(order[rank], []).append((row, where))
        self._repeats = (key, found)
        return found

    def input_paths(self) -> list[str]:
        # the sources as named (a directory, not only its files: --out may not lie inside it)
        named = [s for s in self.sources if not s.startswith("hf:") and not is_glob(s)]
        globbed = [s for s in self._files() if not s.startswith("hf:")]
        return [*named, *globbed]

    def file_metadata(self) -> dict:
        tok = self.tok
        return FileMetadata(
            stage=self.name,
            tokenizer=self.tokenizer_path.rsplit("/", 1)[-1],
            tokenizer_sha256=tok.sha256,
            vocab_size=tok.vocab_size,
            n_ctx=self.n_ctx,
            padding_side="left",
            pad_id=tok.pad_id,
            eos_id=tok.eos_id,
            packed=self.pack,
            config_hash=self.config_hash,
            code_version=__version__,
        ).model_dump()

    def carry(self, out_dir) -> None:
        carry_tokenizer(self.tok.path, out_dir)  # score, train, eval-bpb then need no --tokenizer

    @property
    def shard_rows(self) -> int | None:
        return self.shard_docs

    def streams(self, inp: ShardInput) -> bool:
        return inp.fmt.startswith("jsonl")  # JSON lines: rows counted only by reading them

    def process(self, task: ShardTask) -> Iterator[ShardManifest]:
        """One pass over the task's input: a shard per Cut of the reader (every `task.every` rows and
        at the end), each yielded to be committed before the next one is finished."""
        (inp,) = task.inputs
        out = storage.path(task.out_dir)
        reader = DocumentReader(inp, self.text_column, rows=True)
        encode = SequenceBuilder(self.tok, self.n_ctx, self.pack, task.shard, self.overflow).encode
        repeats = dict(task.plan)  # row -> where its id was first seen in the run (`whole_plan`)

        def encoded():
            for piece in prefetch(reader.pieces(task.every)):
                if isinstance(piece, Cut):
                    yield piece, None, None
                    continue
                docs, found = _duplicates(piece, repeats, reader, self.reject_duplicates)
                yield docs, found, encode(docs)

        # Three threads: read+parse, encode (releases the GIL), pad+write: the encoder never waits on I/O.
        shard = _Shard(self, out, task.shard)
        try:
            for piece, duplicates, ids in prefetch(encoded()):
                if not isinstance(piece, Cut):
                    shard.add(piece, duplicates, ids)
                    continue
                yield shard.close(piece, inp)
                if piece.last:
                    return
                shard = _Shard(self, out, next_shard(shard.name))
        except BaseException:
            shard.abort()
            raise


class _Shard:
    """One output shard of a tokenize task being written: its sequences, duplicates and writer."""

    def __init__(self, stage: TokenizeStage, out, name: str):
        self.stage, self.out, self.name = stage, out, name
        self.builder = SequenceBuilder(stage.tok, stage.n_ctx, stage.pack, name, stage.overflow)
        schema = with_file_metadata(self.builder.schema, stage.file_metadata())
        self.writer = AtomicParquetWriter(out / f"{name}.parquet", schema)
        self.rejects: list[dict] = []  # duplicate ids rejected (the reader's come with the Cut)
        self.duplicates_kept = 0  # ids seen before in the run, kept (without --reject-duplicates)
        self.committed = False

    def add(self, docs: pa.RecordBatch, duplicates: tuple[list[dict], int], ids) -> None:
        rejects, kept = duplicates
        self.rejects += rejects
        self.duplicates_kept += kept
        for batch in self.builder.add(docs, ids):
            self.writer.write(batch)

    def abort(self) -> None:
        if not self.committed:
            self.writer.abort()

    def close(self, cut: Cut, inp: ShardInput) -> ShardManifest:
        """Commit the parquet, then the rejects; the manifest (returned) is written by run_task, last."""
        builder, stage = self.builder, self.stage
        for batch in builder.finish():
            self.writer.write(batch)
        sha = self.writer.close()
        self.committed = True
        rejects = cut.rejects + self.rejects
        rejects_file = rejects_sha = rejects_size = None
        if rejects:
            rejects_file = f"{REJECTS_DIR}/{self.name}.parquet"
            rejects_sha, rejects_size = write_table_atomic(rejects_table(rejects), self.out / rejects_file)
        return ShardManifest(
            shard=self.name,
            stage=stage.name,
            inputs=[inp.model_copy(update={"start": cut.start, "stop": cut.stop})],
            output=f"{self.name}.parquet",
            output_sha256=sha,
            rows_out=builder.n_seq,
            docs_in=cut.docs_in,
            docs_out=builder.docs_out,
            rejected=dict(collections.Counter(r["reason"] for r in rejects)),
            rejects_file=rejects_file,
            rejects_sha256=rejects_sha,
            rejects_bytes=rejects_size,
            n_tokens=builder.n_seq * stage.n_ctx,
            n_real_tokens=builder.n_real_tokens,
            n_bytes=builder.n_bytes,
            config_hash=stage.config_hash,
            code_version=__version__,
            extra={
                "n_truncated": builder.n_truncated,
                "bytes_dropped": builder.bytes_dropped,
                DUPLICATES_KEPT: self.duplicates_kept,
            },
        )


def _duplicates(docs, repeats: dict[int, str], reader: DocumentReader, reject: bool):
    """(docs, (rejects, duplicates kept)): a row whose id was seen before in the run (`repeats`: row ->
    where first) is rejected with `reject`, naming where, else kept and counted."""
    if not repeats:
        return docs, ([], 0)
    rows = docs.column("row").to_pylist()
    hits = [i for i, row in enumerate(rows) if row in repeats]
    if not hits or not reject:
        return docs, ([], len(hits))
    ids = docs.column("id")
    rejects = [
        reader.reject_record(
            ids[i].as_py(), "duplicate_id", f"row {rows[i]}: id seen first at {repeats[rows[i]]}"
        )
        for i in hits
    ]
    keep = sorted(set(range(docs.num_rows)) - set(hits))
    return docs.take(pa.array(keep, pa.int64())), (rejects, 0)
