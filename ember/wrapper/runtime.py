"""Helpers the generated wrappers import: layout checks, allocation, kernel loading."""

from __future__ import annotations

import atexit
import builtins
import collections
import ctypes
import dataclasses
import functools
import sys
import threading

import torch
from torch.utils._pytree import tree_leaves

from ember.config import load as load_config
from ember.metrics import metrics
from ember.runtime.cpu import load_cached_kernel as load_kernel
from ember.runtime.memory import empty_large
from ember.runtime.search import search_cpu_kernel
from ember.runtime.triton import TritonLauncher, import_module
from ember.runtime.triton_pool import compile_pool
from ember.runtime.triton_sized import launcher_type

# Note: profiler ranges. Under torch.profiler, each kernel and extern call of a wrapper runs in
# its own named range (`ember kernel_3: gelu, mul, sum`). A wrapper carries the source of that
# variant of its `call` as a string, compiled at the first profiled call only, so a wrapper
# compiles as fast as before and an unprofiled call pays one check of the profiler's flag.
profiler_active = torch._C._autograd._profiler_enabled
record_function = torch.profiler.record_function
_profiled_lock = threading.Lock()

# What a CUDA-graph runner watches on this thread (Note: CUDA graphs, runtime/cuda_graphs.py):
# `probe` during a warm-up call, `recorder` (a list) while a call is being recorded.
capture_state = threading.local()


def profiled_call(module: dict, *args):
    """Run the module's profiled `call` variant, compiling it at its first use."""
    function = module.get("_call_profiled")
    if function is None:
        with _profiled_lock:
            function = module.get("_call_profiled")
            if function is None:
                exec(compile(module["_PROFILED_SOURCE"], module.get("__file__", "<ember wrapper>"), "exec"), module)
                function = module["_call_profiled"]
    return function(*args)


# Note: outputs are never views
#     A buffer the wrapper returns in another layout than its own (a reshape of a matmul's result),
#     or one that takes over a freed buffer's storage (wrapper/plan.py), could be an `as_strided`
#     view, but eager's output of that op is a tensor of its own (`_base` None). Dynamo guards on
#     the `_base` of a view it is given, so a compiled output fed back into the compiled function
#     (a generate() loop's KV cache, written by a prefill graph and read by a decode graph) made
#     the next call, fed a plain tensor, compile the graph again. `reinterpret` gives the same
#     storage and layout as a tensor of its own.


def _reinterpret_in_python(t: torch.Tensor, size, stride, offset: int = 0) -> torch.Tensor:
    storage_offset = t.storage_offset() + offset
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), storage_offset, size, stride)


# `reinterpret(t, size, stride, offset)`: `t`'s storage in another layout, `offset` counted from
# t's first element, as a tensor of its own (Note: outputs are never views). torch's C helper
# for exactly this (which dynamo's guards use) takes a microsecond where the two aten calls above
# take three on a GPU, and a wrapper makes a few hundred per training step; older torch builds
# without it get the Python version.
reinterpret = getattr(torch._C._dynamo.guards, "_reinterpret_tensor", _reinterpret_in_python)
# A view an extern call reads (a reshape of a buffer): the same tensor of its own serves.
as_strided = reinterpret
# The allocation of a wrapper's buffer: torch's own, with no Python frame around it.
empty_strided = torch.empty_strided


