"""Stage `runtime` (GPU): Triton kernels written into the cache, imported, compiled, tuned and
launched.

Triton compiles a `@triton.jit` function from its source file, so each rendered module is
written into the cache (Note: cache safety) and run from its verified bytes, with the file
as its `__file__`, as the wrapper is. A `TritonLauncher` is what the wrapper calls: when the
wrapper loads, its configurations go to the compile pool (runtime/triton_pool.py); on the first
call it picks a launch configuration (variant, block sizes, warps), from the tuning record
stored beside the module or by timing a few candidates (Note: bounded tuning), and then launches
the kernel ember compiled (runtime/triton_compile.py) on the current stream with a grid computed
from the x extent. A symbolic kernel's launcher (runtime/triton_sized.py) is a `TritonLauncher`
that chooses per size class of its calls.

Under the interpreter (`TRITON_INTERPRET=1`, CPU tensors; how CI runs the Triton path)
the module imports a numpy libdevice (runtime/triton_libdevice.py) and the configuration
is fixed: small blocks, so both reduction variants run in tests.
"""

from __future__ import annotations

import functools
import linecache
import logging
import sys
import threading
import types
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ember.metrics import metrics
from ember.renderer.triton_prelude import LOOP_BOUND_PRELUDE
from ember.runtime.cache import (
    content_hash,
    discard,
    entry_path,
    open_root,
    read_entry_or_discard,
    read_verified,
    relative_to_root,
    resolve_in_root,
    sha256_bytes,
    write_entry,
    write_if_different,
)
from ember.runtime.triton_compile import (
    CompileRequest,
    argument_alignment,
    argument_types,
    compile_kernel,
    signature_of,
    triton_settings,
)
from ember.runtime.triton_pool import CompilePool

log = logging.getLogger("ember.runtime")

LIBDEVICE_IMPORT = "from triton.language.extra import libdevice"
INTERPRETED_IMPORT = "from ember.runtime.triton_libdevice import interpreted_libdevice as libdevice"
INTERPRETED_LOOP_BOUND = "\n\nfrom ember.runtime.triton_libdevice import interpreted_loop_bound as ember_loop_bound\n"


def require_interpreter() -> None:
    """Triton's interpreter only works when TRITON_INTERPRET was set before triton was imported
    (its own jit functions, tl.sum among them, are made then)."""
    import triton

    if not triton.knobs.runtime.interpret:
        raise RuntimeError(
            "runtime: Triton kernels on CPU tensors (EMBER_BACKEND=triton) run under Triton's "
            "interpreter: set TRITON_INTERPRET=1 before triton is imported"
        )


def write_module(source: str, cache_dir: Path, interpret: bool, version: str) -> tuple[str, str, bool]:
    """The module file for `source` (for the interpreter: with its libdevice), written when
    missing or different: (path relative to the cache root, sha256 of the source, was cached)."""
    import triton

    if interpret:
        source = source.replace(LIBDEVICE_IMPORT, INTERPRETED_IMPORT)
        source = source.replace(LOOP_BOUND_PRELUDE, INTERPRETED_LOOP_BOUND)
    root = open_root(cache_dir)
    key = content_hash(source, triton.__version__, version)
    path = entry_path(root, "triton", key, ".py")
    cached = write_if_different(path, source.encode())
    return relative_to_root(root, path), sha256_bytes(source.encode()), cached


_modules: dict[tuple[Path, str, bool], ModuleType] = {}  # owned here: each module imported once
_modules_lock = threading.Lock()


def import_module(root: str, relative: str, sha256: str, interpret: bool) -> ModuleType:
    """The module at `relative` in the cache, run from its verified bytes (Note: cache safety).
    Triton reads a jit function's source through `inspect`, so linecache is given those same
    bytes: the file is never read again after the check."""
    path = resolve_in_root(root, relative)
    with _modules_lock:
        key = (path, sha256, interpret)
        if key not in _modules:
            source = read_verified(path, sha256).decode()
            if interpret:
                require_interpreter()
            name = f"ember_triton_{path.stem[:40]}{'_interpreted' if interpret else ''}"
            module = types.ModuleType(name)
            module.__file__ = str(path)
            linecache.cache[str(path)] = (len(source), None, source.splitlines(keepends=True), str(path))
            exec(compile(source, str(path), "exec"), module.__dict__)
            sys.modules.setdefault(name, module)
            module._sha256 = sha256  # type: ignore[attr-defined]
            _modules[key] = module
        return _modules[key]


