"""One storage layer: local paths and URLs (s3://, gs://, hf://, memory://) through fsspec.

Every stage, reader, writer, manifest, lock and checkpoint goes through here. A local path stays a
`pathlib.Path` (POSIX gives atomic rename and file locks); a URL becomes a universal-pathlib `UPath`
over fsspec, the layer `datasets`, datatrove and Ray Data build on. Credentials and endpoints come from
each store's own variables and files (S3: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_PROFILE, ~/.aws; GCS: GOOGLE_APPLICATION_CREDENTIALS), never from flags that land in logs.

The commit protocol (docs/reliability.md): a file appears under its final name whole or not at all.
Locally a temp file is renamed into place; on an object store the upload is held back
(`autocommit=False`) and completed in one call, so a killed writer leaves nothing visible.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Union

from filelock import FileLock, Timeout

if TYPE_CHECKING:
    import pyarrow

try:  # a UPath for URLs; local paths never need it
    from upath import UPath
except ImportError:  # pragma: no cover - a declared dependency
    UPath = None

AnyPath = Union[Path, "UPath"]  # noqa: UP007 - UPath may be absent at import
TMP_MARK = ".tmp-"
# The stores whose drivers are extras, and the extra that installs each.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class StorageError(OSError):
    """A location that cannot be used (no driver, no bucket, no credentials); the message says why."""


def is_url(location: str | os.PathLike) -> bool:
    """Whether `location` names an object store (or any fsspec protocol) rather than a local path."""
    s = str(location)
    return "://" in s and not s.startswith("file://")


#: The schemes of stores and servers a location names as a URL: a local path that starts with one and a
#: colon is a URL mistyped (`url_slip`). Not fsspec's whole registry: `data:x.jsonl` is a file's name.
STORE_SCHEMES = frozenset(
    (
        "s3",
        "s3a",
        "gs",
        "gcs",
        "az",
        "abfs",
        "abfss",
        "adl",
        "hdfs",
        "webhdfs",
        "http",
        "https",
        "ftp",
        "sftp",
        "oss",
        "oci",
    )
)


def has_glob_chars(text: str) -> bool:
    """Whether `text` holds a character `glob` reads as a wildcard."""
    return any(ch in text for ch in "*?[")


def glob_not_expanded(location) -> str:
    """The refusal of a quoted glob where a command takes directories and files and reads what is
    named (a command that reads sources expands globs itself: transforms/sources.py)."""
    return (
        f"{location} does not exist; as a glob it is not expanded here: give the directory, or its "
        "files (unquoted, the shell expands the glob)"
    )


def url_slip(location: str | os.PathLike) -> str | None:
    """Why `location` is refused as a local path when it reads as a store's URL with a slash missing
    (`s3:/bucket/key`, `gs:bucket`): taken as typed it names a local folder `s3:`, so a command would
    write there, exit 0, and put nothing in the store. None for any other location (`hf:OWNER/NAME`
    is a source's hub id)."""
    s = str(location)
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):(?!//)", s)
    scheme = m.group(1).lower() if m else None
    if scheme not in STORE_SCHEMES or is_url(s):
        return None
    return (
        f"{s} is not a URL: write {scheme}://{s[m.end() :].lstrip('/')} (two slashes), or a local folder "
        f"named '{m.group(1)}:' by its absolute path"
    )


def path(location: str | os.PathLike) -> AnyPath:
    """A `Path` for a local path (or file:// URL), a `UPath` for a URL. Refuses a store whose driver
    is not installed with the pip command that installs it."""
    if isinstance(location, Path) or (UPath is not None and isinstance(location, UPath)):
        return location
    s = str(location)
    if s.startswith("file://"):
        return Path(s[len("file://") :])
    if not is_url(s):
        if why := url_slip(s):
            raise StorageError(why)
        return Path(s)
    protocol, rest = s.split("://", 1)
    if "//" in rest.rstrip("/") or not rest.strip("/"):  # s3://bucket//key: an empty key part
        raise StorageError(
            f"{s} has an empty part between slashes (or no bucket): write {protocol}://BUCKET/KEY with "
            "single slashes"
        )
    if {".", ".."} & set(rest.rstrip("/").split("/")):  # a store keeps them as literal key parts
        raise StorageError(
            f"{s} has a '.' or '..' part, which {protocol}:// does not resolve (the keys would hold it "
            "as written, beside or inside what it names): write the location without it"
        )
    try:
        # no listings cache: other processes (workers, a concurrent run) write the same prefixes
        return UPath(s, use_listings_cache=False)
    except (ImportError, ValueError) as e:
        extra = EXTRAS.get(protocol)
        hint = f": pip install 'entroweight[{extra}]'" if extra else ""
        raise StorageError(f"cannot open {s} ({e}){hint}") from None


def is_local(p: str | os.PathLike) -> bool:
    if isinstance(p, str):
        return not is_url(p)
    return not (UPath is not None and isinstance(p, UPath) and p.protocol not in ("", "file", "local"))


def url(p: AnyPath) -> str:
    """The string a user would type for `p`: a local path, or protocol://bucket/key."""
    return str(p)


def same(a: AnyPath, b: AnyPath) -> bool:
    return key(a) == key(b)


def key(p: AnyPath) -> str:
    """A canonical form for comparing locations: the resolved local path, or the URL without a trailing /."""
    p = path(p)
    if is_local(p):
        return str(Path(p).resolve())
    return str(p).rstrip("/")


def parents(p: AnyPath) -> list[str]:
    """The canonical keys of every directory above `p` (for 'is --out inside an input?')."""
    k = key(p)
    if is_local(path(p)):
        return [str(q) for q in Path(k).parents]
    proto, rest = k.split("://", 1)
    return [f"{proto}://{q}" for q in PurePosixPath(rest).parents if str(q) != "."]


# ------------------------------------------------------------------ the path rule


def blank(location) -> bool:
    """Whether `location` names nothing: "" or spaces, what `"$DIR"` gives with DIR unset. Taken as a
    path it would be the working directory, so every place that takes a location refuses it."""
    return location is not None and not str(location).strip()


class OutputRefused(ValueError):
    """A command's output that may not be written where it was asked (the message names it and why)."""


def forms(location) -> set[str]:
    """The canonical keys of `location`: as resolved (through every symlink) and, locally, as written."""
    keys = {key(location)}
    if is_local(path(location)):
        keys.add(os.path.abspath(str(location)))
    return keys


def _above(location) -> set[str]:
    out = set(parents(location))
    if is_local(path(location)):
        out |= {str(q) for q in Path(os.path.abspath(str(location))).parents}
    return out


def relation(out, read) -> str:
    """How `out` stands to `read`: "is", "lies inside", "holds", or "" when apart (symlinks followed)."""
    o, r = forms(out), forms(read)
    if o & r:
        return "is"
    if r & _above(out):
        return "lies inside"
    if o & _above(read):
        return "holds"
    return ""


def as_meant(location: str) -> str:
    """A local `location` as typed, but where a `..` follows a directory that does not exist
    (`new/../x`): the path it means (`os.path.realpath`, which takes such a `..` as it reads). The
    kernel cannot pass through a missing directory, so a command making the directories on the way
    (mkdir -p) made `new` and left it behind, inside what another part of the path names."""
    parts = Path(location).parts
    for i, part in enumerate(parts):
        if part == ".." and not Path(*parts[:i]).is_dir():
            return os.path.realpath(location)
    return location


def check_place(out, flag: str = "--out", file: bool = False) -> None:
    """Refuse a local `out` where nothing can be made: a directory (`file`: the one file written) that
    is an existing file, or a location below a file (a data file taken for a directory)."""
    if not is_local(out):
        return
    p = path(out)
    if not file and p.exists() and not p.is_dir():
        raise OutputRefused(f"{flag} {out} is a file: name a directory to write into")
    if (above := _file_above(p)) is not None:
        raise OutputRefused(
            f"{flag} {out} lies below {above}, which is a file: name a location in a directory"
        )


def _file_above(p: Path) -> Path | None:
    """The nearest existing ancestor of `p`, when it is not a directory (nothing can be made below it)."""
    for parent in p.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def some_of(names: list[str], n: int = 3) -> str:
    """The first `n` names, and how many more: what a message lists of a long list."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def filesystem(p: AnyPath):
    """The fsspec filesystem and the path inside it (for pyarrow and bulk calls)."""
    p = path(p)
    if is_local(p):
        import fsspec

        return fsspec.filesystem("file"), str(Path(p).absolute())
    return p.fs, p.path


# ------------------------------------------------------------------ reading


def open_input(p: AnyPath) -> IO[bytes]:
    """A binary file object for reading, local or remote (pyarrow and the JSON readers take it)."""
    p = path(p)
    if is_local(p):
        return open(p, "rb")
    fs, inner = filesystem(p)
    return fs.open(inner, "rb")


def size(p: AnyPath) -> int:
    p = path(p)
    if is_local(p):
        return os.path.getsize(p)
    fs, inner = filesystem(p)
    return int(fs.size(inner))


def stat(p: AnyPath) -> tuple[int, int | None]:
    """(size, mtime in ns or None): what marks a source file as changed since it was planned. Object
    stores have no stable mtime across listings, so their size plus the sha of the plan stands alone."""
    p = path(p)
    if is_local(p):
        st = os.stat(p)
        return st.st_size, st.st_mtime_ns
    return size(p), None


def sha256(p: AnyPath, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open_input(p) as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def read_hashed(p: AnyPath, size: int | None = None, chunk: int = 1 << 22) -> tuple[pyarrow.Buffer, str]:
    """(the file's bytes, their sha256), in one read: each chunk is hashed as it arrives, into one
    buffer (`size` when known, else the file's), which pyarrow then parses (`pa.BufferReader`), so a
    reader that checks a shard against its manifest never reads the file twice. The one hashing
    reader: `DataDir`'s parts (schemas/datadir.py `Part.read`) and through them every reader of a
    stage's output use it.

    The buffer is Arrow's own, not a Python object's: Arrow's threads may drop the last reference to
    it while the interpreter exits, and releasing a Python buffer there needs the GIL, which a thread
    can no longer take then (the process aborts: "terminate called without an active exception")."""
    import pyarrow as pa

    h = hashlib.sha256()
    with open_input(p) as f:
        if size is None:
            size = os.fstat(f.fileno()).st_size if is_local(p) else int(f.size)
        buf = pa.allocate_buffer(size + 1)  # one spare byte: a file grown since it was listed shows itself
        n = 0
        with memoryview(buf).cast("B") as view:
            while n < len(view):
                got = f.readinto(view[n : n + chunk])
                if not got:
                    break
                h.update(view[n : n + got])
                n += got
        for block in iter(lambda: f.read(chunk), b""):  # longer still: hashed, not kept
            h.update(block)
            n += len(block)
    return buf.slice(0, min(n, size)), h.hexdigest()


def listing(directory: AnyPath) -> dict[str, int]:
    """{file name: size} of the files directly in `directory`, in one call (one LIST on an object store,
    however many shards it holds); {} when it does not exist."""
    d = path(directory)
    if is_local(d):
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        found = {}
        for e in entries:  # one removed since it was listed (a temp file renamed into place) is gone:
            with contextlib.suppress(FileNotFoundError):  # the rest are still the directory's content
                if e.is_file():
                    found[e.name] = e.stat().st_size
        return found
    fs, inner = filesystem(d)
    try:
        entries = fs.ls(inner, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    own = inner.rstrip("/")
    return {  # ls of a file lists the file itself: that is no directory's content
        e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
        for e in entries
        if e.get("type") == "file" and e["name"].rstrip("/") != own
    }


def walk(directory: AnyPath) -> dict[str, int]:
    """{path relative to `directory` (with /): size} of every file under it, recursively, in one
    listing on an object store (local: os.walk). Directories themselves are not listed."""
    d = path(directory)
    if is_local(d):
        out = {}
        for root, _, files in os.walk(d):
            for f in files:
                full = os.path.join(root, f)
                with contextlib.suppress(FileNotFoundError):
                    out[os.path.relpath(full, d).replace(os.sep, "/")] = os.path.getsize(full)
        return out
    fs, inner = filesystem(d)
    root = inner.rstrip("/") + "/"
    try:
        found = fs.find(inner, detail=True)
    except FileNotFoundError:
        return {}
    return {k[len(root) :]: int(v.get("size") or 0) for k, v in found.items() if k.startswith(root)}


def read_many(paths: list[AnyPath], threads: int = 32) -> list[bytes]:
    """The bytes of many small files (manifests), fetched in parallel on an object store."""
    if not paths:
        return []
    ps = [path(p) for p in paths]
    if all(is_local(p) for p in ps):
        return [Path(p).read_bytes() for p in ps]
    fs, _ = filesystem(ps[0])
    inner = [filesystem(p)[1] for p in ps]
    if getattr(fs, "async_impl", False):  # s3fs, gcsfs: concurrent GETs on the filesystem's own loop
        import inspect

        from fsspec.asyn import _run_coros_in_chunks, sync

        # not fs.cat(list): it expands each path first; nor s3fs's chunked read: a HEAD per file
        one = (
            {"max_concurrency": 1} if "max_concurrency" in inspect.signature(fs._cat_file).parameters else {}
        )
        coros = [fs._cat_file(p, **one) for p in inner]
        return sync(fs.loop, _run_coros_in_chunks, coros, batch_size=threads * 4)
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fs.cat_file, inner))


@contextlib.contextmanager
def local_copy(location: AnyPath) -> Iterator[Path]:
    """A local directory holding `location`'s files: the path itself when local; for a URL, its
    files (recursively) downloaded to a temp directory that is removed afterwards (a checkpoint to
    load, where the loaders want files)."""
    p = path(location)
    if is_local(p):
        yield Path(p)
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="entroweight-copy-") as tmp:
        if not download_dir(p, Path(tmp)):
            raise FileNotFoundError(f"{location} holds no file")
        yield Path(tmp)


@contextlib.contextmanager
def staged(location: AnyPath, last: tuple[str, ...] = ()) -> Iterator[Path]:
    """A local directory to write `location`'s files in: the path itself when local; for a URL a temp
    directory whose files are uploaded there once the block succeeds (a failed block uploads nothing).
    For the writers that need files on disk (transformers' save_pretrained, the tokenizer, lm-eval);
    `Path(url)` would instead write a local folder named `s3:`. `last`: uploaded after the others
    (the record that seals the output)."""
    p = path(location)
    if is_local(p):  # created by the writer, once it writes: a refused one leaves no directory
        yield Path(p)
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="entroweight-out-") as tmp:
        yield Path(tmp)
        upload_dir(Path(tmp), p, last)


def download_dir(location: AnyPath, local: Path) -> int:
    """Copy every file under `location` (a URL) into the local directory `local`; returns how many."""
    fs, inner = filesystem(location)
    files = walk(location)
    for rel in files:
        dest = Path(local) / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{inner.rstrip('/')}/{rel}", str(dest))
    return len(files)


def upload_dir(local: Path, location: AnyPath, last: tuple[str, ...] = ()) -> None:
    """Copy a local directory's files to `location` (a URL), each atomically; the names in `last` go
    after all the others, in that order (the file that commits a checkpoint comes last)."""
    root = Path(local)
    rels = sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file() and TMP_MARK not in f.name)
    ordered = [r for r in rels if r not in last] + [r for r in last if r in rels]
    for rel in ordered:
        with open(root / rel, "rb") as src, AtomicFile(path(location) / rel) as dst:
            for block in iter(lambda: src.read(1 << 24), b""):  # noqa: B023 - read in this loop
                dst.write(block)


# ------------------------------------------------------------------ writing


def mkdir(p: AnyPath) -> None:
    """Create a local directory; object stores have no directories (a key's prefix is enough)."""
    p = path(p)
    if is_local(p):
        p.mkdir(parents=True, exist_ok=True)


def check_writable(directory: AnyPath) -> None:
    """Refuse an --out that cannot be written before any work: read-only, not a directory, no bucket,
    no credentials. On an object store this writes and deletes one small probe object."""
    d = path(directory)
    if is_local(d):
        d.mkdir(parents=True, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
        return
    probe = d / f"{TMP_MARK}probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except Exception as e:  # botocore's NoCredentialsError, ClientError(NoSuchBucket), ...
        raise StorageError(f"{type(e).__name__}: {e}") from None


class AtomicFile:
    """A binary sink that becomes visible under its final name on `commit()`, never before; `discard()`
    leaves nothing. Local: a temp file beside it, fsynced and renamed. Remote: an upload held back
    (fsspec's autocommit=False) and completed, or aborted, in one call."""

    def __init__(self, p: AnyPath):
        self.path = path(p)
        if is_local(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.tmp: Path | None = self.path.with_name(f"{self.path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
            self.file = open(self.tmp, "wb")
        else:
            fs, inner = filesystem(self.path)
            self.tmp = None
            self.file = fs.open(inner, "wb", autocommit=False)
        self._sha = hashlib.sha256()  # hashed as written: the file is never read back
        self.size = 0

    def write(self, data) -> int:
        self._sha.update(data)
        self.size += len(memoryview(data).cast("B"))
        return self.file.write(data)

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    # what pyarrow asks of a Python file object it writes to
    closed = property(lambda self: self.file.closed)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass  # flushed once, on commit

    def writable(self) -> bool:
        return True

    def commit(self) -> None:
        if self.tmp is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)  # atomic on POSIX within one filesystem
        else:
            self.file.close()
            if hasattr(self.file, "commit"):  # the memory store has no held-back uploads
                self.file.commit()

    def discard(self) -> None:
        if self.tmp is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.tmp.unlink(missing_ok=True)
        else:
            with contextlib.suppress(Exception):
                if hasattr(self.file, "discard"):
                    self.file.discard()
                self.file.closed = True  # already aborted: closing again would upload

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def write_bytes_atomic(data: bytes, p: AnyPath) -> None:
    with AtomicFile(p) as f:
        f.write(data)


def write_text_atomic(text: str, p: AnyPath) -> None:
    write_bytes_atomic(text.encode("utf-8"), p)


def write_json_atomic(obj: dict, p: AnyPath) -> None:
    write_text_atomic(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", p)


def remove_stale_tmp(directory: AnyPath) -> int:
    """Delete the temp files a killed run left behind locally; returns how many. Object stores have
    none: an upload that was never completed is invisible (and the store expires it)."""
    d = path(directory)
    if not is_local(d):
        return 0
    n = 0
    for p in Path(d).rglob(f"*{TMP_MARK}*"):
        p.unlink(missing_ok=True)
        n += 1
    return n


def json_record(p: AnyPath) -> dict | None:
    """The JSON object a command wrote at `p`, or None where it is absent, does not parse or is no
    mapping (edited into something else): the one lenient reader of a command's own records."""
    try:
        record = json.loads(path(p).read_bytes())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def remove(p: AnyPath) -> None:
    p = path(p)
    with contextlib.suppress(FileNotFoundError):
        p.unlink()


def remove_tree(directory: AnyPath) -> None:
    d = path(directory)
    if is_local(d):
        shutil.rmtree(d, ignore_errors=True)
    else:
        fs, inner = filesystem(d)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(inner, recursive=True)


# ------------------------------------------------------------------ locks


class LockBusy(Exception):
    """Another holder has the lock (its description in the message)."""


class OutputHeld(LockBusy):
    """Another run holds the output a command writes (the message names it and what to do)."""


#: the lock a run holds on the output it writes (`holding_output`), a stage's and a workflow's too
LOCK_FILE = ".lock"


def lock_location(out) -> AnyPath:
    """Where a run holds its lock on `out`: `out/.lock` (a file lock locally, a lease object on an
    object store)."""
    root = path(key(out)) if is_local(out) else path(out)  # where a link leads: one place, however named
    return root / LOCK_FILE


def _wait_free(at: AnyPath, wait: float) -> None:
    """Wait up to `wait` seconds for no run to hold the lock at `at` (LockBusy past it). No lock file
    or lease there: free, nothing written. A local lock file the lock made anew while this waited
    (its holder removed its own on the way out) is removed again; one that was there is left as it
    was (a stage's, which stays with its output)."""
    try:
        there = at.exists()
    except Exception:  # noqa: BLE001 - unreachable (no bucket, no credentials): the checks after say why
        return
    if not there:
        return
    local = is_local(at)
    seen = _inode(at) if local else None
    held = lock(at, wait)
    try:
        if local and _inode(at) != seen:
            Path(at).unlink(missing_ok=True)
    finally:
        held.release()


def _inode(p) -> tuple[int, int] | None:
    """Which file lies at `p`: its inode and change time (a file made anew may reuse a freed inode)."""
    try:
        st = os.stat(p)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


@contextlib.contextmanager
def holding_output(out, wait: float = 0, advise_wait: bool = True):
    """Hold the lock on `out` while the block writes it (`lock` at `lock_location`): another run
    holding it is OutputHeld (exit 3) naming the holder, or with `wait` is queued behind; a dead
    holder's lock is taken over; StorageError where it cannot be written. Locally the lock file (and
    the directories made for it, where nothing else came into them) is removed before the lock is
    released: a run refused, or one that wrote nothing, leaves nothing behind (a run waiting on the
    removed file takes the lock anew: filelock checks that the file it locked still has a name)."""
    at = lock_location(out)
    local = is_local(at)
    made = []  # the directories that do not exist yet, deepest first: made for the lock file
    if local:
        for d in (Path(at).parent, *Path(at).parent.parents):
            if d.exists():
                break
            made.append(d)
    try:
        held = lock(at, wait)
    except LockBusy as e:
        _remove_empty(made)
        raise OutputHeld(held_message(out, e, wait, advise_wait)) from None
    except OSError as e:  # read-only, not a directory, no bucket
        _remove_empty(made)
        raise StorageError(f"cannot write to --out {out}: {e.strerror or e}") from None
    try:
        yield
    finally:
        try:
            if local:  # a lease object is removed by its release
                Path(at).unlink(missing_ok=True)
        finally:
            held.release()
            _remove_empty(made)


def held_message(out, busy: LockBusy, wait: float = 0, advise_wait: bool = True) -> str:
    """How every command (and a stage, and a workflow run) says that another run holds `out`."""
    if wait:
        advice = f"still held after --wait {wait:g}: give a longer --wait, or wait for it to finish"
    else:
        advice = "wait for it to finish" + (
            ", or pass --wait SECONDS to queue behind it" if advise_wait else ""
        )
    return f"another entroweight run holds {out} ({busy}); {advice}"


def wait_unheld(out, wait: float = 0, advise_wait: bool = True) -> None:
    """Wait up to `wait` seconds for no run to hold the lock on `out` (OutputHeld past it). Asked
    before judging what `out` holds: a run still writing there has not yet marked it as its output,
    so its files would read as a user's (exit 2, "write elsewhere"), and --overwrite would remove them
    from under it."""
    try:  # (a location refused as such: the path rule says why, next)
        _wait_free(lock_location(out), wait)
    except LockBusy as e:
        raise OutputHeld(held_message(out, e, wait, advise_wait)) from None
    except Exception:  # noqa: BLE001 - unreachable or unwritable: the checks after this say why
        return


def _remove_empty(dirs) -> None:
    for d in dirs:
        try:
            d.rmdir()
        except OSError:  # something was written there (or it is gone): keep it, and what holds it
            return


def clear_output(out) -> None:
    """Remove what `out` holds but the lock its run holds there (`holding_output`): --overwrite
    replacing another command's output, where `remove_tree` would delete the lock with it."""
    keep = lock_location(out).name
    root = path(out)
    if is_local(root):
        for p in Path(root).iterdir() if Path(root).is_dir() else ():
            if p.name == keep:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        return
    for rel in walk(root):
        if rel != keep:
            remove(root / rel)


class Lease:
    """A lock on an object store: an object created only if absent (a conditional put, `If-None-Match: *`,
    which S3 and GCS honour), naming its holder and when it expires. A heartbeat renews it while held;
    a holder that died stops renewing, and once its lease expires the next run takes it over.

    On S3 and GCS every change is conditional on what was read: a takeover overwrites the stale lease
    only if it is still the object read (S3: `If-Match` its ETag; GCS: `ifGenerationMatch` its
    generation), and a renewal only if it is still this holder's, so of several contenders for one
    expired lease exactly one wins, and a holder that lost its lease (paused past its TTL) never
    overwrites its successor's. Elsewhere (memory://, a store with neither) a takeover deletes the stale
    object and creates anew (the create is conditional; the delete is not)."""

    def __init__(self, p: AnyPath, ttl: float = 120.0):
        self.path = path(p)
        self.ttl = ttl
        self.holder = f"{getpass.getuser()}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._etag: str | None = None  # of the lease object this holder last wrote (S3 ETag, GCS generation)
        fs, inner = filesystem(self.path)
        self._s3 = hasattr(fs, "_call_s3")
        self._gcs = not self._s3 and "gs" in (
            fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        )
        self._conditional = self._s3 or self._gcs  # every write conditional on what was read
        self._fs, (self._bucket, _, self._key) = fs, inner.partition("/")

    def _record(self) -> bytes:
        return json.dumps({"holder": self.holder, "expires": time.time() + self.ttl}).encode()

    # -- the object's conditional operations: (record, tag) read together; writes that hold only if
    # the object is still absent / still the one with that tag
    def _put(self, **condition) -> bool:
        """A conditional PutObject of a fresh record; False when its precondition failed."""
        if self._gcs:
            return self._gcs_put(condition)
        try:
            r = self._fs.call_s3(
                "put_object", Bucket=self._bucket, Key=self._key, Body=self._record(), **condition
            )
        except OSError as e:
            status = getattr(e.__cause__, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(e, FileExistsError) or status in (409, 412) or "pre-condition" in str(e):
                return False  # 409: a concurrent conditional write won
            raise
        self._etag = r["ETag"]
        return True

    def _gcs_put(self, condition: dict) -> bool:
        """The GCS form of `_put`: one media upload with `ifGenerationMatch` (0: only if absent; else
        only if the object is still that generation); a 412 (gcsfs: FileExistsError) is a lost race."""
        from urllib.parse import quote

        match = "0" if condition.get("IfNoneMatch") == "*" else str(condition["IfMatch"])
        try:
            r = self._fs.call(
                "POST",
                f"{self._fs._location}/upload/storage/v1/b/{quote(self._bucket)}/o",
                uploadType="media",
                name=self._key,
                ifGenerationMatch=match,
                headers={"Content-Type": "application/json"},
                data=self._record(),
                json_out=True,
            )
        except FileExistsError:
            return False
        self._etag = str(r["generation"])
        return True

    def _try_create(self) -> bool:
        if self._conditional:
            return self._put(IfNoneMatch="*")
        fs, inner = filesystem(self.path)
        try:
            with fs.open(inner, "xb") as f:
                f.write(self._record())
            return True
        except FileExistsError:
            return False

    def _read(self) -> tuple[dict | None, str | None]:
        """The lease's record and its ETag (GCS: generation), from one GET (None, None when absent)."""
        if self._gcs:
            try:
                headers, raw = self._fs.call("GET", self._fs.url(f"{self._bucket}/{self._key}"))
            except FileNotFoundError:
                return None, None
            generation = {k.lower(): v for k, v in headers.items()}["x-goog-generation"]
            try:
                return json.loads(raw), generation
            except ValueError:  # a torn or foreign object: treat as expired
                return {"holder": "?", "expires": 0}, generation
        if not self._s3:
            return self._current(), None
        from fsspec.asyn import sync

        async def get():
            r = await self._fs._call_s3("get_object", Bucket=self._bucket, Key=self._key)
            async with r["Body"] as body:
                return await body.read(), r["ETag"]

        try:
            raw, etag = sync(self._fs.loop, get)
        except FileNotFoundError:
            return None, None
        try:
            return json.loads(raw), etag
        except ValueError:  # a torn or foreign object: treat as expired
            return {"holder": "?", "expires": 0}, etag

    def _take_over(self, etag: str | None) -> bool:
        """Replace the stale lease read with tag `etag` by ours; False when another contender changed it
        first."""
        if self._conditional:
            return self._put(IfMatch=etag)
        remove(self.path)  # no conditional overwrite here: the conditional create decides the race
        return self._try_create()

    def _current(self) -> dict | None:
        try:
            return json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return None
        except ValueError:  # a torn or foreign object: treat as expired
            return {"holder": "?", "expires": 0}

    def acquire(self, wait: float = 0) -> None:
        deadline = time.monotonic() + wait
        while True:
            if self._try_create():
                break
            current, etag = self._read()
            if current is None:
                continue  # released between our create and our read: try again
            if current.get("expires", 0) < time.time() or _dead_here(current):
                if self._take_over(etag):  # its holder stopped renewing: dead
                    break
                continue
            if time.monotonic() >= deadline:
                who, expires = current.get("holder", "?"), float(current.get("expires", 0))
                until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
                odd = (  # no live holder writes past its TTL: a clock ahead, or a lease made by hand
                    f"; that is past the {self.ttl:.0f}-s lease a live run renews: if no run holds it, "
                    f"remove {url(self.path)}"
                    if expires - time.time() > 2 * self.ttl
                    else ""
                )
                raise LockBusy(f"lease held by {who} until {until}, renewed while it runs{odd}")
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        self._beat = threading.Thread(target=self._renew, daemon=True, name="entroweight-lease")
        self._beat.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with contextlib.suppress(Exception):
                if not self._conditional:
                    self.path.write_bytes(self._record())
                elif not self._put(IfMatch=self._etag):
                    return  # taken over while this holder was paused past its TTL: it is no longer ours

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        current, _ = self._read()
        if current is not None and current.get("holder") == self.holder:
            remove(self.path)


def _dead_here(lease: dict) -> bool:
    """Whether the lease's holder was a process of this machine that no longer runs (a killed run's
    lease is then taken over at once, not after its TTL)."""
    try:
        host, pid = str(lease.get("holder", "")).split("@", 1)[1].split(":")[:2]
        if host != socket.gethostname():
            return False
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (ValueError, IndexError, PermissionError, OSError):
        return False
    return False


class _FileLockAdapter:
    def __init__(self, p: Path):
        self.lock = FileLock(str(p))

    def acquire(self, wait: float = 0) -> None:
        try:
            self.lock.acquire(timeout=wait)
        except Timeout:
            raise LockBusy(f"lock file {self.lock.lock_file}") from None

    def release(self) -> None:
        self.lock.release()


def lock(p: AnyPath, wait: float = 0, ttl: float | None = None):
    """Acquire and return a lock at `p` (`.release()` it): a file lock locally, a lease on an object
    store. Raises LockBusy when another holder keeps it past `wait` seconds."""
    p = path(p)
    if is_local(p):
        held = _FileLockAdapter(Path(p))
    else:
        ttl = ttl if ttl is not None else float(os.environ.get("ENTROWEIGHT_LEASE_TTL", "120"))
        held = Lease(p, ttl=ttl)
    held.acquire(wait)
    return held


@contextlib.contextmanager
def locked(p: AnyPath, wait: float = 0) -> Iterator[None]:
    held = lock(p, wait)
    try:
        yield
    finally:
        held.release()
