"""Stage `runtime` (GPU): one launch configuration of one Triton kernel compiled by ember itself.

ember, not Triton's launch-time binder, says what a compiled kernel is specialized for (Note:
ember owns the Triton compile): a `CompileRequest` names the module in the cache, the function
(one variant), each argument's type, which pointers are 16-byte aligned, the block sizes, the
warps, the target and Triton's options. `compile_kernel` turns it into an `ASTSource` and calls
`triton.compile`, which keeps what it builds in Triton's on-disk cache (TRITON_CACHE_DIR). A
request is plain data, so a worker process (runtime/triton_pool.py) compiles exactly what the
launcher will ask for later, and the launcher's own `compile_kernel` is a cache hit.

Note: ember owns the Triton compile
    Triton's `fn[grid](*args)` derives a kernel's specialization from the arguments of the call
    (types, pointer alignment, integer values) and compiles on a miss. Ahead of the first call
    there are no arguments, and a worker that guessed them differently from the binder would
    fill the cache with kernels nobody loads. So every GPU launch goes through a compiled
    kernel that ember asked for: the signature comes from the renderer (its parameters'
    dtypes; seeds and offsets are int64 by value, never specialized), and the only
    specialization is `tt.divisibility=16` on each pointer that is 16-byte aligned at the call
    (ember's own buffers always are; a caller's tensor may not be: that alignment compiles
    at the call, in the process). The options are the ones the binder would add (`debug`,
    `instrumentation_mode` from Triton's knobs) plus ember's (`num_warps`, no FMA contraction).
    Under the interpreter (TRITON_INTERPRET=1) nothing here runs: kernels launch through `fn[grid]`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

# Triton's name of each element type, by torch's and ember's dtype names (ember's "index" is int64).
TRITON_TYPES = {
    "bool": "i1", "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "index": "i64", "uint8": "u8",
    "uint16": "u16", "uint32": "u32", "uint64": "u64", "float16": "fp16", "bfloat16": "bf16", "float32": "fp32",
    "float64": "fp64",
}  # fmt: skip
SCALAR_TYPE = "i64"  # seeds and random offsets: by value (Note: counter-based random numbers)
ALIGNMENT = 16  # bytes: what `tt.divisibility` promises for an aligned pointer


def pointer_type(dtype_name: str) -> str:
    if dtype_name not in TRITON_TYPES:
        raise NotImplementedError(f"runtime: no Triton pointer type for dtype {dtype_name}")
    return "*" + TRITON_TYPES[dtype_name]


def signature_of(kinds: list[str]) -> tuple[str, ...]:
    """Triton's types for the renderer's argument kinds (renderer/triton_module.py
    `argument_kinds`: `*<dtype>` a pointer, else a value of that dtype)."""
    return tuple(pointer_type(k[1:]) if k.startswith("*") else scalar_type(k) for k in kinds)


def scalar_type(dtype_name: str) -> str:
    if dtype_name not in TRITON_TYPES:
        raise NotImplementedError(f"runtime: no Triton scalar type for dtype {dtype_name}")
    return TRITON_TYPES[dtype_name]


def argument_types(args: tuple, declared: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The signature of a call: each tensor's pointer type; for a number, the type the renderer
    declared (`declared`, from `signature_of`), else int64 (a seed or offset)."""
    return tuple(pointer_type(str(a.dtype).removeprefix("torch.")) if hasattr(a, "data_ptr")
                 else declared[i] if declared is not None else SCALAR_TYPE
                 for i, a in enumerate(args))  # fmt: skip


def argument_alignment(args: tuple) -> tuple[bool, ...]:
    """Which arguments are pointers 16-byte aligned (numbers count as aligned: they are never specialized)."""
    return tuple(not hasattr(a, "data_ptr") or a.data_ptr() % ALIGNMENT == 0 for a in args)


@dataclass(frozen=True)
class CompileRequest:
    """One compiled kernel, as plain data a worker process can take (Note: ember owns the Triton compile)."""

    root: str  # the ember cache root and the module's path in it, with its checksum (Note: cache safety)
    relative: str
    sha256: str
    function: str  # the jit function: the kernel's name and variant
    signature: tuple[str, ...]  # Triton types of the call's arguments, in order (no block sizes)
    aligned: tuple[bool, ...]  # per argument: a pointer that is 16-byte aligned
    constexprs: tuple[tuple[str, int], ...]  # XBLOCK (and RBLOCK)
    num_warps: int
    target: tuple[str, int, int]  # GPUTarget: backend, arch, warp size
    options: tuple[tuple[str, Any], ...] = field(default_factory=tuple)  # Triton's: debug, instrumentation
    # Triton's cache folder and the environment variables that key its cache, as the launcher's
    # process sees them: a worker compiles under these, so the launcher's compile finds its entry
    cache_dir: str = ""
    environment: tuple[tuple[str, str], ...] = ()

    @property
    def launcher_key(self) -> tuple:
        """What Triton's C launcher for this kernel depends on (the argument types and where the
        block sizes sit; their values are compiled into the kernel, not the launcher) and the
        Triton cache it is built into."""
        return self.cache_dir, self.target, self.signature, tuple(name for name, _ in self.constexprs)

    @property
    def kernel(self) -> str:
        """How errors name this compile."""
        blocks = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.function} ({blocks}, num_warps={self.num_warps})"


