"""Stage `runtime` (GPU): Triton kernels compiled ahead of their first call, in parallel worker
processes (Note: the compile pool).

Takes `CompileRequest`s (runtime/triton_compile.py) and gives a `Future` per request, done when
a worker has compiled it into Triton's on-disk cache (and, for the first request of each list of
argument types, built Triton's C launcher for them, a gcc run the launcher's process would
otherwise pay at the kernel's first load). The launcher then compiles the same request itself,
which is a cache hit: the pool only moves the work earlier and spreads it over cores.

Note: the compile pool
    Triton compiles one configuration in about half a second of one core, and a graph has tens
    of kernels with a few configurations each. One pool per process (`compile_pool`), made on first use
    (under a lock; again after a fork), holds up to `config.compile_threads` workers (one per
    usable core by default, at most MAX_WORKERS). Each worker is a fresh Python
    (`python -m ember.runtime.triton_worker`, so a user's unguarded script is never re-run, as
    multiprocessing's spawn would) that imports Triton and ember's light modules, never torch,
    and compiles one request at a time; one thread per worker feeds it from a shared queue over
    its pipes. The pool is an accelerator, never the authority: a request that fails in a worker
    (a compile error, a crash, a worker that could not start) fails its future with the kernel's
    name and the launcher compiles it in its own process, where the error (if real) is raised.
    A crashed worker is replaced at the next request; the others go on. Identical requests
    share one future. Workers exit when the process does (atexit closes their pipes).
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

from ember.runtime.triton_compile import CompileRequest

MAX_WORKERS = 32
HEADER = struct.Struct("<Q")  # each message: its length, then the pickled object


class CompileFailed(RuntimeError):
    """A request a worker could not compile; names the kernel and configuration."""


def write_message(stream: IO[bytes], message: Any) -> None:
    payload = pickle.dumps(message)
    stream.write(HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any:
    """The next message, or None at the end of the stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (length,) = HEADER.unpack(header)
    payload = stream.read(length)
    if len(payload) < length:
        return None
    return pickle.loads(payload)


class Worker:
    """One worker process and its pipes; started on first use, replaced when it dies."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()  # `started` runs on the pool's `start` caller and on the serving thread

    def started(self) -> subprocess.Popen:
        """The worker's process, started now if it is not running."""
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self.process = subprocess.Popen([sys.executable, "-m", "ember.runtime.triton_worker"],
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=subprocess.DEVNULL, env=worker_environment(),
                                                cwd=PACKAGE_PARENT)  # fmt: skip
            return self.process

    def compile(self, request: CompileRequest, build_launcher: bool) -> tuple[str, str]:
        """Has the worker compile `request` (and its C launcher); its note and the kernel's
        cache key, or CompileFailed."""
        process = self.started()
        assert process.stdin is not None and process.stdout is not None
        try:
            write_message(process.stdin, (request, build_launcher))
            reply = read_message(process.stdout)
        except (OSError, ValueError):
            reply = None
        if reply is None:  # it died: a crash in the compiler, or killed
            self.stop()
            raise CompileFailed(f"runtime: the compile worker for Triton kernel {request.kernel} exited "
                                f"(code {process.poll()}) before answering")  # fmt: skip
        status, note = reply
        if status != "ok":
            raise CompileFailed(f"runtime: Triton kernel {request.kernel} failed to compile: {note}")
        return note

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def stop(self) -> None:
        """Ends a worker that stopped answering (it may be stuck or half dead): killed, reaped."""
        with self.lock:
            process, self.process = self.process, None
        if process is not None:
            process.kill()
            process.wait()

    def close(self) -> None:
        """Closes the worker's request pipe: an idle worker exits at once, a busy one after its
        compile. Called at exit, from another thread than the one serving it."""
        process = self.process
        if process is not None and process.stdin is not None:
            try:
                process.stdin.close()
            except (OSError, ValueError):
                pass


# The folder holding this process's ember: a worker starts there (`-m` puts it first on the path)
# and has it on PYTHONPATH, so it runs the same source, whatever the caller's folder holds.
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


def worker_environment() -> dict[str, str]:
    """This process's environment, without the interpreter switch (a worker compiles for the
    GPU), and with this process's ember first on the path."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = os.pathsep.join([PACKAGE_PARENT, *filter(None, [os.environ.get("PYTHONPATH")])])
    return environment


class CompilePool:
    """Worker processes compiling Triton kernels (Note: the compile pool). Safe under threads:
    `submit` looks up and records a request's future in one step under `lock`."""

    def __init__(self, workers: int) -> None:
        self.pid = os.getpid()
        self.workers = [Worker() for _ in range(workers)]
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.futures: dict[CompileRequest, Future] = {}
        self.launchers: set[tuple] = set()  # argument types whose C launcher a worker was asked to build
        self.lock = threading.Lock()
        self.closed = False
        self.threads = [threading.Thread(target=self._serve, args=(w,), name=f"ember-compile-{i}", daemon=True)
                        for i, w in enumerate(self.workers)]  # fmt: skip
        for thread in self.threads:
            thread.start()

    def submit(self, request: CompileRequest) -> tuple[Future, bool]:
        """The future of `request`, and whether this call queued it (False: asked for before)."""
        with self.lock:
            future = self.futures.get(request)
            if future is not None:
                return future, False
            future = self.futures[request] = Future()
            build_launcher = request.launcher_key not in self.launchers
            self.launchers.add(request.launcher_key)
            if self.closed:
                future.set_exception(CompileFailed("runtime: the Triton compile pool is shut down"))
            else:
                self.jobs.put((request, future, build_launcher))
            return future, True

    def pending(self, request: CompileRequest) -> Future | None:
        """The future of `request` if it was submitted, else None."""
        with self.lock:
            return self.futures.get(request)

    def start(self) -> None:
        """Starts every worker process now (each imports Triton once): a compile about to
        submit work calls this early, so that start-up overlaps its other stages."""
        for worker in self.workers:
            try:
                worker.started()
            except OSError:
                pass  # the first request reports it

    def worker_pids(self) -> list[int]:
        return [pid for w in self.workers if (pid := w.pid) is not None]

    def _serve(self, worker: Worker) -> None:
        while True:
            request, future, build_launcher = self.jobs.get()
            if request is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            if self.closed:  # exiting: what is still queued is dropped
                future.set_exception(CompileFailed(f"runtime: the Triton compile pool is shut down ({request.kernel})"))
                continue
            try:
                note = worker.compile(request, build_launcher)
            except Exception as e:  # CompileFailed, or a worker that could not start
                future.set_exception(
                    e
                    if isinstance(e, CompileFailed)
                    else CompileFailed(
                        f"runtime: no compile worker for Triton kernel {request.kernel}: {type(e).__name__}: {e}"
                    )
                )
            else:
                future.set_result(note)

    def shutdown(self) -> None:
        """At exit: queued requests are dropped and every worker's pipe closed, so workers exit
        (a busy one after its compile); the serving threads are daemons and need no join."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for _ in self.threads:
            self.jobs.put((None, None, False))
        for worker in self.workers:
            worker.close()


_pool: CompilePool | None = None
_pool_lock = threading.Lock()


def pool_size(requested: int = 0) -> int:
    """`requested` workers, or one per core this process may run on, at most MAX_WORKERS."""
    if requested <= 0:
        requested = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, requested))


def compile_pool(workers: int = 0) -> CompilePool:
    """The process's pool, made at the first call with `workers` (Note: the compile pool)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():  # a forked child starts its own
            _pool = CompilePool(pool_size(workers))
            atexit.register(_pool.shutdown)
        return _pool
