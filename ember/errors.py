"""Errors ember raises. Every message names what went wrong and where."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import warnings
from collections.abc import Iterator


class EmberError(Exception):
    """An internal failure at a named stage, for a named op when one is known."""

    def __init__(self, stage: str, message: str, op: str | None = None):
        self.stage, self.op = stage, op
        where = f"stage '{stage}'" + (f", op '{op}'" if op else "")
        super().__init__(f"ember failed at {where}: {message}")


class UserInputError(ValueError):
    """The user gave ember something it cannot accept; the message says what to change."""


@contextlib.contextmanager
def stage(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Times a stage and names it in any internal error that escapes it; a `timings` that
    carries a compile's progress display (debug/progress.py StageTimes) shows the stage."""
    start = time.perf_counter()
    if (progress := getattr(timings, "progress", None)) is not None:
        progress.stage_started(name)
    try:
        yield
    except EmberError:
        raise
    except Exception as e:
        raise EmberError(name, f"{type(e).__name__}: {e}") from e
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def warn_running_eagerly(error: Exception) -> None:
    """The one warning a graph that ember could not compile gives (unless strict, which raises)."""
    warn_at_user_code(f"{error}\nember: running this graph eagerly instead (set EMBER_STRICT=1 to raise).")


def warn_at_user_code(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn, attributed to the innermost caller outside ember, torch and Python's own import
    machinery: the line of the user's program that led here, not a file inside torch."""
    frame = sys._getframe(1)
    while frame is not None and _is_library_file(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:  # nothing but library frames (e.g. a thread started by torch)
        warnings.warn(message, category, stacklevel=2)
        return
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    module = frame.f_globals.get("__name__", "<unknown>")
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno, module, registry)


@functools.cache
def _library_folders() -> tuple[str, ...]:
    import torch  # the caller has it loaded already: only warnings during compiles come here

    ember_folder = os.path.dirname(os.path.abspath(__file__))
    return (ember_folder + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def _is_library_file(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>, exec'd wrappers
        return filename.startswith("<frozen") or filename.startswith("<eval_with_key")
    return os.path.abspath(filename).startswith(_library_folders())