# Note: the tools that key Triton's cache. Triton's cache key holds the ptxas version and the
# libdevice file's hash besides the variables it declares cache-invalidating; the binaries come
# from these variables, which it does not declare. Inductor sets TRITON_PTXAS_PATH (torch's own
# ptxas) in the process when it first compiles: a worker started before that kept Triton's
# ptxas, so every kernel it compiled had another key than the launcher's, and the launcher
# compiled each again, serially (a GPT-2 first call 3.6 s alone, 10.8 s after inductor's). And
# Triton reads the version once per process: the launcher's keys kept the version of the ptxas
# named when it first compiled. Requests carry these variables; a worker told another ptxas, and
# the launcher's process when they changed, read its version again.
TOOL_VARIABLES = ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH", "TRITON_LIBDEVICE_PATH")


def triton_settings() -> tuple[tuple[tuple[str, Any], ...], str, tuple[tuple[str, str], ...]]:
    """Triton's options the binder would add, its cache folder and the environment that keys
    its cache (Note: the tools that key Triton's cache), read now in this process."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars

    options = (("debug", bool(triton.knobs.runtime.debug)),
               ("instrumentation_mode", triton.knobs.compilation.instrumentation_mode))  # fmt: skip
    tools = {name: os.environ[name] for name in TOOL_VARIABLES if name in os.environ}
    libdevice = triton.knobs.nvidia.libdevice_path  # set as a knob (inductor does), not only in the environment
    if libdevice:
        tools["TRITON_LIBDEVICE_PATH"] = libdevice
    _read_tools_again_if_changed(tools)
    environment = tuple(sorted({**get_cache_invalidating_env_vars(), **tools}.items()))
    return options, os.path.abspath(triton.knobs.cache.dir), environment


def compile_kernel(fn: Any, request: CompileRequest) -> Any:
    """`request` compiled for `fn` (the module's JITFunction): a triton CompiledKernel, from
    Triton's cache when a worker (or an earlier process) compiled it already."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    blocks = dict(request.constexprs)
    names = [name for name in fn.arg_names if name not in blocks]
    if len(names) != len(request.signature):
        raise TypeError(f"runtime: Triton kernel {request.function} takes {len(names)} arguments, "
                        f"the launcher has {len(request.signature)}")  # fmt: skip
    types = dict(zip(names, request.signature))
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", ALIGNMENT]]
             for name, kind, aligned in zip(names, request.signature, request.aligned)
             if aligned and kind.startswith("*")}  # fmt: skip
    source = ASTSource(fn, signature, constexprs=blocks, attrs=attrs)
    # no FMA contraction: eager rounds a product and a sum separately
    options = {**dict(request.options), "num_warps": request.num_warps, "enable_fp_fusion": False}
    return triton.compile(source, target=GPUTarget(*request.target), options=options)


def compile_in_worker(request: CompileRequest, build_launcher: bool) -> tuple[str, str]:
    """What a pool worker does with a request (runtime/triton_pool.py): the module imported from
    its verified bytes, compiled under the launcher's cache folder and environment, so the
    entry lands where the launcher's own compile looks; with `build_launcher`, Triton's C launcher
    for its argument types too. Returns a note for the pool's future, and the cache key the
    kernel got (the launcher's compile must find the same: `triton_pool_key_mismatches`)."""
    from ember.runtime.triton import import_module

    os.environ["TRITON_CACHE_DIR"] = request.cache_dir
    _apply_environment(dict(request.environment))
    module = import_module(request.root, request.relative, request.sha256, interpret=False)
    kernel = compile_kernel(getattr(module, request.function), request)
    note = cuda_launcher(kernel) if build_launcher and request.target[0] == "cuda" else "compiled"
    return note, str(kernel.hash)


def cuda_launcher(kernel: Any) -> str:
    """Triton's C launcher for `kernel`'s argument types, built (gcc, about a second) into
    Triton's cache, where loading the kernel in the launcher's process finds it. A launcher
    that cannot be built here (no libcuda on a machine without a GPU) is built there instead."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
        return "compiled with its launcher"
    except Exception as e:
        return f"compiled; no launcher ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def _apply_environment(wanted: dict[str, str]) -> None:
    """The launcher's values of the variables that key Triton's cache, set here (and the ones it
    left unset, unset; Note: the tools that key Triton's cache)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars

    tools_before = {name: os.environ.get(name) for name in TOOL_VARIABLES}
    for name in (set(get_cache_invalidating_env_vars()) | set(TOOL_VARIABLES)) - set(wanted):
        os.environ.pop(name, None)
    os.environ.update(wanted)
    if tools_before != {name: os.environ.get(name) for name in TOOL_VARIABLES}:
        _forget_tool_versions()


_tools_seen: dict[str, str] | None = None
_tools_lock = threading.Lock()


def _read_tools_again_if_changed(tools: dict[str, str]) -> None:
    """This process keys its own compiles by the ptxas version Triton read first, whichever ptxas
    the environment names now; where the tools changed since this process last asked (or it
    never asked), Triton reads the version again, so its keys and its workers' agree."""
    global _tools_seen
    with _tools_lock:
        if tools != _tools_seen:
            _forget_tool_versions()
            _tools_seen = dict(tools)


def _forget_tool_versions() -> None:
    """Triton reads ptxas's version once per process (a cached function); another ptxas needs
    it read again. Nothing to forget on a Triton without that cache."""
    try:
        from triton.backends.nvidia import compiler
    except ImportError:
        return
    cached = getattr(compiler, "get_ptxas_version", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()
