"""Errors ember raises. Every message names what went wrong and where."""

from __future__ import annotations

import contextlib
import time
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
