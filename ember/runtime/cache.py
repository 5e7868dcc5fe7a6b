"""Stage `runtime`: the on-disk cache that kernels, wrappers, Triton modules, graphs and
tuning records are written to and loaded from (cache_identity.py says what keys hold,
cache_clear.py removes what ember wrote).

Note: cache safety
    A cache is shared by processes and threads, copied or mounted on other machines, cut
    short by crashes and full disks, and sits in a folder others might reach. So:
    - Every entry records its full key and a sha256 of its payload (`write_entry`), and
      both are checked before the entry is used: a kernel's .so before dlopen, a Triton
      module or wrapper before it is executed (from the verified bytes in memory, never
      re-read). A torn, truncated, swapped or foreign entry is never loaded.
    - Any failure of any kind while loading an entry (not only OSError) discards it and the
      caller builds it again: `discard` removes it, counts `metrics.cache_entries_rebuilt`
      and logs one debug line on the logger "ember.cache".
    - Writes are atomic and durable: a temporary file in the entry's folder, fsynced,
      renamed over the entry, then the folder fsynced. Concurrent writers of one entry
      each rename a whole file; the last wins, and readers see one whole file or none.
    - A killed writer's temporary files (`.<name>.XXXX.tmp`, `.<name>.XXXX.so`) older than
      ORPHAN_AGE_S are removed from a folder whenever it is written again; younger ones
      may belong to a compile still running.
    - Folders are created 0700. Before code is loaded from a folder, the folder (and the
      file) must belong to this user and not be writable by group or others, else
      CacheDirectoryError names the path and what to do.
    - Paths inside entries are relative to the cache root, so a cache moved or copied
      elsewhere loads its own files.
    - A marker file (MARKER) names a folder as an ember cache; `ember cache clear` removes
      only ember's own files from a marked folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ember.errors import EmberError
from ember.metrics import metrics

log = logging.getLogger("ember.cache")

MARKER = ".ember-cache"
ENTRY_KINDS = ("kernels", "wrappers", "triton", "graphs", "search", "matmul")  # the folders ember writes under the root
ENTRY_FORMAT = 2  # the layout of a record written by `write_entry`
ORPHAN_AGE_S = 600.0  # a temporary file this old belongs to no running writer
# `.<entry name>.<random>.tmp|.so`: what write_atomic and temp_path_beside create (only those:
# the root may be a user's folder, with temporary files of their own)
ORPHAN_NAME = re.compile(r"\.(?:[0-9a-f]{64}[-.]|\.ember-cache\.)[\w.-]*\.(?:tmp|so)")


class CacheDirectoryError(EmberError):
    """A cache folder code must not be loaded from (another owner, or writable by others)."""

    def __init__(self, message: str):
        super().__init__("runtime", message)


class CorruptEntry(Exception):
    """An entry that fails its checks: the caller discards and rebuilds it."""


def content_hash(*parts: str | bytes) -> str:
    """A full sha256 (hex) of `parts`: the keys of every entry."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- the root and its folders -----------------------------------------------------------------

# Owned by this module: roots opened by this process (made, checked and marked once).
_opened_roots: set[Path] = set()
_opened_lock = threading.Lock()


def open_root(cache_dir: str | Path) -> Path:
    """The cache root as an absolute path, created private and marked at its first use in
    this process; raises CacheDirectoryError for a folder code must not come from."""
    root = Path(cache_dir).expanduser().absolute()
    with _opened_lock:
        if root not in _opened_roots:
            created = make_private_dir(root)
            check_private(root)
            if not (root / MARKER).is_file():
                write_atomic(root / MARKER, json.dumps({"ember_cache": ENTRY_FORMAT, "created_root": created}))
            _opened_roots.add(root)
    return root


def forget_root(root: Path) -> None:
    """After `ember cache clear`: the next use makes the folders and the marker again."""
    with _opened_lock:
        _opened_roots.discard(root)


def make_private_dir(folder: Path) -> bool:
    """Creates `folder` and any missing parent with mode 0700; whether `folder` was created."""
    if folder.is_dir():
        return False
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # another process made it first
            pass
    return True


def check_private(folder: Path) -> None:
    """Code is only loaded from folders this user owns that nobody else may write."""
    problem = why_not_private(os.lstat(folder))
    if problem is not None:
        raise CacheDirectoryError(
            f"cache folder {folder} {problem}: ember will not load code from it; "
            + (f"run `chmod go-w {folder}` or " if "writable" in problem else "")
            + "set EMBER_CACHE_DIR to a private folder of your own"
        )


