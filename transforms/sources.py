"""Sources -> documents: find input files (or hub shards), split them into shards, read them as Arrow.

A SOURCE is a file, a directory, a glob of `.parquet`, `.jsonl`, `.json.gz`/`.jsonl.gz`,
`.jsonl.zst` (local or a URL: s3://, gs://; a name holding `*?[` is a glob only where no file or
directory of that name exists: `is_glob`), or a hub dataset `hf:REPO[:CONFIG[:SPLIT]]`, whose
revision is resolved once at planning and whose parquet files are sharded by row group.
Reading yields DOCUMENT_SCHEMA batches and, separately, the rows rejected with a reason.
"""

from __future__ import annotations

import codecs
import fnmatch
import glob
import gzip
import hashlib
import io
import json
import os
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from entroweight import output, storage
from entroweight.schemas import DOCUMENT_SCHEMA, REJECT_SCHEMA
from entroweight.schemas.manifest import STAGE_FILE, ShardInput

SUFFIXES = {
    ".parquet": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".jsonl.gz": "jsonl.gz",
    ".json.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst",
    ".json.zst": "jsonl.zst",
}
# Compressed JSON lines are recognised by their first bytes, whatever the file is called.
MAGIC = {b"\x1f\x8b": "jsonl.gz", b"\x28\xb5\x2f\xfd": "jsonl.zst"}


def compressed_format(head: bytes) -> str | None:
    """The compressed JSON lines format a file's first bytes say (MAGIC), or None."""
    return next((fmt for magic, fmt in MAGIC.items() if head.startswith(magic)), None)


# A hub id: hf:OWNER/NAME, optionally :CONFIG and :SPLIT (default split: train).
HUB_RE = re.compile(
    r"^hf:(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<config>[\w.-]+))?(?::(?P<split>[\w.-]+))?$"
)


class SourceError(ValueError):
    """An input that cannot be read; the message names the file and says what to do."""


class NoTextColumn(SourceError):
    """No row of a file holds the text column (--text-column): a wrong name, not a bad file."""


def is_glob(spec: str, exists: Callable[[str], bool] = os.path.exists) -> bool:
    """Whether a SOURCE is read as a glob pattern: it holds a glob character and names nothing as
    written (`exists`: the check of its filesystem). A file or directory whose name holds one
    (`a[0:5].jsonl`) is read as itself: as a pattern it would name other files (`a0.jsonl`) or none."""
    return storage.has_glob_chars(spec) and not exists(spec)


@dataclass(frozen=True)
class HubId:
    repo: str
    config: str | None
    split: str


def parse_hub_id(spec: str) -> HubId:
    m = HUB_RE.match(spec)
    if not m or ".." in m["repo"] or "--" in m["repo"]:  # the hub refuses those; never a path
        raise SourceError(
            f"{spec!r} is not a hub dataset id; write hf:OWNER/NAME[:CONFIG[:SPLIT]], "
            "e.g. hf:HuggingFaceFW/fineweb:sample-10BT"
        )
    return HubId(m["repo"], m["config"] or None, m["split"] or "train")


def file_format(path: str | Path) -> str | None:
    name = str(path).lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return SUFFIXES[suffix]
    return None


def not_plain_text(path: str | Path) -> str | None:
    """Why `path` is no text to score as it is (bits per byte count its exact bytes): a source of
    documents (JSON lines, parquet, compressed), by its name or, where it exists, its first bytes;
    None where it may be plain text."""
    fmt = file_format(path)
    if fmt is None:
        try:
            with storage.open_input(path) as f:
                fmt = compressed_format(f.read(4)) or ("jsonl" if _a_document_line(f) else None)
        except (OSError, ValueError):  # not there, or a directory: the reader says so
            pass
    if fmt is None:
        return None
    return (
        f"{path} is a file of documents ({fmt}), not plain text: its bytes would be scored as they are, "
        "markup and all; give a UTF-8 text file (e.g. the documents' text, one after another)"
    )


#: the longest first line read to tell a document of JSON lines (a book per line runs to megabytes)
FIRST_LINE_BYTES = 64 << 20


def _a_document_line(f) -> bool:
    """Whether the first non-blank line of `f` (opened at its start) is a JSON object with a string
    `text`: a document of JSON lines, whatever the file's name (a held-out text would not start so).
    Read no further than its first character where that is not `{`."""
    f.seek(0)
    blank = codecs.BOM_UTF8 + b" \t\r\n"
    head = bytearray()
    while len(head) < FIRST_LINE_BYTES and (chunk := f.read(1 << 16)):
        head += chunk
        start = len(head) - len(head.lstrip(blank))  # blank lines before it: the next one decides
        if start < len(head) and (head[start : start + 1] != b"{" or b"\n" in head[start:]):
            break
    line = bytes(head).lstrip(blank).split(b"\n", 1)[0]
    if not line.startswith(b"{"):
        return False
    try:
        first = json.loads(line)
    except ValueError:
        return False
    return isinstance(first, dict) and isinstance(first.get("text"), str)


# What marks a directory as a stage's output: its files are data this project wrote, never documents.
STAGE_MARKER = STAGE_FILE


