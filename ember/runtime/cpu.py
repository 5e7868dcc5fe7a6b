"""Stage `runtime` (CPU): compile C++ kernels with gcc, cache them on disk, load with ctypes.

A kernel's entry (Note: cache safety, cache.py) is three files in `kernels/<key[:2]>/`:
`<key>.cpp` (gcc's input, for people), `<key>-<sha256[:16]>.so` (named by its contents, so
concurrent writers of one key never replace each other's file) and `<key>.json`, recording
the key and the .so's name and sha256. The key hashes the source with everything else the
shared object depends on (`kernel_identity`: compiler, flags, CPU, libmvec). A .so is
loaded only after its bytes match the recorded checksum.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from ember.errors import EmberError
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

# -fno-trapping-math: kernels never read the floating-point exception flags, and without it
# gcc will not if-convert a select whose arm widens a float (`c ? 0.0f : x` summed in double
# stays a scalar loop, 50x slower); it changes no result (no reassociation, no contraction).
FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-fno-trapping-math",
    "-ffp-contract=off", "-w",
)  # fmt: skip


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
    key = content_hash(source, kernel_identity(compiler), version)
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
    cpp_path = folder / f"{key}.cpp"
    write_atomic(cpp_path, source)
    tmp = temp_path_beside(folder / f"{key}.so", ".so")
    try:
        libraries = ["-lmvec"] if simd_math_functions() else []
        command = [compiler, *FLAGS, str(cpp_path), "-o", str(tmp), *libraries]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise EmberError("runtime", f"gcc failed on {cpp_path}:\n{result.stderr[-4000:]}", symbol)
        sha256 = sha256_bytes(tmp.read_bytes())
        so_path = folder / f"{key}-{sha256[:16]}.so"
        install(tmp, so_path)
    finally:
        tmp.unlink(missing_ok=True)
    write_entry(folder / f"{key}.json", key, {"file": so_path.name, "sha256": sha256, "source": cpp_path.name})
    return CompiledKernel(so_path, symbol, False, relative_to_root(root, so_path), sha256)


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
