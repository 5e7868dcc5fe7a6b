"""Stage `runtime` (CPU): compile C++ kernels with gcc, cache them on disk, load with ctypes.

The cache key is a hash of the source, the compiler's version and flags, and ember's
version, so a change to any of them builds a new entry (Note: cache safety).
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from ember.errors import EmberError
from ember.runtime.cache import content_hash, entry_path, temp_path_beside, write_atomic

# -fno-trapping-math: kernels never read the floating-point exception flags, and without it
# gcc will not if-convert a select whose arm widens a float (`c ? 0.0f : x` summed in double
# stays a scalar loop, 50x slower); it changes no result (no reassociation, no contraction).
FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-fno-trapping-math",
    "-ffp-contract=off", "-w",
)  # fmt: skip


@functools.cache
def compiler_identity(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise EmberError("runtime", f"C++ compiler {compiler!r} is not usable ({e}); set EMBER_CXX") from e


@dataclass(frozen=True)
class CompiledKernel:
    path: Path
    symbol: str
    cache_hit: bool


def compile_cpp(source: str, symbol: str, cache_dir: Path, compiler: str, version: str) -> CompiledKernel:
    """The shared object for `source`, from the cache or built now."""
    key = content_hash(source, compiler_identity(compiler), " ".join(FLAGS), repr(simd_math_functions()), version)
    so_path = entry_path(cache_dir, "kernels", key, ".so")
    if so_path.exists() and _loads(so_path):
        return CompiledKernel(so_path, symbol, cache_hit=True)
    cpp_path = so_path.with_suffix(".cpp")
    write_atomic(cpp_path, source)
    tmp = temp_path_beside(so_path, ".so")
    try:
        libraries = ["-lmvec"] if simd_math_functions() else []
        command = [compiler, *FLAGS, str(cpp_path), "-o", str(tmp), *libraries]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise EmberError("runtime", f"gcc failed on {cpp_path}:\n{result.stderr[-4000:]}", symbol)
        os.replace(tmp, so_path)
    finally:
        tmp.unlink(missing_ok=True)
    return CompiledKernel(so_path, symbol, cache_hit=False)


def _loads(path: Path) -> bool:
    """A cached entry that the loader rejects is corrupt: remove it so it is rebuilt."""
    try:
        load_library(str(path))
        return True
    except OSError:
        path.unlink(missing_ok=True)
        return False


# Owned by this module: each shared object is loaded once per process.
_libraries: dict[str, ctypes.CDLL] = {}
_libraries_lock = threading.Lock()


def load_library(path: str) -> ctypes.CDLL:
    with _libraries_lock:
        if path not in _libraries:
            _libraries[path] = ctypes.CDLL(path)
        return _libraries[path]


def load_kernel(path: str, symbol: str, num_params: int) -> ctypes._CFuncPtr:
    """A function object of the caller's own (`lib[symbol]`; `getattr` would hand every caller
    the one object ctypes caches, whose argtypes another thread may be setting)."""
    fn = load_library(path)[symbol]
    fn.argtypes = [ctypes.c_void_p] * num_params
    fn.restype = None
    return fn


# ---- what the host's C library can vectorize --------------------------------------------

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