def relation_to(directory: str | Path, spec: str) -> str:
    """How `directory` stands to what SOURCE `spec` reads, as `storage.relation` words it ("is", "lies
    inside", "holds"; "" when apart): for a glob, "holds" where it may match a file inside `directory`
    (each of its components, up to `directory`'s depth, matches `directory`'s, or one is `**`; the
    directories before its first wildcard as written and resolved), or where it matches a file there
    now (through a link), so a glob beside `directory` (`*.jsonl` beside `runs/`) stays apart. A hub id
    reads no path."""
    if spec.startswith("hf:") or storage.blank(spec):
        return ""
    spec = str(storage.path(spec)) if spec.startswith("file://") else spec
    if storage.is_url(spec):
        if not storage.has_glob_chars(spec):
            return storage.relation(directory, spec)
        # a store's glob: its key parts against the directory's (a store has no links to follow)
        where = storage.key(directory)
        proto, rest = spec.split("://", 1)
        if not where.startswith(f"{proto}://"):
            return ""
        inside = PurePosixPath(where.split("://", 1)[1]).parts
        return "holds files it may match" if _may_match_inside(inside, PurePosixPath(rest).parts) else ""
    if not is_glob(spec):
        return storage.relation(directory, spec)
    written = Path(os.path.abspath(spec)).parts
    first = next(i for i, part in enumerate(written) if storage.has_glob_chars(part))
    # the directories before the first wildcard also resolved: a glob through a link to `directory`
    resolved = Path(os.path.realpath(Path(*written[:first]))).parts + written[first:]
    for pattern in {written, resolved}:
        for form in {os.path.abspath(directory), os.path.realpath(directory)}:
            if _may_match_inside(Path(form).parts, pattern):
                return "holds files it may match"
    # and a wildcard that matches a link into `directory` now: the files it reads (`expand_sources`:
    # a glob's matches that are files), resolved
    if any(os.path.isfile(m) and storage.relation(directory, m) for m in glob.iglob(spec, recursive=True)):
        return "holds files it may match"
    return ""


def check_globs_apart(out, reads, command: str, flag: str = "--out") -> None:
    """Refuse (OutputRefused) an `out` where a glob it reads (SOURCES, --documents: (flag, location)
    pairs) may match files: a rerun would read its own output as documents."""
    for what, read in reads:
        if read is not None and storage.has_glob_chars(str(read)) and not storage.blank(read):
            if relation_to(out, str(read)).endswith("match"):
                raise storage.OutputRefused(
                    f"{flag} {out} lies where {what} {read} may match files, which {command} reads (a "
                    "rerun would read its own output); write to a location apart from what it reads"
                )


