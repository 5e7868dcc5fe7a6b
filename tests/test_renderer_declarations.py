"""The C++ renderer declares only what a kernel calls: the `simd` declarations of libm functions
(through which gcc reaches libmvec's vector versions) and the cos alias (Note: cos through an
alias) for exactly the functions and types the kernel's code calls, and every one of those."""

import re
from pathlib import Path

import pytest
import torch

import ember
from ember.renderer.cpp import calls, simd_declarations
from ember.runtime.cpu import simd_math_functions
from tests.helpers import cpu_kernels_only

DECLARED = re.compile(r"^__attribute__\(\(simd[^)]*\)[^)]*\)\) \w+ (\w+)\(", re.M)

PROGRAMS = {
    "demo_like": (lambda x, y: torch.nn.functional.gelu(x) * torch.sigmoid(y) + x.sin() * y.cos(), torch.float32),
    "float64_tanh_pow": (lambda x, y: torch.tanh(x) + torch.pow(x.abs(), y), torch.float64),
    "no_math": (lambda x, y: (x * y + 1).relu(), torch.float32),
    "mixed_types": (lambda x, y: x.exp() + y.double().log1p().float(), torch.float32),
}


def _kernel_sources(fn, dtype, tmp_path: Path) -> list[str]:
    x, y = torch.randn(64, 96, dtype=dtype), torch.rand(64, 96, dtype=dtype) + 0.5
    ember.compile(fn, debug=True, debug_dir=str(tmp_path))(x, y)
    return [path.read_text() for path in tmp_path.rglob("kernels/*.cpp")]


@cpu_kernels_only
@pytest.mark.parametrize("name", PROGRAMS)
def test_declares_exactly_the_called_math_functions(name, tmp_path):
    fn, dtype = PROGRAMS[name]
    sources = _kernel_sources(fn, dtype, tmp_path)
    assert sources
    vector = {f"{n}{suffix}" for n, _ in simd_math_functions() for suffix in ("f", "")} | {"ember_cosf", "ember_cos"}
    for source in sources:
        declared = set(DECLARED.findall(source))
        body = source[source.index('extern "C" void') :]  # the kernel itself
        called = {f for f in vector if calls(body, f)}
        assert declared == called, f"declared {sorted(declared)}, called {sorted(called)}\n{source}"


def test_simd_declarations_follow_the_calls():
    functions = (("exp", 1), ("sin", 1), ("pow", 2))
    code = "float a = __builtin_expf(x); double b = __builtin_pow(y, z); ember_sinf(q);"
    assert DECLARED.findall(simd_declarations(functions, code)) == ["expf", "pow"]
    assert simd_declarations(functions, "return x + 1;") == ""
