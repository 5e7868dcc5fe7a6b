"""`ember cache clear` and `ember cache info`: what ember wrote into a cache folder.

A folder is an ember cache when it holds the marker file (cache.MARKER). Even then only
ember's own files are touched: in its entry folders (cache.ENTRY_KINDS), in their
two-hex-digit shard folders, files named by an entry key (40-64 hex digits, or a temporary
file starting with a dot and one) and the byte-code caches of older wrappers. Anything
else (a user's notes.txt in a folder they pointed EMBER_CACHE_DIR at) is left alone and
reported. Folders ember emptied are removed, then the marker, and the root itself only
when ember created it and nothing else is left.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ember.runtime.cache import ENTRY_KINDS, MARKER, forget_root

SHARD = re.compile(r"[0-9a-f]{2}")
ENTRY_FILE = re.compile(r"\.?(?P<key>[0-9a-f]{40,64})[-.][\w.-]*")
BYTECODE = re.compile(r"[0-9a-f]{40,64}\.[\w-]+\.pyc")  # older ember imported wrappers with a loader


@dataclass
class CacheContents:
    root: Path
    files: dict[str, list[Path]] = field(default_factory=dict)  # entry kind -> ember's files
    foreign: list[Path] = field(default_factory=list)  # what ember did not write

    @property
    def bytes(self) -> int:
        return sum(p.stat().st_size for paths in self.files.values() for p in paths if p.exists())


class NotAnEmberCache(Exception):
    pass


def ember_contents(root: Path) -> CacheContents:
    """The files ember wrote under `root`, by kind, and the foreign ones beside them."""
    if not (root / MARKER).is_file():
        raise NotAnEmberCache(
            f"{root} is not an ember cache (it has no {MARKER} marker file): nothing was removed. "
            "If an older ember made it, remove it yourself."
        )
    contents = CacheContents(root)
    for item in sorted(root.iterdir()):
        if item.name in ENTRY_KINDS and item.is_dir() and not item.is_symlink():
            contents.files[item.name] = _kind_files(item, contents.foreign)
        elif item.name != MARKER:
            contents.foreign.append(item)
    return contents


def _kind_files(folder: Path, foreign: list[Path]) -> list[Path]:
    files = []
    for shard in sorted(folder.iterdir()):
        if not (SHARD.fullmatch(shard.name) and shard.is_dir() and not shard.is_symlink()):
            foreign.append(shard)
            continue
        for item in sorted(shard.iterdir()):
            if _is_entry_file(item, shard.name):
                files.append(item)
            elif item.name == "__pycache__" and item.is_dir() and not item.is_symlink():
                bytecode = [p for p in item.iterdir() if BYTECODE.fullmatch(p.name) and p.is_file()]
                files += bytecode
                foreign += [p for p in item.iterdir() if p not in bytecode]
            else:
                foreign.append(item)
    return files


def _is_entry_file(path: Path, shard: str) -> bool:
    match = ENTRY_FILE.fullmatch(path.name)
    return match is not None and match["key"].startswith(shard) and path.is_file() and not path.is_symlink()


def clear(root: Path) -> CacheContents:
    """Removes ember's files from the cache at `root` (Note: the module docstring); returns
    what was removed and what was left alone. NotAnEmberCache when `root` has no marker."""
    contents = ember_contents(root)
    for paths in contents.files.values():
        for path in paths:
            path.unlink(missing_ok=True)
    for kind in contents.files:
        _remove_empty_folders(root / kind)
    forget_root(root)
    created = _marker(root).get("created_root") is True
    (root / MARKER).unlink(missing_ok=True)
    if created and not any(root.iterdir()):
        root.rmdir()
    return contents


def _marker(root: Path) -> dict:
    try:
        marker = json.loads((root / MARKER).read_text())
        return marker if isinstance(marker, dict) else {}
    except (OSError, ValueError):
        return {}


def _remove_empty_folders(folder: Path) -> None:
    for shard in folder.iterdir():
        for sub in (shard / "__pycache__", shard):
            try:
                sub.rmdir()
            except OSError:  # not empty (a foreign file), or not there
                pass
    try:
        folder.rmdir()
    except OSError:
        pass


def describe_removed(contents: CacheContents, size: int) -> str:
    counts = ", ".join(f"{kind} {len(paths)}" for kind, paths in contents.files.items() if paths) or "nothing"
    total = sum(len(paths) for paths in contents.files.values())
    lines = [f"removed {total} files ({size / 1e6:.1f} MB) ember wrote in {contents.root}: {counts}"]
    if contents.foreign:
        lines.append(
            f"left alone (not ember's): {', '.join(str(p.relative_to(contents.root)) for p in contents.foreign)}"
        )
    return "\n".join(lines)
