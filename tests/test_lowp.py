"""float16 and bfloat16 in ember's own kernels, against eager on the same dtype.

Kernels load the 16-bit values into float32, compute in float32 and round back after every
aten op whose result is float16/bfloat16 (Note: low-precision floats, codegen/low_precision.py).

How close is close: conversions and exactly rounded ops (+ - * /, sqrt, rounding, selection,
comparisons) must equal eager bit for bit, NaN for NaN. Transcendental ops and composites are
computed in float32 by both eager and ember with different float32 libraries and summation
orders; two float32 results a few float32 ulps apart round to the same float16/bfloat16 value
except next to a rounding tie, where they land one ulp of the low-precision dtype apart. So those
must be within 1 ulp of eager, or within 1 ulp of the correctly rounded float64 result (where
eager itself is less accurate: its bfloat16 prod rounds every partial product), or within
atol = 1e-5 (torch's default atol for both dtypes) where the value is so small that an ulp of
it means nothing (gelu of a large negative number). Ulps are counted on the ordered bit
patterns, so the bound is the same at every magnitude, unlike an rtol (torch's default bfloat16
rtol of 1.6e-2 is 2 to 4 ulps).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers import compile_fn

bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
LOW = (bf16, f16)
INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
ATOL = 1e-5
nan, inf = math.nan, math.inf


# ---- comparing ------------------------------------------------------------------------------


def ordered(x: torch.Tensor) -> torch.Tensor:
    """The 16-bit patterns as integers ordered like the values (-0.0 and 0.0 are both 0)."""
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits + 32768), bits)


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place of the dtype; NaN against a number is infinitely far."""
    distance = (ordered(got) - ordered(want)).abs()
    distance = torch.where(got.isnan() & want.isnan(), 0, distance)
    return torch.where(got.isnan() ^ want.isnan(), 1 << 30, distance)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Equal bit for bit (so -0.0 is not 0.0); any NaN matches any NaN."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, eager {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, eager {tuple(want.shape)}"
    if not got.is_floating_point():
        assert torch.equal(got, want), f"{what}: values differ from eager{first_difference(got != want, got, want)}"
        return
    nans = want.isnan()
    assert torch.equal(got.isnan(), nans), f"{what}: NaN differs{first_difference(got.isnan() != nans, got, want)}"
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    differs = torch.zeros_like(nans)
    differs[~nans] = got[~nans].contiguous().view(bits) != want[~nans].contiguous().view(bits)
    assert not differs.any(), f"{what}: bits differ{first_difference(differs, got, want)}"


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, reference: torch.Tensor | None, max_ulps: int,
                       what: str = "") -> None:  # fmt: skip
    """Each element within `max_ulps` of eager, or of the correctly rounded `reference`, or ATOL."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, eager {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, eager {tuple(want.shape)}"
    if got.dtype not in LOW:
        return assert_same_bits(got, want, what) if not got.is_floating_point() else None
    ok = ulps(got, want) <= max_ulps
    if reference is not None:
        ok |= ulps(got, reference.to(got.dtype)) <= max_ulps
    ok |= (got.double() - want.double()).abs() <= ATOL
    distance = ulps(got, want)
    assert ok.all(), f"{what}: {int(distance[~ok].max())} ulps from eager{first_difference(~ok, got, want)}"


def first_difference(differs: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> str:
    if not differs.any():
        return ""
    where = tuple(differs.nonzero()[0].tolist())
    return f" (first at {list(where)}: {got[where].item()!r}, eager {want[where].item()!r})"


def upcast(tree):
    return tuple(x.double() if isinstance(x, torch.Tensor) and x.dtype in LOW else x for x in tree)


def run(fn, *inputs, max_ulps: int = 0, reference: bool = True):
    """`fn` through ember against eager on the same inputs, with no fallback extern; 0 ulps means
    bit for bit. Returns ember's outputs (a tuple)."""
    ember.metrics.reset()
    got = compile_fn(fn)(*inputs)
    want = fn(*inputs)
    precise = fn(*upcast(inputs)) if reference and max_ulps else None
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    precise = precise if precise is None or isinstance(precise, tuple) else (precise,)
    for i, (g, w) in enumerate(zip(got, want)):
        if max_ulps == 0:
            assert_same_bits(g, w, f"output {i}")
        else:
            assert_within_ulps(g, w, None if precise is None else precise[i], max_ulps, f"output {i}")
    assert ember.metrics.fallback_calls == 0, dict(ember.metrics.fallback_ops)
    return got


