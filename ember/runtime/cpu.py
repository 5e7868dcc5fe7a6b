"""Stage `runtime` (CPU): compile C++ kernels with gcc, cache them on disk, load with ctypes.

A kernel's entry (Note: cache safety, cache.py) is three files in `kernels/<key[:2]>/`:
`<key>.cpp` (gcc's input, for people), `<key>-<sha256[:16]>.so` (named by its contents, so
concurrent writers of one key never replace each other's file) and `<key>.json`, recording
the key and the .so's name and sha256. The key hashes the source with everything else the
shared object depends on (`kernel_identity`: compiler, flags, CPU, libmvec). A .so is
loaded only after its bytes match the recorded checksum.

Note: kernels compiled together
    A gcc process costs more than many small kernels' code: its start, the driver, the
    assembler and the linker, the .so written and fsynced. So the kernels of a graph go to gcc
    in batches (`compile_cpp_batch`): one translation unit, each kernel's source in a namespace
    of its own (its helpers, declarations and OpenMP reductions never meet another's) with its
    `#include` lines hoisted, and `extern "C"` keeping each kernel's symbol. Each kernel still
    has its own entry, keyed by its own source as above; a batched one's record names the
    batch's .so by its path relative to the cache root (`library`) instead of a file beside
    it, with that .so's sha256, checked before the load as for any other. A lookup is per
    kernel, so a kernel compiled in one graph's batch is a hit for every other graph. When a
    batch fails, its kernels are compiled one by one, so the error names the kernel.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from ember.errors import EmberError
from ember.metrics import metrics
from ember.runtime import cache_identity
from ember.runtime.cache import (
    CacheDirectoryError,
    CorruptEntry,
    content_hash,
    discard,
    entry_folder,
    install,
    open_root,
    read_entry,
    read_verified,
    relative_to_root,
    resolve_in_root,
    sha256_bytes,
    temp_path_beside,
    write_atomic,
    write_entry,
)

log = logging.getLogger("ember.runtime")

# -fno-trapping-math: kernels never read the floating-point exception flags, and without it
# gcc will not if-convert a select whose arm widens a float (`c ? 0.0f : x` summed in double
# stays a scalar loop, 50x slower); it changes no result (no reassociation, no contraction).
# -mprefer-vector-width=512: gcc's tuning for Intel's AVX-512 server cores (Skylake-SP to Sapphire
# Rapids) vectorizes with 256-bit registers, as 512-bit ones once cost clock speed, while aten's and
# inductor's kernels use 512-bit ones. Arithmetic-heavy loops take about half the time with them
# (exact gelu over 9.6M floats, one thread on Sapphire Rapids: 22.7 -> 13.1 ms; ConvNeXt-tiny,
# LLaMA-style, GPT-2 and BERT 3-5% faster a call); memory-bound loops are unchanged. Without
# AVX-512 the flag does nothing.
FLAGS = (
    "-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
    "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-w",
)  # fmt: skip


# Note: gcc's effort on random draws
#   A Philox draw is ten rounds of 64-bit products inlined into its kernel's loop (renderer/cpp.py
#   PHILOX), which gcc vectorizes at the width of the loop's narrowest type: under a dropout mask's
#   bool store that is 64 lanes, eight vectors per 64-bit value. A kernel holding many draws (GPT-2's
#   dropout masks fused side by side) is one huge basic block, and gcc's work grew faster than
#   linearly with it: with 1, 4, 8 and 16 draws a kernel took 0.09, 0.45, 1.33 and 4.5 s of gcc,
#   most of GPT-2 training's gcc time. -ftime-report put 60% in the combiner (down to 4% once RTL
#   GCSE no longer runs before it) and most of the rest in the register allocator's loop
#   regions. Without RTL GCSE and with one allocation region (DRAW_FLAGS) the same
#   kernels take 0.07, 0.19, 0.41 and 1.03 s, and run at the same speed (the 16 masks 572 us
#   either way: the loop is one basic block, with nothing for either to hoist or place); sources
#   without draws keep gcc's defaults. Such sources are batched only with each other, at most
#   DRAWS_PER_BATCH draws a batch, and generated first, most draws first (compile_cpp.py
#   KernelBuilder, codegen_order), so their compiles start early and spread over the workers.
DRAW_FLAGS = ("-fno-gcse", "-fira-region=one")
DRAWS_PER_BATCH = 16


def random_draws(source: str) -> int:
    """How many Philox draws a rendered C++ source holds (the calls of renderer/cpp.py PHILOX)."""
    return source.count("ember_philox<")


def source_flags(source: str) -> tuple[str, ...]:
    """gcc flags a source needs besides FLAGS (Note: gcc's effort on random draws)."""
    return DRAW_FLAGS if random_draws(source) else ()


def kernel_key(source: str, compiler: str, version: str) -> str:
    """The cache key of a kernel's shared object: its source and everything else gcc's output depends on."""
    return content_hash(source, kernel_identity(compiler), version, *source_flags(source))


def kernel_identity(compiler: str) -> str:
    """Everything besides its source that a kernel's shared object depends on."""
    compiler_version, cpu = cache_identity.compiler_identity(compiler), cache_identity.cpu_identity()
    return content_hash(compiler_version, " ".join(FLAGS), repr(simd_math_functions()), cpu)


@dataclass(frozen=True)
class CompiledKernel:
    path: Path  # absolute
    symbol: str
    cache_hit: bool
    relative: str = ""  # `path` relative to the cache root (what wrappers hold)
    sha256: str = ""  # of the shared object, checked before each process loads it


def compile_cpp(source: str, symbol: str, cache_dir: Path, compiler: str, version: str) -> CompiledKernel:
    """The shared object for `source`, from the cache or built now."""
    root = open_root(cache_dir)
    key = kernel_key(source, compiler, version)
    folder = entry_folder(root, "kernels", key)
    cached = _cached_kernel(root, folder, key, symbol)
    if cached is not None:
        return cached
    return _build_kernel(root, folder, key, source, symbol, compiler)


def _cached_kernel(root: Path, folder: Path, key: str, symbol: str) -> CompiledKernel | None:
    """The entry of `key`, verified and loaded; None (the entry discarded) when it fails."""
    record_path, so_path = folder / f"{key}.json", None
    try:
        record = read_entry(record_path, key)
        if record is None:
            return None
        if "library" in record:  # compiled in a batch (Note: kernels compiled together)
            so_path = resolve_in_root(root, record["library"])
        else:
            so_path = folder / _plain_name(record["file"])
        getattr(load_verified_library(so_path, record["sha256"]), symbol)
        return CompiledKernel(so_path, symbol, True, relative_to_root(root, so_path), record["sha256"])
    except CacheDirectoryError:
        raise
    except Exception as e:  # anything: the entry is rebuilt
        discard(e, record_path, *([so_path] if so_path is not None else []))
        return None


def _plain_name(name: object) -> str:
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        raise CorruptEntry(f"{name!r} is not a file name")
    return name


def _build_kernel(root: Path, folder: Path, key: str, source: str, symbol: str, compiler: str) -> CompiledKernel:
    so_path, sha256 = _run_gcc(folder, key, source, symbol, compiler, source_flags(source))
    write_entry(folder / f"{key}.json", key, {"file": so_path.name, "sha256": sha256, "source": f"{key}.cpp"})
    return CompiledKernel(so_path, symbol, False, relative_to_root(root, so_path), sha256)


def _run_gcc(folder: Path, key: str, source: str, symbols: str, compiler: str,
             extra_flags: tuple[str, ...]) -> tuple[Path, str]:  # fmt: skip
    """gcc on `source` into `folder/<key>-<sha256[:16]>.so`, installed atomically; its path and sha256.
    `symbols`: the kernels it holds, for the error; `extra_flags`: source_flags of its kernels."""
    cpp_path = folder / f"{key}.cpp"
    write_atomic(cpp_path, source)
    tmp = temp_path_beside(folder / f"{key}.so", ".so")
    try:
        libraries = ["-lmvec"] if simd_math_functions() else []
        command = [compiler, *FLAGS, *extra_flags, str(cpp_path), "-o", str(tmp), *libraries]
        metrics.add(gcc_runs=1)
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise EmberError("runtime", f"gcc failed on {cpp_path}:\n{result.stderr[-4000:]}", symbols)
        sha256 = sha256_bytes(tmp.read_bytes())
        so_path = folder / f"{key}-{sha256[:16]}.so"
        install(tmp, so_path)
    finally:
        tmp.unlink(missing_ok=True)
    return so_path, sha256


# ---- kernels compiled together (Note: kernels compiled together) ------------------------------


def batchable(source: str) -> bool:
    """Whether a source may share a translation unit: not one whose file-wide pragmas
    (renderer/choices.py file_pragmas) would apply to the other kernels too."""
    return not source.startswith("#pragma")


def compile_cpp_batch(
    kernels: list[tuple[str, str]], cache_dir: Path, compiler: str, version: str
) -> list[CompiledKernel]:
    """The shared object of each (symbol, source) of `kernels`, in order: from the cache, or
    the missing ones built by one gcc per set of source_flags (one by one when that fails)."""
    root = open_root(cache_dir)
    keys = [kernel_key(source, compiler, version) for _, source in kernels]
    found: dict[int, CompiledKernel] = {}
    for i, ((symbol, _), key) in enumerate(zip(kernels, keys)):
        cached = _cached_kernel(root, entry_folder(root, "kernels", key), key, symbol)
        if cached is not None:
            found[i] = cached
    by_flags: dict[tuple[str, ...], list[int]] = {}
    for i in range(len(kernels)):
        if i not in found:
            by_flags.setdefault(source_flags(kernels[i][1]), []).append(i)
    for flags, missing in by_flags.items():
        if len(missing) > 1:
            try:
                batch = [kernels[i] for i in missing]
                found.update(zip(missing, _build_batch(root, batch, [keys[i] for i in missing], compiler, flags)))
            except EmberError as e:  # compiled one by one below: the failing kernel's error names it
                log.debug("runtime: a batch of %d kernels failed to compile; compiling each alone: %s", len(missing), e)
    for i in (i for i in range(len(kernels)) if i not in found):
        symbol, source = kernels[i]
        found[i] = _build_kernel(root, entry_folder(root, "kernels", keys[i]), keys[i], source, symbol, compiler)
    return [found[i] for i in range(len(kernels))]


def _build_batch(root: Path, kernels: list[tuple[str, str]], keys: list[str], compiler: str,
                 flags: tuple[str, ...]) -> list[CompiledKernel]:  # fmt: skip
    """`flags`: the source_flags every one of `kernels` has."""
    batch_key = content_hash("batch", *keys)  # each key covers its source, the compiler, the flags, the CPU
    folder = entry_folder(root, "kernels", batch_key)
    symbols = [symbol for symbol, _ in kernels]
    source = batch_source([s for _, s in kernels])
    so_path, sha256 = _run_gcc(folder, batch_key, source, ", ".join(symbols), compiler, flags)
    library = relative_to_root(root, so_path)
    for key in keys:
        record = {"library": library, "sha256": sha256, "source": relative_to_root(root, folder / f"{batch_key}.cpp")}
        write_entry(entry_folder(root, "kernels", key) / f"{key}.json", key, record)
    return [CompiledKernel(so_path, symbol, False, library, sha256) for symbol in symbols]


def batch_source(sources: list[str]) -> str:
    """One translation unit for `sources`. At file scope, once, as in each source alone: the
    lines they all open with (the renderer's prelude), their `extern "C"` declaration blocks
    (a `simd` declaration of expf inside a namespace would not reach the builtin gcc calls,
    and its loops would not vectorize) and their OpenMP reduction declarations. The rest of
    each source goes in a namespace of its own, where its helpers never meet another's; C
    linkage keeps every `extern "C"` kernel's symbol as it was."""
    split = [source.splitlines(keepends=True) for source in sources]
    common = 0
    while all(len(lines) > common and lines[common] == split[0][common] for lines in split):
        if split[0][common].startswith('extern "C"'):  # a declaration block or a kernel: not the prelude
            break
        common += 1
    declarations: dict[str, None] = {}
    file_scope: dict[str, None] = {}
    bodies = []
    for lines in split:
        body, declared, scoped = _split_source(lines[common:])
        declarations.update(dict.fromkeys(declared))
        file_scope.update(dict.fromkeys(scoped))
        bodies.append(body)
    parts = ["".join(split[0][:common])]
    if declarations:
        parts.append('extern "C" {\n' + "".join(declarations) + "}\n")
    parts += file_scope
    for i, body in enumerate(bodies):
        parts.append(f"namespace ember_kernel_{i} {{\n{body}}}  // namespace ember_kernel_{i}\n")
    return "".join(parts)


def _split_source(lines: list[str]) -> tuple[str, list[str], list[str]]:
    """(the source's own lines, the lines of its `extern "C" {` declaration blocks, its
    FILE_SCOPE_LINES)."""
    body: list[str] = []
    declared: list[str] = []
    scoped: list[str] = []
    in_block = False
    for line in lines:
        if in_block:
            if line == "}\n":
                in_block = False
            else:
                declared.append(line)
        elif line == 'extern "C" {\n':
            in_block = True
        elif line.startswith(FILE_SCOPE_LINES):
            scoped.append(line)
        else:
            body.append(line)
    return "".join(body), declared, scoped


FILE_SCOPE_LINES = ("#include", "#pragma omp declare reduction")  # each the same wherever it appears


# Owned by this module: each shared object is loaded once per process; `_verified` holds
# the (path, sha256) pairs whose bytes were checked before their load.
_libraries: dict[str, ctypes.CDLL] = {}
_verified: set[tuple[str, str]] = set()
_libraries_lock = threading.Lock()


def load_library(path: str) -> ctypes.CDLL:
    with _libraries_lock:
        if path not in _libraries:
            _libraries[path] = ctypes.CDLL(path)
        return _libraries[path]


def load_verified_library(path: Path, sha256: str) -> ctypes.CDLL:
    """The shared object at `path`, loaded only when its bytes have checksum `sha256`
    (a truncated file would crash the process with SIGBUS; another one would run other code)."""
    with _libraries_lock:
        if (str(path), sha256) not in _verified:
            read_verified(path, sha256)
            _libraries[str(path)] = ctypes.CDLL(str(path))
            _verified.add((str(path), sha256))
        return _libraries[str(path)]


def load_kernel(path: str, symbol: str, num_params: int) -> ctypes._CFuncPtr:
    return _bind(load_library(path), symbol, num_params)


def load_cached_kernel(root: str, relative: str, sha256: str, symbol: str, num_params: int) -> ctypes._CFuncPtr:
    """A kernel as a wrapper names it: its path relative to the cache root and its checksum."""
    return _bind(load_verified_library(resolve_in_root(root, relative), sha256), symbol, num_params)


def _bind(library: ctypes.CDLL, symbol: str, num_params: int) -> ctypes._CFuncPtr:
    """A function object of the caller's own (`library[symbol]`; `getattr` would hand every
    caller the one object ctypes caches, whose argtypes another thread may be setting)."""
    fn = library[symbol]
    fn.argtypes = [ctypes.c_void_p] * num_params
    fn.restype = None
    return fn


# ---- what the host's vectors and C library hold ------------------------------------------


@functools.cache
def float_lanes() -> int:
    """float32 lanes of the vectors kernels are built for (-march=native, 512 bits preferred with
    AVX-512): 16 with AVX-512, 8 with AVX, else 4 (SSE, NEON) (Note: float32 sums in blocks)."""
    flags = cache_identity.cpu_info()[1]
    return 16 if "avx512f" in flags else 8 if "avx" in flags else 4


SIMD_MATH_CANDIDATES = {
    "exp": 1, "log": 1, "sin": 1, "cos": 1, "tan": 1, "asin": 1, "acos": 1, "atan": 1, "sinh": 1, "cosh": 1,
    "tanh": 1, "erf": 1, "expm1": 1, "log1p": 1, "log2": 1, "log10": 1, "exp2": 1, "atan2": 2, "pow": 2,
}  # fmt: skip


@functools.cache
def simd_math_functions() -> tuple[tuple[str, int], ...]:
    """(name, arity) of the math functions glibc's libmvec has vector versions of, so that
    kernels can declare them `simd` and gcc vectorizes loops that call them."""
    try:
        libmvec = ctypes.CDLL("libmvec.so.1")
    except OSError:
        return ()
    found = []
    for name, arity in SIMD_MATH_CANDIDATES.items():
        mangled = "v" * arity
        if hasattr(libmvec, f"_ZGVbN4{mangled}_{name}f") and hasattr(libmvec, f"_ZGVbN2{mangled}_{name}"):
            found.append((name, arity))
    return tuple(found)