def _may_match_inside(parts: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Whether glob `pattern` (path components) may match a path below the directory `parts`: each of
    its components, up to the directory's depth, matches the directory's, or one is `**`."""
    for i, part in enumerate(parts):
        if i >= len(pattern) or pattern[i] == "**":
            break
        if not fnmatch.fnmatchcase(part, pattern[i]):
            break
    else:
        i = len(parts)
    return i < len(pattern) and (i == len(parts) or pattern[i] == "**")


def _expand_url(
    spec: str,
    skipped: list[str] | None = None,
    outputs: list[str] | None = None,
    hidden: list[str] | None = None,
) -> dict[str, tuple[int, str | None]]:
    """{url: (size, version)} of the data files a URL names (s3://bucket/prefix/*.jsonl.gz, a prefix,
    an object), from the listing alone (one LIST per 1,000 objects, no request per file); hidden files
    and stage outputs skipped as for local directories. The version (`object_version`) marks an object
    rewritten since it was planned, as a local file's mtime does."""
    fs, inner = storage.filesystem(spec)
    proto = spec.split("://", 1)[0]
    walked = False  # a directory's walk skips stage outputs already
    if is_glob(inner, fs.exists):
        found = fs.glob(inner, detail=True)
        fixed = _fixed_prefix(inner).rstrip("/") + "/"
        if "/." not in "/" + inner[len(fixed) :]:  # a wildcard matches no hidden name, as a local glob's
            found = {f: i for f, i in found.items() if not _hidden_prefix(f[len(fixed) :])}
        if not found:
            raise SourceError(f"the glob {spec!r} matches no file")
    elif fs.isdir(inner):
        found, walked = fs.find(inner, detail=True), True
        root = inner.rstrip("/") + "/"
        _not_an_output(spec, [f[len(root) :] for f in found if "/" not in f[len(root) :]])
        stage_dirs = {f.rsplit("/", 1)[0] for f in found if f.endswith("/" + STAGE_MARKER)}
        by_dir: dict[str, list[str]] = {}
        for f in found:
            by_dir.setdefault(f.rsplit("/", 1)[0], []).append(f.rsplit("/", 1)[1])
        other = sorted(
            d
            for d, names in by_dir.items()
            if d.startswith(root) and not any(d.startswith(s + "/") or d == s for s in stage_dirs)
            and output.command_output(f"{proto}://{d}", names)
        )  # fmt: skip
        if outputs is not None:
            outputs += [f"{proto}://{d}" for d in other if not any(d.startswith(o + "/") for o in other)]
        stage_dirs |= set(other)
        found = {f: info for f, info in found.items() if not any(f.startswith(d + "/") for d in stage_dirs)}
        if hidden is not None:  # the first hidden name on each path, once
            hidden += sorted({f"{proto}://{root}{h}" for f in found if (h := _hidden_prefix(f[len(root) :]))})
        found = {f: info for f, info in found.items() if not _hidden_prefix(f[len(root) :])}
        if not any(file_format(f) for f in found):
            raise SourceError(f"the directory {spec} holds no {', '.join(sorted(SUFFIXES))} file")
    elif fs.isfile(inner):
        found = {inner: fs.info(inner)}
    else:
        raise SourceError(f"no such file, directory or hub id: {spec}")
    files = {
        f"{proto}://{f}": (int(info.get("size") or 0), object_version(info))
        for f, info in sorted(found.items())
        if file_format(f) and info.get("type", "file") == "file"
    }
    if skipped is not None:
        skipped += [
            f"{proto}://{f}"
            for f, i in sorted(found.items())
            if i.get("type", "file") == "file" and not file_format(f)
        ]
    if not files:
        raise SourceError(f"{spec!r} names no readable input (suffixes: {', '.join(sorted(SUFFIXES))})")
    if not walked:  # a glob or an object: is it a file of a command's output?
        _refuse_outputs_among(list(files), spec, _fixed_prefix(spec) if is_glob(inner, fs.exists) else None)
    return files


def _hidden_prefix(relative: str) -> str:
    """The path up to its first hidden name (one starting with "."), or "" where it has none."""
    parts = relative.split("/")
    hid = next((i for i, part in enumerate(parts) if part.startswith(".")), None)
    return "" if hid is None else "/".join(parts[: hid + 1])


def _fixed_prefix(spec: str) -> str:
    """The directories of a glob before its first wildcard (where its matches may lie below)."""
    parts = spec.split("/")
    first = next(i for i, part in enumerate(parts) if storage.has_glob_chars(part))
    return "/".join(parts[:first]) or "."


def _refuse_outputs_among(files: list[str], spec: str, stop: str | None) -> None:
    """Refuse a file a glob matched (or a file named) that belongs to a command's output: a stage's
    (its `.stage.json` beside it) or another command's, judged on the directories from the file's up
    to `stop` (a glob's fixed directories; None: the file's own directory alone). One listing per
    directory."""
    listings: dict[str, dict[str, int]] = {}
    for f in files:
        own = d = f.rsplit("/", 1)[0] if "/" in f else "."
        while True:
            names = listings.setdefault(d, storage.listing(d))
            if d == own and STAGE_MARKER in names:  # a stage's files lie in its directory itself
                raise SourceError(
                    f"{f} belongs to the output of an entroweight stage ({STAGE_MARKER} beside it), "
                    "not documents; name the documents it was made from"
                )
            if command := output.command_output(d, names):
                raise SourceError(
                    f"{f} belongs to the output of `entroweight {command}` ({d}), not documents; name "
                    "the documents it was made from"
                )
            up = d.rstrip("/").rsplit("/", 1)[0]
            # up to the glob's fixed directories (by depth: a store may list a path another way), never
            # above a store's bucket
            if stop is None or len(up) < len(stop.rstrip("/")) or "/" not in d.rstrip("/").split("://")[-1]:
                break
            d = up


def _not_an_output(spec: str, names: list[str]) -> None:
    """Refuse a source directory that is a command's output, `names` being the files in it: a stage's
    (its STAGE_MARKER) or another command's (`output.command_output`): its files are records, not
    documents."""
    if STAGE_MARKER in names:
        raise SourceError(
            f"{spec} is the output of an entroweight stage ({STAGE_MARKER}), not documents; "
            "name the documents it was made from"
        )
    if command := output.command_output(spec, names):
        raise SourceError(
            f"{spec} is the output of `entroweight {command}`, not documents; name the documents "
            "it was made from"
        )


def _walk(root: str, outputs: list[str], hidden: list[str]) -> list[str]:
    """Files under `root`, following symlinked directories (a symlink loop is refused). Hidden files
    and directories (a stage's bookkeeping: .stage.json, manifests, .rejects/) and stage output
    directories are skipped: sources are documents, never this project's own files. So are the
    outputs of the other commands (a training run, an export, an evaluation: `storage.command_output`),
    which are added to `outputs`, and the hidden names to `hidden`, for the caller to say."""
    seen: set[str] = set()
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            raise SourceError(f"{dirpath} leads back to {real} (a symlink loop); remove the link")
        seen.add(real)
        if STAGE_MARKER in filenames and dirpath != root:
            dirnames[:] = []  # a stage's output inside the sources: not documents
            continue
        if dirpath != root and output.command_output(dirpath, filenames):
            dirnames[:] = []
            outputs.append(dirpath)
            continue
        hidden += [os.path.join(dirpath, n) for n in sorted(dirnames + filenames) if n.startswith(".")]
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [os.path.join(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(files)


def expand_sources(specs: list[str], notes: list[str] | None = None) -> list[str]:
    """Files (sorted, deduplicated) and hub ids named by the SOURCE arguments (`source_files`)."""
    return list(source_files(specs, notes))


def source_files(
    specs: list[str], notes: list[str] | None = None
) -> dict[str, tuple[int, int | None, str | None] | None]:
    """{file: (size, mtime in ns or None, an object's version or None)} of the files named by the SOURCE arguments, sorted per
    argument and deduplicated, and {hub id: None}. From listings and stats only: no file is opened.
    A directory's or glob's files of no source suffix (a README, a `_SUCCESS`) are left out, and a
    file named by two sources is read once: both are said in `notes` for the caller to show (a
    misnamed data file, or a file meant to count twice, is no silent loss); a link among them to
    nothing is refused (a lost mount would drop its files without a word)."""
    out: dict[str, tuple[int, int | None] | None] = {}
    skipped: list[str] = []
    outputs: list[str] = []  # directories of other commands' outputs inside a source directory
    hidden: list[str] = []  # names starting with "." inside a source directory
    repeated: list[str] = []
    for spec in specs:
        if storage.blank(spec):
            raise SourceError(
                "a source is empty (an unset variable?): name files, directories, globs or hf: ids"
            )
        if spec.startswith("hf:"):
            parse_hub_id(spec)
            repeated += [spec] if spec in out else []
            out[spec] = None
            continue
        if storage.is_url(spec):
            # object stores keep no stable mtime across listings: the size stands alone
            listed = _expand_url(spec, skipped, outputs, hidden)
            repeated += [f for f in listed if f in out]
            out.update((f, (size, None, version)) for f, (size, version) in listed.items())
            continue
        if why := storage.url_slip(spec):
            raise SourceError(why)
        spec = str(storage.path(spec)) if spec.startswith("file://") else spec  # a local path, as elsewhere
        if is_glob(spec):
            matches = sorted(glob.glob(spec, recursive=True))
            if not matches:
                raise SourceError(f"the glob {spec!r} matches no file")
        elif os.path.isdir(spec):
            _not_an_output(spec, os.listdir(spec))
            matches = _walk(spec, outputs, hidden)
            if not any(file_format(m) for m in matches):
                raise SourceError(f"the directory {spec} holds no {', '.join(sorted(SUFFIXES))} file")
        elif os.path.isfile(spec):
            matches = [spec]
        else:
            raise SourceError(f"no such file, directory or hub id: {spec}")
        if broken := [m for m in matches if os.path.islink(m) and not os.path.exists(m)]:
            raise SourceError(
                f"{broken[0]} is a link to {os.readlink(broken[0])}, which does not exist"
                + (f" ({len(broken) - 1} more such link(s) in {spec})" if len(broken) > 1 else "")
                + "; restore what it points to, or remove the link"
            )
        files = [m for m in matches if file_format(m) and os.path.isfile(m)]
        skipped += [m for m in matches if os.path.isfile(m) and not file_format(m)]
        if not files:
            raise SourceError(f"{spec!r} names no readable input (suffixes: {', '.join(sorted(SUFFIXES))})")
        if not os.path.isdir(spec):  # a glob's matches or a file named: none of a command's output
            _refuse_outputs_among(files, spec, _fixed_prefix(spec) if is_glob(spec) else None)
        real_dirs: dict[str, str] = {}  # a directory resolved once
        for f in files:
            parent, name = os.path.split(f)
            if parent not in real_dirs:
                real_dirs[parent] = os.path.realpath(parent or ".")
            real = os.path.realpath(f) if os.path.islink(f) else os.path.join(real_dirs[parent], name)
            if real in out:
                repeated.append(f)
            st = os.stat(real)
            out[real] = (st.st_size, st.st_mtime_ns, None)
    if notes is not None:
        if skipped:  # a directory's README is no loss, but a misnamed data file would be one
            notes.append(
                f"{len(skipped)} file(s) of no source suffix not read: {storage.some_of(skipped, 5)}"
            )
        if hidden:  # a .git or .DS_Store is no loss, but a hidden copy of data would be one
            notes.append(
                f"{len(hidden)} hidden file(s) or director(ies) not read: {storage.some_of(hidden, 5)}"
            )
        if outputs:  # said: a run's records are no documents, but a user may have meant them
            notes.append(
                f"{len(outputs)} director(ies) holding another entroweight command's output not read "
                f"(records, not documents): {storage.some_of(outputs, 5)}"
            )
        if repeated:
            notes.append(
                f"{len(repeated)} file(s) reached more than once (named by two sources, or through a link), read once: {storage.some_of(repeated, 5)}"
            )
    return out


# ---------------------------------------------------------------- planning: files -> shards


def object_version(info: dict) -> str | None:
    """What an object store's listing says changes when the object is rewritten (its size may not):
    S3's ETag, GCS's generation or etag, the hub's blob id; None where the store says none."""
    for field in ("ETag", "generation", "etag", "blob_id", "md5Hash"):
        if info.get(field):
            return str(info[field]).strip('"')
    return None


def _open_binary(path: str, fmt: str):
    if storage.size(path) == 0:
        # not even a valid empty .gz/.zst/.parquet: an interrupted download or copy, never "no documents"
        raise SourceError(f"{path} is empty (0 bytes): an interrupted download or copy? replace or remove it")
    raw = storage.open_input(path)
    if fmt != "parquet":  # JSON lines: trust the bytes, not the name (a gzip saved as .jsonl)
        head = raw.read(4)
        raw.seek(0)
        fmt = compressed_format(head) or "jsonl"
    if fmt == "jsonl.gz":
        return gzip.GzipFile(fileobj=raw)
    if fmt == "jsonl.zst":
        return io.BufferedReader(_ZstdFrames(raw), 1 << 20)
    return raw


class _ZstdFrames(io.RawIOBase):
    """Decompresses concatenated zstd frames and raises on a frame cut short: zstandard's
    stream_reader returns a clean EOF on a truncated file, which would silently drop documents."""

    def __init__(self, raw):
        self.raw, self.pending, self.pos = raw, b"", 0
        self.dobj, self.in_frame = zstandard.ZstdDecompressor().decompressobj(), False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self.pos >= len(self.pending):
            self.pending, self.pos = b"", 0
            # small reads: each finished frame copies the rest of the chunk (unused_data), so a big
            # chunk of many small frames (one document per frame) would be quadratic
            chunk = self.raw.read(1 << 16)
            if not chunk:
                if self.in_frame:
                    raise EOFError("zstd stream ended inside a frame (the file is truncated)")
                return 0
            pieces = []  # joined once: `pending +=` per frame is quadratic too
            while chunk:
                self.in_frame = True
                pieces.append(self.dobj.decompress(chunk))
                chunk = b""
                if self.dobj.eof:  # frame done: the rest starts the next one
                    chunk, self.in_frame = self.dobj.unused_data, False
                    self.dobj = zstandard.ZstdDecompressor().decompressobj()
            self.pending = b"".join(pieces)
        n = min(len(buf), len(self.pending) - self.pos)
        buf[:n] = memoryview(self.pending)[self.pos : self.pos + n]
        self.pos += n
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def plan_inputs(
    specs: list[str],
    shard_docs: int | None = None,
    hub: dict[str, HubFiles] | None = None,
    files: dict[str, tuple[int, int | None, str | None] | None] | None = None,
) -> list[ShardInput]:
    """One ShardInput per task, from listings and parquet footers only (no file body is opened):
    a JSON-lines file whole (its rows cannot be counted without reading it all: the task that reads
    it cuts it into shards of `shard_docs` as it goes), a parquet file whole or, with `shard_docs`,
    by runs of row groups, and a hub dataset's parquet by runs of row groups.
    `hub`: the hub sources already resolved (resolve_hub); `files`: source_files(specs), if listed."""
    if shard_docs is not None and shard_docs < 1:  # 0 or -1 once dropped every document, exit 0
        raise SourceError(f"--shard-docs must be at least 1, not {shard_docs}")
    shards: list[ShardInput] = []
    files = source_files(specs) if files is None else files
    footers = _footers([f for f in files if shard_docs and file_format(f) == "parquet"])
    for spec, stat in files.items():
        if stat is None:
            resolved = (hub or {}).get(spec) or resolve_hub([spec])[spec]
            shards += hub_shards(resolved, shard_docs)
            continue
        common = dict(uri=spec, fmt=file_format(spec), size=stat[0], mtime_ns=stat[1], version=stat[2])
        if spec in footers:
            shards += _row_group_shards(ShardInput(**common), footers[spec], shard_docs)
        else:  # unreadable footer: one shard, which then fails with the reader's message
            shards.append(ShardInput(**common))
    return shards


def _footers(urls: list[str]) -> dict[str, pq.FileMetaData]:
    """The parquet footers of `urls` read in parallel (a ranged read each); unreadable ones left out."""
    from concurrent.futures import ThreadPoolExecutor

    def footer(url: str):
        try:
            with storage.open_input(url) as f:
                return pq.read_metadata(f)
        except Exception:  # noqa: BLE001 - the shard fails later, naming the file
            return None

    with ThreadPoolExecutor(16) as pool:
        return {u: md for u, md in zip(urls, pool.map(footer, urls), strict=True) if md is not None}


def _row_group_shards(whole: ShardInput, md: pq.FileMetaData, shard_docs: int | None) -> list[ShardInput]:
    """Runs of consecutive row groups of about `shard_docs` rows (at least one group each), so that
    every row group is read by one shard only; an empty file is one empty shard."""
    shards, start, rows = [], 0, 0
    for rg in range(md.num_row_groups):
        rows += md.row_group(rg).num_rows
        last = rg == md.num_row_groups - 1
        if rows and (last or shard_docs is None or rows >= shard_docs):
            shards.append(whole.model_copy(update={"start": start, "stop": start + rows}))
            start, rows = start + rows, 0
    return shards or [whole.model_copy(update={"start": 0, "stop": 0})]


# ---------------------------------------------------------------- reading: shard -> documents


def text_id(text: str) -> str:
    """Stable id of a document that has none (C4): a hash of its text."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


@dataclass
class Cut:
    """The end of one output shard's rows in a DocumentReader's pieces: rows [start, stop) of the
    input (stop None: to its end), how many there were, and those rejected, with a reason each."""

    start: int
    stop: int | None
    docs_in: int
    rejects: list[dict]
    last: bool  # the input's last shard


def check_text_column(name: str) -> str:
    """The field that holds a document's text, as given: a blank name would match no row, so every
    document of every shard would be rejected as `missing_text` (refused before anything is read)."""
    if not isinstance(name, str) or not name.strip():
        raise SourceError(
            f"the text column (--text-column) must name the field that holds the text, not {name!r}"
        )
    return name


#: DOCUMENT_SCHEMA and each document's row in its input (`DocumentReader(..., rows=True)`)
DOCUMENT_ROWS = DOCUMENT_SCHEMA.append(pa.field("row", pa.int64(), nullable=False))


class DocumentReader:
    """Reads one ShardInput as DOCUMENT_SCHEMA batches; rejects are collected in `self.rejects`.

    Column maps: FineWeb (`id,text,url,dump,...`) and C4 (`text,url,timestamp`) both have `text`
    and `url`; a missing id becomes a hash of the text.
    """

    def __init__(
        self, shard: ShardInput, text_column: str = "text", batch_docs: int = 2048, rows: bool = False
    ):
        self.shard = shard
        # each document's row in its input as a last column, `row` (DOCUMENT_ROWS): duplicate ids are
        # planned and found by it (transforms/duplicates.py)
        self.rows = rows
        self.text_column = text_column
        self.batch_docs = batch_docs
        self.source = shard.uri.rsplit("/", 1)[-1]
        self.rejects: list[dict] = []
        self.docs_in = 0

    # -- rows -> documents
    def reject_record(self, doc_id: str, reason: str, detail: str | None = None) -> dict:
        """A REJECT_SCHEMA row of this input."""
        return {"id": doc_id, "source": self.source, "reason": reason, "detail": detail}

    def _reject(self, doc_id: str, reason: str, detail: str | None = None) -> None:
        self.rejects.append(self.reject_record(doc_id, reason, detail))

    def _documents(
        self, rows: Iterator[tuple[int, dict | None, str | None]], every: int | None = None
    ) -> Iterator[pa.RecordBatch | Cut]:
        """rows: (row number, parsed row or None, error reason) -> batches of valid documents, and a
        Cut after each `every` rows (counted from the shard's start) and at the end."""
        ids, texts, urls, rownos = [], [], [], []
        start = self.shard.start
        # a cut is made when the first row past it arrives: the input's last shard is known as such
        next_cut = start + every if every else None
        range_in = 0
        for rowno, row, error in rows:
            if next_cut is not None and rowno >= next_cut:
                if texts:
                    yield self._batch(ids, texts, urls, rownos)
                    ids, texts, urls, rownos = [], [], [], []
                yield Cut(start, next_cut, range_in, self._take_rejects(), last=False)
                start, next_cut, range_in = next_cut, next_cut + every, 0
            self.docs_in += 1
            range_in += 1
            fallback_id = f"{self.source}:{rowno}"
            if error is not None:
                self._reject(fallback_id, error, f"row {rowno}")
                continue
            raw_id = row.get("id")
            doc_id = str(raw_id) if raw_id is not None else None
            if doc_id is not None and not _is_utf8(doc_id):
                self._reject(fallback_id, "invalid_utf8", f"row {rowno}: invalid UTF-8 in 'id'")
                continue
            text = row.get(self.text_column, _MISSING)
            if text is _MISSING or text is None:
                self._reject(
                    doc_id or fallback_id, "missing_text", f"row {rowno} has no {self.text_column!r}"
                )
                continue
            if isinstance(text, bytes):
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError as e:
                    self._reject(doc_id or fallback_id, "invalid_utf8", str(e))
                    continue
            if not isinstance(text, str):
                self._reject(
                    doc_id or fallback_id, "not_string", f"{self.text_column} is {type(text).__name__}"
                )
                continue
            if not _is_utf8(text):  # lone surrogates from JSON escapes, or invalid bytes in the line
                self._reject(doc_id or fallback_id, "invalid_utf8", f"row {rowno}: invalid UTF-8 in the text")
                continue
            if is_blank(text):
                self._reject(doc_id or fallback_id, "empty", None)
                continue
            url = row.get("url")
            url = None if url is None else str(url)
            if url is not None and not _is_utf8(url):  # one bad field loses its document, not the shard
                self._reject(doc_id or fallback_id, "invalid_utf8", f"row {rowno}: invalid UTF-8 in 'url'")
                continue
            ids.append(doc_id or text_id(text))
            texts.append(text)
            urls.append(url)
            rownos.append(rowno)
            if len(texts) >= self.batch_docs:
                yield self._batch(ids, texts, urls, rownos)
                ids, texts, urls, rownos = [], [], [], []
        if texts:
            yield self._batch(ids, texts, urls, rownos)
        yield Cut(start, self.shard.stop, range_in, self._take_rejects(), last=True)

    def _take_rejects(self) -> list[dict]:
        taken, self.rejects = self.rejects, []
        return taken

    def _batch(self, ids, texts, urls, rownos) -> pa.RecordBatch:
        arrays = [
            pa.array(ids, pa.string()),
            pa.array(texts, pa.string()),
            pa.array([self.source] * len(ids), pa.string()),
            pa.array(urls, pa.string()),
        ]
        if self.rows:
            return pa.RecordBatch.from_arrays([*arrays, pa.array(rownos, pa.int64())], schema=DOCUMENT_ROWS)
        return pa.RecordBatch.from_arrays(arrays, schema=DOCUMENT_SCHEMA)

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        """The valid documents (the rejects collect in `self.rejects`)."""
        rejects = []
        for piece in self.pieces():
            if isinstance(piece, Cut):
                rejects += piece.rejects
            else:
                yield piece
        self.rejects = rejects

    def pieces(self, every: int | None = None) -> Iterator[pa.RecordBatch | Cut]:
        """The valid documents in batches, and a Cut (the rows and rejects since the last one) after
        every `every` rows and at the end: one pass over the input makes many shards."""
        s = self.shard
        try:
            if s.fmt == "parquet":
                yield from self._documents(self._parquet_rows(), every)
            else:
                yield from self._documents(self._json_rows(), every)
        except SourceError:
            raise
        except Exception as e:  # a truncated gzip/zstd/parquet: fail this shard, naming the file
            raise SourceError(
                f"cannot read {s.uri} (rows {s.start}..{s.stop}): {type(e).__name__}: {e}"
            ) from e

    def check_head(self) -> None:
        """Raise NoTextColumn where no row among this file's first objects has the text column
        (`TextColumn`), or a parquet file has no such column: a wrong --text-column, which every file
        would fail alike. Reads until the column is seen (one row, as a rule; at most
        NOT_JSON_LINES_AFTER objects). The driver asks it of the first file before any shard runs, so
        a wrong column is one refusal, not every shard failing; a file wrong in its own way (empty,
        damaged, no JSON lines) is left to its shard, which fails naming it while the others go on."""
        rows = self._parquet_rows() if self.shard.fmt == "parquet" else self._json_rows()
        try:
            for _, row, _ in rows:
                if row is not None and self.text_column in row:
                    return
        except NoTextColumn:
            raise
        except Exception:  # noqa: BLE001 - a file of its own fault (empty, damaged): its shard fails
            return

    # -- readers
    def _json_rows(self) -> Iterator[tuple[int, dict | None, str | None]]:
        """Each line as a row. A file that is not JSON lines fails its shard, naming it, rather than
        give every line as an `invalid_json` reject: one whose first non-blank character is `[` (a
        JSON array, pretty-printed or on one line), or one with no JSON object among its first
        `NOT_JSON_LINES_AFTER` non-blank lines (or in the whole of a shorter one: a pretty-printed
        object, another format). Both are judged on the file from its first line, also by a task that
        resumes past committed shards, so a rerun fails it again rather than resume past the judgement.
        The text column is judged the same way (`TextColumn`): whatever the shard size, a row without
        it is a `missing_text` reject, and a file none of whose first objects has it is refused."""
        s = self.shard
        content_seen, objects, lines = False, 0, 0  # counted from the file's first line
        column = TextColumn(self.text_column, s.uri)
        with _open_binary(s.uri, s.fmt) as f:
            for rowno, line in enumerate(f):
                if not content_seen:
                    head = line.lstrip(codecs.BOM_UTF8 + b" \t\r\n")
                    content_seen = bool(head)
                    if head.startswith(b"["):
                        raise SourceError(
                            f"{s.uri} is a JSON array, not JSON lines: write one JSON object per line "
                            f"(e.g. `jq -c '.[]' {s.uri.rsplit('/', 1)[-1]}`)"
                        )
                if rowno < s.start:
                    if not column.judged and line.strip():  # a resumed task judges these lines too
                        lines += 1
                        row = _json_object(line)
                        objects += row is not None
                        self._check_json_lines(lines, objects, end=False)
                        column.see(row)
                    continue
                if s.stop is not None and rowno >= s.stop:
                    break
                if rowno == 0 and line.startswith(codecs.BOM_UTF8):  # files saved by Windows editors
                    line = line[len(codecs.BOM_UTF8) :]
                try:
                    line_text = line.decode("utf-8")
                except UnicodeDecodeError:
                    # keep what parses: invalid bytes inside a string become a counted reject
                    line_text = line.decode("utf-8", "surrogateescape")
                if not line_text.strip():
                    yield rowno, None, "empty"
                    continue
                lines += 1
                row = _json_object(line_text)
                if row is None:
                    self._check_json_lines(lines, objects, end=False)
                    yield rowno, None, "invalid_json"
                    continue
                objects += 1
                column.see(row)
                yield rowno, row, None
        self._check_json_lines(lines, objects, end=s.stop is None)
        column.see(None, end=s.stop is None)

    def _check_json_lines(self, lines: int, objects: int, end: bool) -> None:
        """Refuse the file when no JSON object is among its first NOT_JSON_LINES_AFTER non-blank lines,
        or (`end`: all of it was read) among all of them."""
        if not objects and (lines >= NOT_JSON_LINES_AFTER or (end and lines)):
            raise SourceError(
                f"{self.shard.uri} is not JSON lines: none of its {'first ' if not end else ''}{lines} "
                "non-blank line(s) is a JSON object (a pretty-printed JSON document?); write one JSON "
                "object per line"
            )

    def _parquet_rows(self) -> Iterator[tuple[int, dict | None, str | None]]:
        s = self.shard
        pf = pq.ParquetFile(storage.open_input(s.uri))  # local or remote: only the row groups needed are read
        names = pf.schema_arrow.names
        if self.text_column not in names:
            raise NoTextColumn(
                f"{s.uri} has no {self.text_column!r} column (columns: {', '.join(names)}); "
                "pass --text-column NAME"
            )
        columns = [c for c in ("id", self.text_column, "url") if c in names]
        stop = s.stop if s.stop is not None else pf.metadata.num_rows
        # read only the row groups that overlap [start, stop)
        first = 0
        for rg in range(pf.num_row_groups):
            n = pf.metadata.row_group(rg).num_rows
            if first + n > s.start and first < stop:
                table = pf.read_row_group(rg, columns=columns)
                lo, hi = max(s.start - first, 0), min(stop - first, n)
                for i, row in enumerate(table.slice(lo, hi - lo).to_pylist()):
                    yield first + lo + i, row, None
            first += n
            if first >= stop:
                break


_MISSING = object()
# JSON lines hold a JSON object among their first lines: a file with none among its first 100 non-blank
# lines (or in all of a shorter one) is not JSON lines, whatever a line's error
NOT_JSON_LINES_AFTER = 100


def _json_object(line: bytes | str) -> dict | None:
    """The JSON object a line holds, else None (not JSON, another JSON value, or nested deeper than
    the decoder's recursion: one bad line, an `invalid_json` reject, never its file's failure)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "surrogateescape").lstrip("\ufeff")
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None
    return row if isinstance(row, dict) else None


class TextColumn:
    """Whether a JSON-lines file holds the text column, judged on the file from its first object, so
    every shard of it judges alike: a wrong column name (no object among the first
    `NOT_JSON_LINES_AFTER`, or in the whole of a shorter file, has the field) fails the file, naming
    the fields it has; otherwise a row without the field is one `missing_text` reject."""

    def __init__(self, name: str, uri: str):
        self.name, self.uri = name, uri
        self.objects, self.judged = 0, False
        self.fields: dict[str, None] = {}  # the fields the objects have, named in the refusal

    def see(self, row: dict | None, end: bool = False) -> None:
        if self.judged:
            return
        if row is not None:
            if self.name in row:
                self.judged = True
                return
            self.objects += 1
            if len(self.fields) < 50:
                self.fields.update(dict.fromkeys(row))
        if self.objects >= NOT_JSON_LINES_AFTER or (end and self.objects):
            raise NoTextColumn(
                f"{self.uri}: none of its {'first ' if not end else ''}{self.objects} rows has a "
                f"{self.name!r} field (fields found: {', '.join(map(str, self.fields)) or 'none'}); "
                "pass --text-column NAME"
            )


def rejects_table(rejects: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rejects, schema=REJECT_SCHEMA)


# What shows nothing on its own: format characters (zero-width spaces and joiners, a byte-order mark,
# bidi marks), marks with no base to sit on (combining marks, variation selectors), control characters
INVISIBLE_CATEGORIES = frozenset({"Cf", "Mn", "Me", "Cc"})
# ... and the letters and symbols Unicode draws as blank (Hangul fillers, the Braille blank)
BLANK_CHARACTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def is_blank(text: str) -> bool:
    """True for text with nothing to read: empty, or only whitespace and characters that show nothing
    (INVISIBLE_CATEGORIES, BLANK_CHARACTERS), which a tokenizer still turns into tokens. Stops at the
    first visible character, so a real document costs one."""
    return all(
        c.isspace() or c in BLANK_CHARACTERS or unicodedata.category(c) in INVISIBLE_CATEGORIES for c in text
    )


def _is_utf8(value: str) -> bool:
    """False for strings holding lone surrogates (invalid bytes read with surrogateescape, or JSON
    escapes like \\udc80): Arrow cannot store them, and they are no text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# ---------------------------------------------------------------- hub datasets


@dataclass(frozen=True)
class HubFiles:
    """A hub dataset resolved at planning: its commit sha and its data files (hf:// URLs at that sha)."""

    spec: str
    revision: str
    files: tuple[str, ...]


def hub_files(hub: HubId, revision: str | None = None) -> tuple[str, list[str]]:
    """(commit sha, data files of hub.config / hub.split as hf:// URLs pinned to that sha): the one
    function that talks to the hub (the tests replace it). `revision`: a sha, branch or tag to pin;
    else the dataset's current main, resolved here once."""
    import datasets
    from huggingface_hub import HfApi

    try:
        sha = HfApi().dataset_info(hub.repo, revision=revision).sha
        builder = datasets.load_dataset_builder(hub.repo, name=hub.config, revision=sha)
        files = builder.config.data_files[hub.split]
    except KeyError:
        splits = ", ".join(builder.config.data_files or {}) or "none"
        raise SourceError(f"hf:{hub.repo} has no split {hub.split!r} (splits: {splits})") from None
    except (OSError, ValueError, ImportError) as e:  # ConnectionError, DatasetNotFoundError, offline
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise SourceError(
            f"cannot open the hub dataset hf:{hub.repo} ({type(e).__name__}: {first}); check its name, "
            "config, split and --revision, the network, and HF_HUB_OFFLINE / HF_TOKEN"
        ) from None
    return sha, [str(f) for f in files]


def resolve_hub(specs: list[str], revision: str | None = None) -> dict[str, HubFiles]:
    """The hub sources among `specs`, each resolved to one revision and its files (once, at planning)."""
    out = {}
    for spec in specs:
        if spec.startswith("hf:"):
            sha, files = hub_files(parse_hub_id(spec), revision)
            if not files:
                raise SourceError(f"{spec} at revision {sha} has no data files")
            out[spec] = HubFiles(spec, sha, tuple(files))
    return out


def hub_shards(hub: HubFiles, shard_docs: int | None = None) -> list[ShardInput]:
    """Shards of a hub dataset: parquet files by row group (several consecutive ones up to
    `shard_docs` rows), so a worker opens only the row groups of its shard; other files whole.
    The footers are read in parallel, each one ranged request."""
    footers = _footers([u for u in hub.files if file_format(u) == "parquet"])
    shards: list[ShardInput] = []
    for url in hub.files:
        whole = ShardInput(uri=url, fmt=file_format(url) or "parquet")
        shards += _row_group_shards(whole, footers[url], shard_docs) if url in footers else [whole]
    return shards