# ---- conversions: bit for bit ---------------------------------------------------------------


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """All 65536 values of a 16-bit float: both zeros, denormals, normals, infinities, NaNs."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def in_range(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of `x` whose conversion to integer `dtype` is defined (C++ leaves the rest
    undefined, and eager's result for them depends on its kernel path)."""
    info = torch.iinfo(dtype)
    x = x[x.isfinite()]
    return x[(x > float(info.min) - 1) & (x < float(info.max) + 1)]


@pytest.mark.parametrize("dtype", LOW)
def test_from_low_precision_every_value(dtype):
    x = every_pattern(dtype)
    other = f16 if dtype is bf16 else bf16
    run(lambda x: (x.to(f32), x.to(f64), x.to(other), x.to(torch.bool), x.float().to(dtype)), x)
    for target in INTS:
        run(lambda x: x.to(target), in_range(x, target))


def ties(dtype: torch.dtype) -> torch.Tensor:
    """float64 values exactly halfway between neighbouring values of `dtype`, and one float32
    ulp either side of each: where round-to-nearest-even is decided."""
    low = every_pattern(dtype)
    low = low[low.isfinite()].double().unique()
    halfway = (low[:-1] + low[1:]) / 2
    nudge = halfway.abs() * 2.0**-24 + 2.0**-149
    return torch.cat([halfway, halfway + nudge, halfway - nudge, low])


def float32_specials(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    values = [nan, -nan, inf, -inf, 0.0, -0.0, info.max, -info.max, info.tiny, info.smallest_normal / 2,
              info.max * (1 + info.eps / 4), info.max * (1 + info.eps / 2), 2 * info.max, 1e38, 2.0**-149,
              -(2.0**-149), 2.0**-126, info.eps, 1 + info.eps / 2]  # fmt: skip
    return torch.tensor(values, dtype=f32)


@pytest.mark.parametrize("dtype", LOW)
def test_to_low_precision_rounds_to_nearest_even(dtype):
    torch.manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int32).view(f32)
    x32 = torch.cat([ties(dtype).float(), float32_specials(dtype), random_bits])
    run(lambda x: x.to(dtype), x32)
    # double -> float16/bfloat16 rounds through float32, as eager does (so twice)
    double_rounding = ties(dtype) + ties(dtype).abs() * 2.0**-40
    run(lambda x: x.to(dtype), torch.cat([double_rounding, ties(dtype), float32_specials(dtype).double()]))