def why_not_private(st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if st.st_uid != os.geteuid():
        return f"belongs to user id {st.st_uid}, not to this user ({os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def entry_folder(root: Path, kind: str, key: str) -> Path:
    """`root/kind/key[:2]`, created private; every folder on the way is checked."""
    assert kind in ENTRY_KINDS, kind
    folder = root / kind / key[:2]
    if not folder.is_dir():
        make_private_dir(folder)
    check_private(root / kind)
    check_private(folder)
    return folder


def entry_path(cache_dir: str | Path, kind: str, key: str, suffix: str) -> Path:
    return entry_folder(open_root(cache_dir), kind, key) / f"{key}{suffix}"


def relative_to_root(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def resolve_in_root(root: str | Path, relative: str) -> Path:
    """An entry's path from its path relative to the root (as entries store it), its
    folders checked (Note: cache safety)."""
    parts = Path(relative).parts
    if Path(relative).is_absolute() or ".." in parts or len(parts) != 3 or parts[0] not in ENTRY_KINDS:
        raise CorruptEntry(f"{relative!r} is not a path inside the cache")
    folder = entry_folder(open_root(root), parts[0], parts[1])  # code is loaded from it: checked
    return folder / parts[2]


# ---- writing --------------------------------------------------------------------------------


def write_atomic(path: Path, data: bytes | str) -> None:
    """`data` into `path`: a fsynced temporary file renamed over it, then the folder fsynced."""
    payload = data.encode() if isinstance(data, str) else data
    remove_orphans(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def temp_path_beside(path: Path, suffix: str) -> Path:
    """A unique path in `path`'s folder for a tool (gcc) to write before `install`."""
    remove_orphans(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    return Path(tmp)


def install(tmp: Path, path: Path) -> None:
    """A file a tool wrote at `tmp` becomes `path`, privately and durably."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fchmod(fd, 0o700)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Makes a rename in `folder` durable (a crash after it cannot bring the old entry back)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_orphans(folder: Path, now: float | None = None) -> None:
    """Removes temporary files older than ORPHAN_AGE_S: a writer killed before its rename."""
    now = time.time() if now is None else now
    try:
        entries = [e for e in os.scandir(folder) if ORPHAN_NAME.fullmatch(e.name)]
    except OSError:
        return
    for entry in entries:
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime > ORPHAN_AGE_S:
                os.unlink(entry.path)
                log.debug("cache: removed orphaned temporary file %s", entry.path)
        except OSError:  # another process removed or renamed it first
            pass


def write_if_different(path: Path, data: bytes) -> bool:
    """Makes `path` hold `data` (a file named by the hash of its contents); whether it
    already did. A file there with other bytes is damaged: it is counted as rebuilt."""
    try:
        if read_private(path) == data:
            return True
        reason = "contents differ from their name's hash"
    except FileNotFoundError:
        reason = ""
    except Exception as e:  # unreadable, another owner, a link: replaced all the same
        reason = f"{type(e).__name__}: {e}"
    if reason:
        count_rebuilt(str(path), reason)
    write_atomic(path, data)
    return False


# ---- keyed entries ---------------------------------------------------------------------------


def write_entry(path: Path, key: str, payload: Any) -> None:
    """A JSON entry that records its key and the sha256 of its payload."""
    body = json.dumps(payload)
    write_atomic(path, json.dumps({"format": ENTRY_FORMAT, "key": key, "sha256": sha256_bytes(body.encode()),
                                   "payload": body}))  # fmt: skip


def read_entry(path: Path, key: str) -> Any:
    """The payload of the entry at `path` for `key`; None when there is none; CorruptEntry
    when there is one that fails its checks (unreadable, another key, another checksum)."""
    try:
        data = read_private(path)
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data)
    except ValueError as e:
        raise CorruptEntry(f"not JSON ({e})") from e
    if not isinstance(record, dict) or record.get("format") != ENTRY_FORMAT:
        raise CorruptEntry("an entry of another format")
    if record.get("key") != key:
        raise CorruptEntry(f"the entry of key {str(record.get('key'))[:16]}..., not of {key[:16]}...")
    body = record.get("payload")
    if not isinstance(body, str) or sha256_bytes(body.encode()) != record.get("sha256"):
        raise CorruptEntry("payload does not match its checksum")
    return json.loads(body)


def read_entry_or_discard(path: Path, key: str) -> Any:
    """`read_entry`, with an entry that fails its checks discarded (None: build or measure again,
    Note: cache safety); a cache folder that is not safe to use still raises."""
    try:
        return read_entry(path, key)
    except CacheDirectoryError:
        raise
    except Exception as e:
        discard(e, path)
        return None


def read_private(path: Path) -> bytes:
    """A file's bytes, after checking that it is this user's and nobody else can write it
    (its folder was checked: entry_folder)."""
    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW)) as f:
        problem = why_not_private(os.fstat(f.fileno()))
        if problem is not None:  # in a private folder, so ours: replaced by a private one
            raise CorruptEntry(f"the file {problem}")
        return f.read()


def read_verified(path: Path, sha256: str) -> bytes:
    """A file's bytes when their sha256 is `sha256`; else CorruptEntry."""
    try:
        data = read_private(path)
    except FileNotFoundError as e:
        raise CorruptEntry("missing") from e
    if sha256_bytes(data) != sha256:
        raise CorruptEntry(f"contents do not match the checksum recorded for them ({len(data)} bytes)")
    return data


def discard(reason: BaseException | str, *paths: Path) -> None:
    """Removes a failed entry's files so that it is rebuilt; counts and logs it."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
    count_rebuilt(", ".join(map(str, paths)), reason)


def count_rebuilt(what: str, reason: BaseException | str) -> None:
    metrics.add(cache_entries_rebuilt=1)
    why = f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else reason
    log.debug("cache: discarding %s (%s); it is rebuilt", what, why)