def _empty_cuda_in_python(size, stride, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cuda")


# A CUDA wrapper's buffer on the current device (the wrapper's, during its call): torch's C helper
# for it takes 1.1 us on an H100 where `torch.empty_strided(..., device=)` takes 2.0, and a
# training step allocates a few hundred buffers.
empty_cuda = getattr(torch._C._dynamo.guards, "_empty_strided_cuda", _empty_cuda_in_python)
# The current CUDA device's index, without torch.cuda's Python layers (0.2 us against 2).
current_cuda_device = getattr(torch._C, "_cuda_getDevice", lambda: -1)


__all__ = [
    "GpuErrorFlags", "KernelErrorFlag", "load_triton_kernel", "constant_on", "random_seed", "random_seed_value",
    "random_offset", "random_seed_on",
    "as_strided", "reinterpret", "assert_layout", "current_cuda_device", "empty_cuda", "empty_large", "empty_strided",
    "ensure_layout", "load_kernel",
    "search_cpu_kernel", "tree_leaves", "profiler_active", "profiled_call", "record_function",
    "report_earlier_gpu_errors",
]  # fmt: skip


def random_seed() -> torch.Tensor:
    """The seed of one call's random ops: drawn from torch's default generator, so
    `torch.manual_seed` makes a compiled graph's random values reproducible."""
    return torch.randint(SEED_BOUND, (1,), dtype=torch.int64)


def random_seed_value() -> int:
    """`random_seed()` as an int, for Triton kernels (which take it by value): the same draw
    from the same (CPU) generator, so a CPU and a CUDA graph see the same seed."""
    if getattr(capture_state, "probe", None) is not None:
        capture_state.probe.random = True
    if getattr(capture_state, "recorder", None) is not None:
        raise RuntimeError("a recorded CUDA graph would repeat this random seed at every replay")
    return draw_seed()


def draw_seed() -> int:
    return int(torch.randint(SEED_BOUND, (1,), dtype=torch.int64).item())


def random_seed_on(device: torch.device) -> torch.Tensor:
    """`random_seed()` on `device`, for the Triton kernels of a graph recorded as a CUDA graph (Note:
    random numbers in CUDA graphs, runtime/cuda_graphs.py): while recording, a buffer of the
    recording, which its runner fills with a fresh draw before each replay; otherwise a fresh draw
    from the same generator, filled on the device (no host-to-device copy to wait for)."""
    seeds = getattr(capture_state, "seeds", None)
    if seeds is not None:
        seed = torch.empty(1, dtype=torch.int64, device=device)
        seeds.append(seed)
        return seed
    return torch.full((1,), draw_seed(), dtype=torch.int64, device=device)


@functools.cache
def random_offset(value: int) -> torch.Tensor:
    """A random op's first Philox counter as the one-element tensor C++ kernels read (Note:
    counter-based random numbers, lower/random.py): made at the first call that needs it (a
    wrapper module runs while torch may still trace with fake tensors), then shared; kernels
    never write it. functools.cache is safe under threads."""
    return torch.tensor([value], dtype=torch.int64)


# Seeds are non-negative int64s (Philox takes 64 key bits; Triton reads a seed as uint64).
SEED_BOUND = 2**63 - 1


def constant_on(constants: dict, name: str, device: torch.device) -> torch.Tensor:
    """A graph constant on the graph's device (moved once; eager mixes CPU scalars in freely)."""
    value = constants[name]
    if isinstance(value, torch.Tensor) and value.device != device:
        value = constants[name] = value.to(device)
    return value


def load_triton_kernel(root: str, relative: str, sha256: str, name: str, device: torch.device | None = None,
                       **launch) -> TritonLauncher:  # fmt: skip
    """A Triton kernel as a wrapper names it: its module's path relative to the cache root
    and the module's checksum (Note: cache safety). On a CUDA `device` its configurations are
    compiled from now on, in the compile pool (Note: the compile pool, runtime/triton_pool.py)."""
    module = import_module(root, relative, sha256, launch["interpret"])
    launcher = launcher_type(launch)(module, name, **launch, root=root, relative=relative)
    if device is not None and device.type == "cuda" and not launch["interpret"]:
        index = device.index if device.index is not None else torch.cuda.current_device()
        launcher.precompile(index, compile_pool(load_config().compile_threads))  # (the size: if made now)
    return launcher


def assert_layout(t: torch.Tensor, size: tuple, stride: tuple, dtype: torch.dtype, name: str) -> None:
    """Kernels were generated for these exact sizes and strides; anything else is a bug."""
    if t is not None and t.stride() == stride and t.shape == size and t.dtype == dtype:
        return  # the common case first: a call checks every input (a few microseconds each otherwise)
    if t is None and 0 in size:
        return  # an effect token (with_effects): AOTAutograd may pass None for it at run time
    if tuple(t.shape) != size or (t.numel() > 1 and not _same_strides(t, size, stride)) or t.dtype != dtype:
        raise AssertionError(
            f"ember: input {name} has size {tuple(t.shape)}, stride {t.stride()}, dtype {t.dtype}; "
            f"the compiled graph expects size {size}, stride {stride}, dtype {dtype}"
        )


def _same_strides(t: torch.Tensor, size: tuple, stride: tuple) -> bool:
    return all(a == b or s == 1 for a, b, s in zip(t.stride(), stride, size))


def ensure_layout(t: torch.Tensor, size: tuple, stride: tuple) -> torch.Tensor:
    """An aten result in the layout kernels were generated for: as is, or copied into it."""
    if t.stride() == stride and t.shape == size:
        return t
    if tuple(t.shape) == tuple(size) and (t.numel() <= 1 or _same_strides(t, size, stride)):
        return t
    out = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def raise_kernel_error(errors: list[tuple[str, str]], code: int, value: int, late: bool = False) -> None:
    """The Python exception for error `code` of a kernel, its message naming the reported value;
    `late`: it is raised by a later call (Note: deferred GPU error checks)."""
    kind, message = errors[code - 1]
    message = message.replace("{value}", str(value))
    when = LATE_ERROR if late else ""
    raise getattr(builtins, kind, RuntimeError)(f"{message} (reported by an ember kernel){when}")


LATE_ERROR = (", in an earlier call on this thread: ember reads what GPU kernels report without waiting for the "
              "GPU (EMBER_GPU_ERROR_CHECKS=sync raises in the call itself)")  # fmt: skip


class KernelErrorFlag:
    """The ints a call's C++ kernels set when a check fails: the error's code, then one reported
    value per code (Note: kernel errors, cpp.py). Each call of a wrapper makes its own, so threads
    running one graph never see each other's."""

    def __init__(self, codes: int = 1) -> None:
        self.flag = (ctypes.c_int64 * (1 + codes))()
        self.address = ctypes.addressof(self.flag)

    def check(self, errors: list[tuple[str, str]]) -> None:
        code = self.flag[0]
        if code:
            raise_kernel_error(errors, code, self.flag[code])


class GpuErrorFlags:
    """A row of device int64s per Triton kernel of a call that can fail, its error code and then
    one reported value per code (Note: kernel errors on the GPU, renderer/triton.py), the call's own
    (threads running one graph each have theirs) and read once at the end of it, or later (Note:
    deferred GPU error checks). The rows are lent by the thread's pool and go back once read (Note:
    error flags lent per thread); a recording's rows are its own, written by each replay."""

    def __init__(self, slots: int, device: torch.device, codes: int = 1) -> None:
        # rows of an even number of int64s, 16 bytes apart: every kernel's flag pointer is aligned,
        # so the kernels compiled ahead for aligned pointers are the ones launched (Note: ember
        # owns the Triton compile)
        shape = (slots, 2 * ((2 + codes) // 2))
        recording = getattr(capture_state, "recorder", None) is not None
        self.lent = None if recording else _take_flag_set(shape, torch.device(device))
        self.flags = self.lent.flags if self.lent is not None else torch.zeros(shape, dtype=torch.int64, device=device)

    def slot(self, i: int) -> torch.Tensor:
        return self.lent.slots[i] if self.lent is not None else self.flags[i]

    def check(self, errors: list[list[tuple[str, str]]], deferred: bool = False) -> None:
        recorder = getattr(capture_state, "recorder", None)
        if recorder is not None:  # being recorded as a CUDA graph: the runner checks after each replay
            recorder.append((self, errors, deferred))
            return
        if not deferred or self.flags.device.type != "cuda":
            rows = self.flags.tolist()
            if self.lent is not None:
                _give_back(self.lent, rows)
            _raise_first(rows, errors, late=False)
            return
        if self.lent is not None:
            host, event = self.lent.rows, self.lent.read
        else:  # a recording's rows: copied out after each replay, into host rows lent per thread
            host, event = _take_host_rows(tuple(self.flags.shape))
        assert host is not None and event is not None
        host.copy_(self.flags, non_blocking=True)
        event.record(current_stream_object(self.flags.device))
        queue = _pending.queue
        queue.append(_DeferredCheck(host, event, errors, self.lent))
        if len(queue) > MAX_PENDING_CHECKS:  # the CPU is far ahead: wait for the oldest, bounding the queue
            queue[0].event.synchronize()
            report_earlier_gpu_errors()


class _StreamObjects(threading.local):
    def __init__(self) -> None:
        self.by_device: dict[int | None, torch.cuda.Stream] = {}


_stream_objects = _StreamObjects()


def current_stream_object(device: torch.device) -> torch.cuda.Stream:
    """`torch.cuda.current_stream(device)` for a call's error-check event, without its Python cost
    (4.5 us on an H100, against 0.2 for the raw stream pointer): the Stream object is kept per
    thread and device and made again only when the device's current stream changed."""
    raw = torch._C._cuda_getCurrentRawStream(current_cuda_device() if device.index is None else device.index)
    stream = _stream_objects.by_device.get(device.index)
    if stream is None or stream.cuda_stream != raw:
        stream = _stream_objects.by_device[device.index] = torch.cuda.current_stream(device)
    return stream


# Note: error flags lent per thread
#   Making a call's flags (zeroed device rows, pinned host rows to copy them into, an event) cost
#   about 28 us of CPU per call on an H100. Each thread keeps instead the flag sets its calls used,
#   per device and shape, and lends one to each call; the call has it to itself until its rows are
#   read (at its end, or by a later call once its copy's event completed), so every call still sees
#   only its own errors. Rows that read all zeros are zero on the device too (nothing writes them
#   after the call's kernels), so a set goes back as it is; one that held an error is zeroed first,
#   and lent again only once that zeroing has completed (its `zeroed` event), whichever stream the
#   next call runs on. A set whose call raised before reading its rows is never given back: the
#   next call makes a new one. `ember.metrics.gpu_error_flag_sets` counts the sets made.
MAX_FREE_FLAG_SETS = 8  # per thread, device and shape


@dataclasses.dataclass(eq=False)
class _FlagSet:
    key: tuple[torch.device, tuple[int, int]]  # the device and shape it was asked for
    flags: torch.Tensor  # on the device, zero when lent
    slots: list[torch.Tensor]  # its rows, one per kernel (views made once, not per launch)
    rows: torch.Tensor | None  # pinned host rows the deferred check copies into (CUDA only)
    read: torch.cuda.Event | None  # recorded after that copy
    zeroed: torch.cuda.Event | None  # recorded after the flags were zeroed (an error): lent once it completed


class _FreeFlagSets(threading.local):
    def __init__(self) -> None:
        self.free: dict[tuple[torch.device, tuple[int, int]], collections.deque[_FlagSet]] = {}


_free_flag_sets = _FreeFlagSets()


def _take_flag_set(shape: tuple[int, int], device: torch.device) -> _FlagSet:
    key = (device, shape)
    free = _free_flag_sets.free.get(key)
    if free and (free[0].zeroed is None or free[0].zeroed.query()):
        return free.popleft()
    metrics.add(gpu_error_flag_sets=1)
    flags = torch.zeros(shape, dtype=torch.int64, device=device)
    if device.type != "cuda":
        return _FlagSet(key, flags, list(flags), None, None, None)
    pinned = torch.empty(shape, dtype=torch.int64, pin_memory=True)
    return _FlagSet(key, flags, list(flags), pinned, torch.cuda.Event(), None)


def _give_back(lent: _FlagSet, rows: list[list[int]]) -> None:
    """`lent` back to this thread's free sets, once its call's `rows` were read (Note: error flags
    lent per thread)."""
    lent.zeroed = None
    if any(row[0] for row in rows):
        lent.flags.zero_()
        if lent.flags.device.type == "cuda":
            lent.zeroed = torch.cuda.Event()
            lent.zeroed.record()
    free = _free_flag_sets.free.setdefault(lent.key, collections.deque())
    if len(free) < MAX_FREE_FLAG_SETS:
        free.append(lent)


def _raise_first(rows: list[list[int]], errors: list[list[tuple[str, str]]], late: bool) -> None:
    for slot, row in enumerate(rows):
        if row[0]:
            raise_kernel_error(errors[slot], row[0], row[row[0]], late)


# Note: deferred GPU error checks
#   A Triton kernel that meets a bad value (an index out of range) masks its access, writes the
#   value to its row of the call's flags and goes on. Reading the rows on the host waits for the
#   GPU, and one wait per call kept the CPU from running ahead of the GPU: a bf16 LLaMA training
#   step (4 layers, hidden 1024) took 12.1 ms on an H200 where its kernels took 8.3, its forward
#   call 11.8 ms of CPU against inductor's 2.3. By default (gpu_error_checks "deferred") a call
#   queues a copy of its rows to pinned host memory and an event; the thread's next ember call on
#   the GPU reads each queued copy whose event has completed and raises the first error, naming
#   it as an earlier call's. That is how CUDA reports its own kernel errors (late, at a later
#   call). `ember.check_gpu_errors()` waits for the GPU and raises what is still queued; at exit
#   a queued error is printed. "sync" reads the rows at the end of the call itself.
MAX_PENDING_CHECKS = 64


@dataclasses.dataclass
class _DeferredCheck:
    rows: torch.Tensor  # pinned host memory, filled when `event` completes
    event: torch.cuda.Event
    errors: list[list[tuple[str, str]]]
    lent: _FlagSet | None = None  # the flag set to give back once `rows` are read (Note: error flags lent per thread)


class _PendingChecks(threading.local):
    def __init__(self) -> None:
        self.queue: collections.deque[_DeferredCheck] = collections.deque()
        with _queues_lock:  # read at exit, whichever thread queued; ended threads with nothing queued dropped
            _queues[:] = [(thread, queue) for thread, queue in _queues if thread.is_alive() or queue]
            _queues.append((threading.current_thread(), self.queue))


_queues: list[tuple[threading.Thread, collections.deque]] = []
_queues_lock = threading.Lock()
_pending = _PendingChecks()


class _FreeHostRows(threading.local):
    def __init__(self) -> None:
        self.free: dict[tuple[int, ...], collections.deque[tuple[torch.Tensor, torch.cuda.Event]]] = {}


_free_host_rows = _FreeHostRows()


def _take_host_rows(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.cuda.Event]:
    """Pinned host rows and an event for a replay's deferred check (Note: error flags lent per
    thread): a pinned allocation and an event made per replay cost more than the replay."""
    free = _free_host_rows.free.get(shape)
    if free:
        return free.popleft()
    metrics.add(gpu_error_flag_sets=1)
    return torch.empty(shape, dtype=torch.int64, pin_memory=True), torch.cuda.Event()


def _give_back_host_rows(rows: torch.Tensor, event: torch.cuda.Event) -> None:
    free = _free_host_rows.free.setdefault(tuple(rows.shape), collections.deque())
    if len(free) < MAX_FREE_FLAG_SETS:
        free.append((rows, event))


def report_earlier_gpu_errors() -> None:
    """Raise the first error of this thread's earlier calls whose kernels have finished. Not while
    this thread records a CUDA graph: querying an event then would invalidate the recording, and
    the queued checks are read at the first call after it."""
    queue = _pending.queue
    if queue and getattr(capture_state, "recorder", None) is not None:
        return
    while queue and queue[0].event.query():
        check = queue.popleft()
        rows = check.rows.tolist()
        if check.lent is not None:
            _give_back(check.lent, rows)
        else:
            _give_back_host_rows(check.rows, check.event)
        _raise_first(rows, check.errors, late=True)


def check_gpu_errors() -> None:
    """Wait for this thread's queued GPU error checks and raise the first error they hold."""
    queue = _pending.queue
    while queue:
        queue[0].event.synchronize()
        report_earlier_gpu_errors()


@atexit.register
def _report_at_exit() -> None:
    with _queues_lock:
        queues = [queue for _, queue in _queues]
    for queue in queues:
        while queue:
            check = queue.popleft()
            try:
                check.event.synchronize()
                rows = check.rows.tolist()
            except Exception:  # CUDA already shut down: nothing left to read
                continue
            try:
                _raise_first(rows, check.errors, late=True)
            except Exception as e:  # the process is ending: say it, never raise from exit
                sys.stderr.write(f"ember: a GPU kernel reported an error no call read: {e}\n")
