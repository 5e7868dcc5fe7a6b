"""The on-disk cache: content-addressed files written atomically.

Note: cache safety
    Every artifact is written to a unique temporary file in its final directory and then
    renamed into place (`os.replace` is atomic on POSIX), so a reader sees either nothing
    or a whole file, and concurrent processes building the same entry both succeed (the
    last rename wins with identical content). A file that exists but cannot be loaded is
    treated as corrupt: it is removed and rebuilt by the caller.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def content_hash(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:40]


def entry_path(cache_dir: Path, kind: str, key: str, suffix: str) -> Path:
    folder = cache_dir / kind / key[:2]
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{key}{suffix}"


def write_atomic(path: Path, data: bytes | str) -> None:
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_record(path: Path) -> Any:
    """A JSON record (a tuning winner: runtime/triton.py, runtime/search.py), or None when it
    is missing or unreadable: the caller measures again and writes a new one."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_record(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value))


def temp_path_beside(path: Path, suffix: str) -> Path:
    """A unique path in `path`'s folder for a tool (gcc) to write before the atomic rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    return Path(tmp)
