"""Progress of one graph's compile: a record per stage through `logging` (logger "ember"), and
on a terminal, once the compile has taken DELAY_S, one updating line on stderr.

    ember: compiling graph (12 s) codegen: 85/240 kernels generated, 60 compiled

The line is drawn by a daemon thread every TICK_S and erased when the compile ends. It is only
drawn when stderr is a terminal, so tests, pipes and log files never see it; the `logging`
records go wherever the application sends logs (nowhere by default, as `logging` does for
INFO records when it is not configured).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

logger = logging.getLogger("ember")

DELAY_S = 2.0
TICK_S = 0.25


class StageTimes(dict):
    """Seconds per stage, summed over its entries (errors.stage adds to it), and the compile's
    progress display, which shows the stage being run."""

    def __init__(self, progress: CompileProgress | None = None):
        super().__init__()
        self.progress = progress


class CompileProgress:
    """What one compile is doing now; safe to update from gcc's worker threads."""

    def __init__(self, stream: TextIO | None = None, delay_s: float = DELAY_S):
        self.stream = sys.stderr if stream is None else stream
        self.start = time.perf_counter()
        self.delay_s = delay_s
        self.stage = "starting"
        self.kernels_total = self.kernels_generated = self.kernels_compiled = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._drawn = 0  # characters of the line on screen
        self._ticker: threading.Thread | None = None
        if _is_terminal(self.stream):
            self._ticker = threading.Thread(target=self._tick, name="ember-progress", daemon=True)
            self._ticker.start()

    def stage_started(self, name: str) -> None:
        with self._lock:
            self.stage = name

    def kernels(self, total: int | None = None, generated: int = 0, compiled: int = 0) -> None:
        """Sets the kernel count, or adds kernels generated or compiled (gcc's threads call this)."""
        with self._lock:
            if total is not None:
                self.kernels_total = total
            self.kernels_generated += generated
            self.kernels_compiled += compiled

    def line(self) -> str:
        with self._lock:
            elapsed = time.perf_counter() - self.start
            text = f"ember: compiling graph ({elapsed:.0f} s) {self.stage}"
            if self.kernels_total:
                text += (f": {self.kernels_generated}/{self.kernels_total} kernels generated, "
                         f"{self.kernels_compiled} compiled")  # fmt: skip
            return text

    def finish(self) -> None:
        """Stops the line and erases it; logs the whole compile's time."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            if self._drawn:
                self.stream.write("\r" + " " * self._drawn + "\r")
                self.stream.flush()
        logger.info("graph compiled in %.3f s (%d kernels)", time.perf_counter() - self.start, self.kernels_total)

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            if time.perf_counter() - self.start < self.delay_s:
                continue
            text = self.line()
            self.stream.write("\r" + text.ljust(self._drawn))
            self.stream.flush()
            self._drawn = len(text)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False