# ---- launch configurations -----------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    variant: str  # "pointwise" | "persistent" | "looped"
    xblock: int
    rblock: int  # 0 for pointwise kernels
    num_warps: int


# Note: bounded tuning. The first call of a kernel with several candidate configurations times
# them (`benchmark`) and records the winner beside the module, keyed by the module's source, the
# kernel and the device's name: one tuning per kernel source and device, whichever graph or
# process meets it next. What bounds the cost:
# - the candidates themselves (`candidates`: at most four or five per kernel, the lists that won
#   when measured, best guess first) are compiled ahead, in parallel (Note: the compile pool);
# - a kernel of at most TINY_KERNEL_ELEMENTS elements (x times r) is launch-bound: every
#   configuration runs in about the launch's time, so it takes the first without timing;
# - each candidate is timed with Triton's do_bench (L2 flushed before each launch, median of
#   the launches) for TUNING_REP_MS, after TUNING_WARMUP_MS, through the compiled kernel's
#   direct launch: about 5 ms a candidate, not the 25 ms and binder launches of before.
# Candidates run on the call's real inputs and on private copies of the buffers the kernel writes
# (`scratch_copy`: same sizes and strides, so every address the kernel computes lies in the copy).
TINY_KERNEL_ELEMENTS = 1 << 16
POOL_WAIT_S = 300  # past this, a configuration the pool has not finished is compiled by the caller too
TUNING_WARMUP_MS = 1
TUNING_REP_MS = 5