@pytest.mark.parametrize("dtype", LOW)
def test_integers_and_bools_to_low_precision(dtype):
    torch.manual_seed(0)
    shifts = torch.arange(8, 63)
    around_ties = torch.cat([(1 << shifts) + (1 << (shifts - 8)) + d for d in (-1, 0, 1)])
    int64 = torch.cat([around_ties, -around_ties, torch.randint(-(2**62), 2**62, (4096,))])
    run(lambda x: x.to(dtype), int64)
    run(lambda x: x.to(dtype), torch.randint(-(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int32))
    for small in (torch.int16, torch.int8, torch.uint8):
        info = torch.iinfo(small)
        run(lambda x: x.to(dtype), torch.arange(info.min, info.max + 1).to(small))
    run(lambda x: x.to(dtype), torch.tensor([True, False]))


def test_float16_and_bfloat16_convert_both_ways():
    run(lambda a, b: (a.to(f16), b.to(bf16)), every_pattern(bf16), every_pattern(f16))


# ---- pointwise ------------------------------------------------------------------------------

SPECIALS = (nan, inf, -inf, -0.0, 0.0, 0.5, -0.5, 1.5, -2.5, 1.0, -1.0, 3.0, 2**-10, 0.7, -7.25, 1e-6)


def variants(dtype: torch.dtype, shape=(6, 35)) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of operands: random values with the special ones mixed in, in every layout."""
    torch.manual_seed(0)

    def values(*size):
        x = torch.randn(*size) * 3
        if x.numel() >= len(SPECIALS):
            x.view(-1)[: len(SPECIALS)] = torch.tensor(SPECIALS)
        return x[torch.randperm(x.shape[0])].to(dtype)

    a, b = values(*shape), values(*shape).flip(0)
    return {
        "contiguous": (a, b),
        "transposed": (values(*shape[::-1]).t(), b),
        "sliced": (values(shape[0], 2 * shape[1])[:, ::2], b),
        "broadcast": (a, values(shape[1])),
        "0-d": (torch.tensor(0.7, dtype=dtype), torch.tensor(-2.5, dtype=dtype)),
        "empty": (values(0, shape[1]), values(0, shape[1])),
    }


# exactly rounded in float32 and then once to the dtype: equal to eager bit for bit
EXACT_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "rsub_scalar": lambda a, b: 0.3 - a,
    "add_scalar": lambda a, b: a + 0.3, "mul_scalar": lambda a, b: a * 0.3, "div_scalar": lambda a, b: a / 0.3,
    "maximum": torch.maximum, "minimum": torch.minimum, "where": lambda a, b: torch.where(a > b, a, b),
    "where_scalar": lambda a, b: torch.where(a > 0, a, 0.3), "clamp": lambda a, b: a.clamp(-0.3, 1.1),
    "eq": torch.eq, "lt": torch.lt, "ge_scalar": lambda a, b: a >= 0.3, "ne": torch.ne,
}  # fmt: skip
EXACT_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "relu": torch.relu, "sqrt": torch.sqrt, "floor": torch.floor,
    "ceil": torch.ceil, "round": torch.round, "trunc": torch.trunc, "reciprocal": torch.reciprocal,
    "sign": torch.sign, "isnan": torch.isnan, "isinf": torch.isinf, "square": torch.square,
    "hardtanh": F.hardtanh, "to_float": lambda x: x.float(), "pow_2": lambda x: x**2,
}  # fmt: skip
# float32 libm against eager's vectorized float32 math: within 1 ulp of the dtype
TRANSCENDENTAL = {
    "exp": torch.exp, "log": torch.log, "log1p": torch.log1p, "expm1": torch.expm1, "sin": torch.sin,
    "cos": torch.cos, "tan": torch.tan, "tanh": torch.tanh, "atan": torch.atan, "asin": torch.asin,
    "erf": torch.erf, "sigmoid": torch.sigmoid, "rsqrt": torch.rsqrt, "gelu": F.gelu, "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "softplus": F.softplus, "pow": lambda x: x.abs() ** 1.7,
    "log2": torch.log2, "exp2": torch.exp2, "atan2": lambda x: torch.atan2(x, x.flip(-1)),
    "fmod": lambda x: torch.fmod(x, 0.7), "remainder": lambda x: torch.remainder(x, -0.7),
}  # fmt: skip


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("variant", ["contiguous", "transposed", "sliced", "broadcast", "0-d", "empty"])
def test_exactly_rounded_ops_match_eager_bit_for_bit(dtype, variant):
    a, b = variants(dtype)[variant]
    run(lambda a, b: tuple(fn(a, b) for fn in EXACT_BINARY.values()), a, b)
    run(lambda a: tuple(fn(a) for fn in EXACT_UNARY.values()), a)


# Eager's vectorized and scalar loops differ here (the vectorized trunc division rounds the
# quotient to the dtype before truncating, the strided floor division computes in the dtype):
# ember computes in float32 and rounds once, so it matches eager or the exact result.
ROUNDING_DIVISION = {
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "floor_divide_scalar": lambda a, b: a // 0.3,
}  # fmt: skip


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("variant", ["contiguous", "transposed", "broadcast", "0-d", "empty"])
def test_transcendental_ops_within_one_ulp(dtype, variant):
    a, b = variants(dtype)[variant]
    run(lambda a: tuple(fn(a) for fn in TRANSCENDENTAL.values()), a, max_ulps=1)
    run(lambda a, b: tuple(fn(a, b) for fn in ROUNDING_DIVISION.values()), a, b, max_ulps=1)


@pytest.mark.parametrize("dtype", LOW)
def test_fused_chain_rounds_after_every_op_as_eager(dtype):
    """Every op of a fused chain rounds to the dtype where eager's does: bit for bit with eager,
    where computing the chain in float32 and rounding once differs from it."""
    a, b = variants(dtype, (64, 129))["contiguous"]

    def chain(a, b):
        return ((a * b + 0.3) * 1.7 - b).abs().sqrt() / (b * b + 1)

    run(chain, a, b)
    assert ember.metrics.kernels_generated == 1
    rounded_once = chain(a.float(), b.float()).to(dtype)
    assert not torch.equal(rounded_once, chain(a, b)), "inputs too tame: rounding once would pass too"


@pytest.mark.parametrize("dtype", LOW)
def test_add_rounds_alpha_to_the_dtype_as_eager(dtype):
    """Eager's add kernel rounds alpha to the dtype and computes a + alpha * b in float32 (its
    scalar loop tail computes in the dtype instead: a size with no tail)."""
    a, b = (torch.randn(2, 4, 64) * 3).to(dtype), (torch.randn(4, 64) * 3).to(dtype)
    run(lambda a, b: (torch.add(a, b, alpha=0.3), torch.sub(a, b, alpha=2.5)), a, b)