# One row a program, walked in chunks of these many elements with these many warps: chunks of at most
# half a row. Long rows take wide chunks and 16 warps: layer norm over 8192 x 8192 floats on an H200
# ran at 4086 GB/s in chunks of 4096 (inductor: 4075), where the best of the others was 3893
# (persistent); over 4096 x 32768, 3223 in chunks of 8192 against at most 2681.
ROW_CHUNKS = ((2048, 8), (1024, 4), (4096, 16), (8192, 16))
# A persistent block's warps: one per this many elements (16 a thread), and for one row a program also
# one per twice as many. Fewer warps than one per 256 elements ran layer norm faster on an H200: 65536
# rows of 768 at 4029 GB/s with 2 warps a row against 3373 with 4 (inductor 4028), 16384 rows of 4096
# at 4020 with 4 warps against 3826 with 8.
PERSISTENT_ELEMENTS_PER_WARP = 512


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def candidates(variants: list[str], xnumel: int, rnumel: int, interpret: bool) -> list[LaunchConfig]:
    """The configurations worth timing, best guess first."""
    xcap = next_power_of_2(xnumel)
    if variants == ["pointwise"]:
        if interpret:
            return [LaunchConfig("pointwise", min(xcap, 1024), 0, 1)]
        found = [LaunchConfig("pointwise", min(x, xcap), 0, w) for x, w in ((1024, 4), (2048, 8), (512, 4), (256, 2))]
        return list(dict.fromkeys(found))
    rcap = next_power_of_2(rnumel)
    if interpret:  # small rows persistent, others looped: tests reach both variants
        if "persistent" in variants and rnumel <= 64:
            return [LaunchConfig("persistent", min(xcap, 16), rcap, 1)]
        return [LaunchConfig("looped", min(xcap, 4), min(rcap, 32), 1)]
    found = []
    if "persistent" in variants:
        for x in (1, 2, 4, 8, 16, 32, 64):
            if x <= xcap and x * rcap <= max(rcap, 4096):
                found.append(LaunchConfig("persistent", x, rcap, _warps(x * rcap, PERSISTENT_ELEMENTS_PER_WARP)))
        if rcap >= 4096:
            found.append(LaunchConfig("persistent", 1, rcap, 8))
    found = _spread(found, 4)
    if "persistent" in variants and rcap >= 1024:  # a row a program, twice the elements a thread
        found.append(LaunchConfig("persistent", 1, rcap, _warps(rcap, 2 * PERSISTENT_ELEMENTS_PER_WARP)))
    if rnumel > 1024 or "persistent" not in variants:
        chunks = [(chunk, warps) for chunk, warps in ROW_CHUNKS if chunk <= max(2048, rnumel // 2)]
        chunks = chunks if len(chunks) <= 3 else [c for c in chunks if c != (1024, 4)]
        found += [LaunchConfig("looped", 1, min(rcap, chunk), warps) for chunk, warps in chunks]
        if xnumel >= 64:  # many short rows or columns: several rows per program
            found += [LaunchConfig("looped", min(8, xcap), min(rcap, 256), 8),
                      LaunchConfig("looped", min(32, xcap), min(rcap, 64), 4),
                      # a (rows, 16) column sum's partials: a chunk's 16 columns, 128 rows a step, one
                      # contiguous 8 KiB read in 16-byte loads (Triton orders the block x-major)
                      LaunchConfig("looped", min(16, xcap), min(rcap, 128), 4)]  # fmt: skip
    return list(dict.fromkeys(found))


def _warps(elements: int, per_warp: int) -> int:
    return min(16, max(1, elements // per_warp))


def _spread(found: list[LaunchConfig], most: int) -> list[LaunchConfig]:
    """At most `most` candidates, keeping the first and spreading over the rest."""
    if len(found) <= most:
        return found
    step = (len(found) - 1) / (most - 1)
    return [found[round(i * step)] for i in range(most)]


def scratch_copy(buffer: Any) -> Any:
    """A private copy of a buffer a kernel writes, for timing candidates on: the same sizes and
    strides, so that every address the kernel computes from them lies in the copy. `clone()` is
    not that: it makes a non-dense buffer (the q, k and v of a fused projection, strided over
    its rows) contiguous, and so smaller than the addresses the kernel writes, which then land
    in other tensors' memory."""
    import torch

    return torch.empty_strided(buffer.size(), buffer.stride(), dtype=buffer.dtype, device=buffer.device).copy_(buffer)


def torch_cuda_current_device() -> int:
    import torch

    return torch.cuda.current_device()


def raw_stream(device: int) -> int:
    return stream_getter()(device)


def stream_getter() -> Callable[[int], int]:
    """torch's C function giving a device's current CUDA stream, which the fast launch calls
    without a Python frame around it."""
    import torch

    return torch._C._cuda_getCurrentRawStream


@functools.cache
def device_facts(device: int) -> tuple[tuple[str, int, int], str]:
    """CUDA device `device`'s compile target (GPUTarget's fields, as Triton's driver gives them
    for the current device) and its name (which keys tuning records)."""
    import torch
    from triton.runtime.driver import driver

    with torch.cuda.device(device):
        target = driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size), torch.cuda.get_device_name(device)


def loaded(kernel: Any) -> Any:
    """`kernel` with its binary loaded on the current device (Triton loads it at the first `run`;
    `kernel.function` exists only after that)."""
    kernel.run  # noqa: B018
    return kernel


def direct_launch(kernel: Any) -> tuple:
    """(C launch function, CUfunction, the arguments between them and the kernel's): the call
    `kernel.run(grid, 1, 1, stream, function, metadata, None, None, None, *args)` makes, without
    its Python frame, where the kernel needs no scratch memory (Triton allocates that per
    launch; such a kernel goes through `kernel.run`)."""
    run = kernel.run
    fields = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size")
    if all(hasattr(run, f) for f in fields) and not run.global_scratch_size and not run.profile_scratch_size:
        head = (run.launch_cooperative_grid, run.launch_pdl, None, None, kernel.packed_metadata, None, None, None)
        return run.launch, kernel.function, head
    return run, kernel.function, (kernel.packed_metadata, None, None, None)


# ---- the launcher ----------------------------------------------------------------------------


class TritonLauncher:
    """One kernel as the wrapper calls it: `launcher(*tensors)`.

    On the GPU every launch goes through a kernel ember compiled (Note: ember owns the Triton
    compile, runtime/triton_compile.py): `precompile`, when the wrapper loads, hands every
    configuration the first call may launch to the compile pool (Note: the compile pool,
    runtime/triton_pool.py); the first call picks one (Note: bounded tuning) and each first
    launch for an alignment of the pointers compiles it, which finds the pool's work in Triton's
    cache. Under the interpreter, kernels launch through `fn[grid]` with a fixed configuration.

    Threads may call one launcher at once: the first call's choice of configuration and each
    first launch for an alignment run under `lock`, and what the fast path reads (config, grid,
    block sizes, compiled kernels) is published only once complete; a trial launch changes
    nothing shared, so a benchmark's trial launches never alter what other calls run."""

    def __init__(self, module: ModuleType, name: str, variants: list[str], xnumel: int, rnumel: int,
                 written: list[int], interpret: bool, autotune: bool = True, xextent: int = 0, tuned: int = 8,
                 arguments: list[str] | None = None, root: str = "", relative: str = "",
                 parts: list[int] | None = None) -> None:  # fmt: skip
        self.module, self.name, self.variants, self.autotune = module, name, variants, autotune
        # a horizontal kernel's parts' element counts: each takes its own programs (renderer/triton_horizontal.py)
        self.parts = parts
        self.tuned = max(1, tuned)  # the most candidates the first call times (config.tuning_candidates)
        self.xextent = max(xnumel, xextent)  # what XBLOCK may cover (more than the grid's x: nested reductions)
        self.xnumel, self.rnumel, self.written, self.interpret = xnumel, rnumel, written, interpret
        # the argument types the renderer declared (renderer/triton_module.py `argument_kinds`)
        self.signature = signature_of(arguments) if arguments is not None else None
        self.root, self.relative = root, relative  # the module in the cache, for compile requests
        self.config: LaunchConfig | None = None
        self.compiled: dict[tuple, tuple] = {}  # pointer alignments -> direct launch (`direct_launch`)
        self.grid, self.stream_device = 0, 0
        self.constexprs: tuple[int, ...] = ()
        self.pool: CompilePool | None = None
        self.lock = threading.Lock()
        # the positions of the pointer arguments (None: not declared), and whether every argument is
        # one: the fast path checks their alignment with one OR (Note: the fast launch)
        self.pointers = None if self.signature is None else tuple(
            i for i, kind in enumerate(self.signature) if kind.startswith("*"))  # fmt: skip
        self.only_pointers = self.pointers is not None and len(self.pointers) == len(arguments or ())
        self.direct_aligned: tuple | None = None  # the direct launch for 16-byte aligned pointers
        self.current_stream: Callable[[int], int] = raw_stream  # (stream_getter's, from the first launch)

    def __call__(self, *args: Any) -> None:
        if self.config is None:
            self.configure(args)
        assert self.config is not None
        if self.interpret:
            self.launch(self.config, args)
            return
        # Note: the fast launch. Triton's own launch path binds and specializes the arguments
        # in Python on every call (tens of microseconds); after the first launch for an
        # alignment of the pointers, the compiled kernel's C launcher is called directly. A
        # wrapper launches a hundred kernels or more per call, so each microsecond here is
        # about a tenth of a millisecond of a training step's CPU time, which the GPU waits for.
        # Numbers (a seed, a 0-d CPU input's value, a size under dynamic=True's scalars) are never
        # specialized, so only the pointers' alignment picks the compiled kernel.
        combined = 0
        if self.only_pointers:
            for a in args:
                combined |= a.data_ptr()
        elif self.pointers is not None:
            for i in self.pointers:
                combined |= args[i].data_ptr()
        direct = self.direct_aligned if not combined & 15 else None
        if direct is None:
            direct = self.direct_for(args)
        launch, function, head = direct
        launch(self.grid, 1, 1, self.current_stream(self.stream_device), function, *head, *args, *self.constexprs)

    def direct_for(self, args: tuple) -> tuple:
        """The direct launch (see `direct_launch`) of the kernel compiled for these pointer
        alignments: compiled at the first launch for them, under the lock."""
        aligned = argument_alignment(args)  # (a number, the seed or a 0-d CPU input's value, counts as aligned)
        direct = self.compiled.get(aligned)
        if direct is None:
            with self.lock:
                direct = self.compiled.get(aligned)
                if direct is None:
                    direct = self.compile_direct(self.config, args, aligned, False)
                    self.compiled[aligned] = direct
                    if all(aligned) and self.pointers is not None:
                        self.direct_aligned = direct  # last: the fast path reads it without the lock
        return direct

    def compile_direct(self, config: LaunchConfig | None, args: tuple, aligned: tuple[bool, ...], wide: bool) -> tuple:
        """`config` compiled for these arguments' types and alignments (64-bit indexes when `wide`),
        as a direct launch; called under the lock."""
        assert config is not None
        self.current_stream = stream_getter()
        self.stream_device = torch_cuda_current_device()
        target, _ = device_facts(self.stream_device)
        return direct_launch(self.compiled_kernel(config, argument_types(args, self.signature), aligned, target, wide))

    def configure(self, args: tuple) -> None:
        """Choose the launch configuration once, whichever threads make the first calls."""
        with self.lock:
            if self.config is None:
                config = self.choose(args)
                self.grid, blocks = self.grid_and_blocks(config)
                self.constexprs = tuple(blocks.values())
                self.config = config  # last: the fast path reads grid and constexprs once config is set

    def grid_and_blocks(self, config: LaunchConfig) -> tuple[int, dict[str, int]]:
        """The grid of a static x extent (a horizontal kernel's: every part's) and the block sizes."""
        numels = self.parts if self.parts is not None else [self.xnumel]
        grid = sum((n + config.xblock - 1) // config.xblock for n in numels)
        return grid, {"XBLOCK": config.xblock} | ({"RBLOCK": config.rblock} if config.rblock else {})

    def function(self, config: LaunchConfig, wide: bool) -> str:
        """The jit function of `config`: with 64-bit index math when `wide` (Note: symbolic blocks)."""
        return f"{self.name}_{config.variant}{'_wide' if wide else ''}"

    def grid_of(self, config: LaunchConfig, args: tuple) -> int:
        """The programs a launch of `config` on `args` runs."""
        return self.grid_and_blocks(config)[0]

    def wide_for(self, args: tuple) -> bool:
        """Whether a call on `args` takes the kernel with 64-bit indexes (a symbolic kernel's call
        past its size cap: runtime/triton_sized.py)."""
        return False

    def launch(self, config: LaunchConfig, args: tuple) -> Any:
        """Under the interpreter: one launch through Triton's `fn[grid]`."""
        wide = self.wide_for(args)
        metrics.add(triton_wide_index_launches=wide)
        fn = getattr(self.module, self.function(config, wide))
        _, blocks = self.grid_and_blocks(config)
        return fn[(self.grid_of(config, args),)](*self.interpreted(args), **blocks)

    def interpreted(self, args: tuple) -> tuple:
        return args

    # ---- compiling (Note: ember owns the Triton compile) -------------------------------------

    def request(self, config: LaunchConfig, signature: tuple[str, ...], aligned: tuple[bool, ...],
                target: tuple[str, int, int], wide: bool = False) -> CompileRequest:  # fmt: skip
        options, cache_dir, environment = triton_settings()
        _, blocks = self.grid_and_blocks(config)
        return CompileRequest(self.root, self.relative, self.module._sha256, self.function(config, wide),
                              signature, aligned, tuple(blocks.items()), config.num_warps, target, options,
                              cache_dir, environment)  # fmt: skip

    def precompile(self, device: int, pool: CompilePool) -> None:
        """Hands every configuration the first call may launch on `device` to `pool`, for pointers
        16-byte aligned (Note: the compile pool). Needs the renderer's signature."""
        if self.interpret or self.signature is None:
            return
        target, device_name = device_facts(device)
        self.pool = pool
        every_aligned = (True,) * len(self.signature)
        plan = self.tuning_plan(device_name)
        for config in plan:
            pool.submit(self.request(config, self.signature, every_aligned, target))
        metrics.add(triton_configs_precompiled=len(plan))

    def compiled_kernel(self, config: LaunchConfig, signature: tuple[str, ...], aligned: tuple[bool, ...],
                        target: tuple[str, int, int], wide: bool = False) -> Any:  # fmt: skip
        """`config` compiled for a call with these argument types and alignments, loaded on the
        current device: after the pool's work on it, if it was precompiled (a cache hit then)."""
        request = self.request(config, signature, aligned, target, wide)
        pending = self.pool.pending(request) if self.pool is not None else None
        if pending is None:
            metrics.add(triton_compiles_in_process=1)
        else:
            wait([pending], timeout=POOL_WAIT_S)  # a failure (or a stuck worker): compiled (and raised) here
        try:
            kernel = compile_kernel(getattr(self.module, request.function), request)
        except Exception as e:
            raise RuntimeError(f"runtime: Triton kernel {request.kernel} failed: {type(e).__name__}: {e}") from e
        if pending is not None and pending.done() and pending.exception() is None:
            _, worker_key = pending.result()
            if worker_key != str(kernel.hash):  # the pool's work was lost (Note: the tools that key Triton's cache)
                metrics.add(triton_pool_key_mismatches=1)
                log.debug("Triton kernel %s: the compile worker's cache key is not this process's", request.kernel)
        return loaded(kernel)

    def trial(self, config: LaunchConfig, args: tuple, target: tuple[str, int, int]) -> Callable[[], None]:
        """A launch of `config` on `args` (compiled now), as a benchmark repeats it; changes
        nothing the fast path reads."""
        wide = self.wide_for(args)
        types, aligned = argument_types(args, self.signature), argument_alignment(args)
        kernel = self.compiled_kernel(config, types, aligned, target, wide)
        grid, blocks = self.grid_of(config, args), self.grid_and_blocks(config)[1]
        stream, constexprs = raw_stream(torch_cuda_current_device()), tuple(blocks.values())

        def launch() -> None:
            kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                       *args, *constexprs)  # fmt: skip

        return launch

    # ---- choosing a configuration (Note: bounded tuning) -----------------------------------

    def tuning_record(self, device_name: str, size_class: tuple = ()) -> tuple[Path, str]:
        """Where the winner for this module on `device_name` is recorded (for a symbolic kernel: for
        one size class of its calls, Note: size classes), and its key."""
        key = content_hash(self.module._sha256, self.name, device_name, *map(repr, size_class))
        return Path(str(self.module.__file__)).with_suffix(f".{key[:12]}.tune.json"), key

    def recorded_winner(self, device_name: str, size_class: tuple = ()) -> LaunchConfig | None:
        record, key = self.tuning_record(device_name, size_class)
        found = read_entry_or_discard(record, key)
        if found is None:
            return None
        try:
            return LaunchConfig(**found)
        except TypeError as e:  # a record of other fields: measure again
            discard(e, record)
            return None

    def tuning_plan(self, device_name: str) -> list[LaunchConfig]:
        """The configurations the first call launches: one where there is nothing to choose or
        the choice cannot matter (the interpreter, autotune off, one candidate, a tiny kernel, a
        recorded winner), else the candidates it times."""
        options = candidates(self.variants, self.xextent, self.rnumel, self.interpret)[: self.tuned]
        if self.interpret or not self.autotune or len(options) == 1 or self.tiny:
            return options[:1]
        winner = self.recorded_winner(device_name)
        return [winner] if winner in options else options

    @property
    def tiny(self) -> bool:
        return self.xextent * max(1, self.rnumel) <= TINY_KERNEL_ELEMENTS

    def choose(self, args: tuple) -> LaunchConfig:
        if self.interpret or not self.autotune:
            return candidates(self.variants, self.xextent, self.rnumel, self.interpret)[0]
        target, device_name = self.device_of(args)
        options = self.tuning_plan(device_name)
        return options[0] if len(options) == 1 else self.timed_winner(options, args, target, device_name)

    def device_of(self, args: tuple) -> tuple[tuple[str, int, int], str]:
        """The compile target and name of the device a call's tensors are on."""
        import torch

        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return device_facts(device.index if device.index is not None else torch_cuda_current_device())

    def timed_winner(self, options: list[LaunchConfig], args: tuple, target: tuple[str, int, int], device_name: str,
                     size_class: tuple = ()) -> LaunchConfig:  # fmt: skip
        """The fastest of `options` on `args`, recorded for the next process (Note: bounded tuning)."""
        best = self.benchmark(options, args, target)
        record, key = self.tuning_record(device_name, size_class)
        write_entry(record, key, asdict(best))
        return best

    def benchmark(self, options: list[LaunchConfig], args: tuple, target: tuple[str, int, int]) -> LaunchConfig:
        """Times each candidate on copies of the outputs (a kernel may read what it writes), with
        few repetitions (Note: bounded tuning)."""
        from triton.testing import do_bench

        trial = tuple(scratch_copy(a) if i in self.written else a for i, a in enumerate(args))
        timings, failures = {}, []
        for config in options:
            try:
                timings[config] = do_bench(self.trial(config, trial, target), warmup=TUNING_WARMUP_MS,
                                           rep=TUNING_REP_MS, return_mode="median")  # fmt: skip
            except Exception as e:  # a configuration that does not compile or load (resources): skip it
                failures.append(e)
        metrics.add(triton_kernels_tuned=1, triton_configs_timed=len(timings))
        if not timings:
            raise RuntimeError(f"runtime: no launch configuration of Triton kernel {self.name} runs: {failures[0]}")
        return min(timings, key=timings.__getitem__)
