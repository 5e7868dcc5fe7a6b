"""Every lowered elementwise, constant and view op against eager, through `check`.

Ops live in tables: a name, the function, and the domain its inputs are drawn from. Tests run
the tables over input variants (contiguous, transposed, sliced with a step, broadcast, 0-d,
empty, NaN/±inf/-0.0) and dtypes. Ops that take the same inputs compile together as one graph
returning a tuple (one trace and, fused, about one kernel per test); identical kernels compile
once per session (tests/conftest.py). Combinations torch rejects are dropped before compiling.
Beyond `check`'s comparison with the float64 reference, exactly rounded ops must equal eager bit
for bit, and zeros computed from the special values must have eager's sign.

Integer division and remainder by zero raise (in eager, and in ember through a kernel check:
tests/test_errors.py), so integer divisors here are drawn from nonzero values only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import ember
from tests.helpers import check, compile_fn

f32, f64, i32, i64, b8 = torch.float32, torch.float64, torch.int32, torch.int64, torch.bool
DTYPES = (f32, f64, i32, i64, b8)
nan, inf = math.nan, math.inf

# 15 values: every special float and the rounding ties, so one (3, 5) tensor holds them all. The
# small one is a power of two: quotients like -2.5 / 1e-3 round to an integer in float32 but not in
# the float64 reference, and floor/trunc division would then differ by 1 from it, not from eager.
SPECIALS = (nan, inf, -inf, -0.0, 0.0, 0.5, -0.5, 1.5, -2.5, 1.0, -1.0, 3.0, 2**-10, 0.7, -7.25)
# Eager's own sign of a zero result from these depends on its kernel path (vectorized or not,
# broadcast or not): maximum(-0.0, 0.0) is -0.0 for some shapes and 0.0 for others.
ZERO_SIGN_VARIES = {"maximum", "minimum"}
# Ops whose float results are exactly rounded (IEEE +-*/, rounding, selection, the same formulas as
# ATen's): ember must equal eager on the same dtypes bit for bit, not just be close. Not sqrt: eager's
# vectorized float32 sqrt is off by an ulp for some inputs, where ember's std::sqrt is exact.
EXACT = {
    "relu", "hardtanh", "hardtanh_range", "neg", "abs", "sign", "floor", "ceil", "round", "trunc", "reciprocal",
    "clamp", "clamp_int", "clamp_only_min", "clamp_only_max", "clamp_min", "clamp_max", "pow_0", "pow_1", "pow_2",
    "pow_3", "pow_float_2", "add", "sub", "mul", "div", "div_floor", "div_trunc", "floor_divide",
    "remainder", "fmod", "maximum", "minimum", "where", "only_min", "only_max",
}  # fmt: skip
# Integer operands for the sign tables: every sign of dividend and divisor, shifts past the width.
INT_PATTERNS = {
    "real": range(-7, 8),
    "base": range(-7, 8),
    "nonzero": (-3, -2, -1, 1, 2, 3),
    "positive": (1, 2, 3, 7),
    "unit": (-1, 0, 1),
    "exponent": (-2, -1, 0, 1, 2, 3, 5),
    "shift": (-1, 0, 1, 3, 31, 32, 33, 63, 64),
}


# ---- inputs ------------------------------------------------------------------------------


def draw(shape: tuple[int, ...], dtype: torch.dtype, domain: str, seed: int = 0) -> torch.Tensor:
    """Random values of `dtype` from `domain`: real, positive, unit (|x| < 1), nonzero,
    base (positive floats, any ints: bases of pow), exponent (small; non-negative ints), shift."""
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        if domain in ("nonzero", "positive"):
            return torch.ones(shape, dtype=torch.bool)
        return torch.rand(shape, generator=gen) < 0.5
    if dtype.is_floating_point:
        u = torch.rand(shape, generator=gen, dtype=torch.float64)
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
        values = {
            "real": (u - 0.5) * 8,
            "positive": u * 4 + 0.05,
            "base": u * 4 + 0.05,
            "unit": (u - 0.5) * 1.8,
            "nonzero": sign * (u * 3 + 0.25),
            "exponent": (u - 0.5) * 4,
            "shift": u * 8,
        }[domain]
        return values.to(dtype)
    low, high = {"real": (-9, 9), "base": (-6, 6), "positive": (1, 9), "unit": (-1, 1), "nonzero": (1, 6),
                 "exponent": (0, 3), "shift": (0, 7)}[domain]  # fmt: skip
    values = torch.randint(low, high + 1, shape, generator=gen, dtype=dtype)
    if domain == "nonzero":
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1, 1).to(dtype)
        values = values * sign
    return values


def specials(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    return torch.tensor(SPECIALS, dtype=dtype).reshape(shape)


def laid_out(variant: str, dtype: torch.dtype, domain: str, seed: int = 0) -> torch.Tensor:
    """One input in a layout variant; all but 0-d, empty and large have shape (3, 5)."""
    make = lambda shape: draw(shape, dtype, domain, seed)
    if variant == "contiguous":
        return make((3, 5))
    if variant == "transposed":
        return make((5, 3)).t()
    if variant == "sliced":
        return make((3, 11))[:, 1::2]
    if variant == "0d":
        return make(())
    if variant == "empty":
        return make((0, 5))
    if variant == "special":
        return specials(dtype)
    if variant == "large":  # past the threshold where loops run on several threads
        return make((300, 200)).t()
    raise ValueError(variant)


# ---- the check -----------------------------------------------------------------------------


def torch_accepts(fn: Callable, inputs: tuple) -> bool:
    """Does eager run `fn`, and do the meta kernels that torch.compile traces with? They reject
    a few combinations eager runs (bool << int); neither involves ember."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # it logs every rejection as an error with a traceback
    try:
        fn(*inputs)
        with FakeTensorMode() as mode:
            fn(*(mode.from_tensor(x) for x in inputs))
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    finally:
        fake_log.setLevel(level)
    return True


def check_ops(ops: dict[str, Callable], *inputs, signed_zeros: bool = False, exact: Collection[str] = ()) -> None:
    """`check` the ops torch accepts on `inputs`, compiled together as one graph; no op may
    fall back to aten. The ops named in `exact` must equal eager on the same dtypes bit for bit
    (IEEE-exact ops: rounding, division, casts, data movement), beyond `check`'s tolerance against
    the float64 reference; with `signed_zeros`, zero results must also have eager's sign."""
    accepted = {name: fn for name, fn in ops.items() if torch_accepts(fn, inputs)}
    if not accepted:
        pytest.skip("torch rejects every op for these inputs")
    fns = tuple(accepted.values())

    def program(*xs):
        return tuple([fn(*xs) for fn in fns])

    try:
        actual = check(program, *inputs)
    except AssertionError as e:
        raise AssertionError(f"{e}\n(outputs in order: {list(accepted)})") from None
    assert ember.metrics.fallback_calls == 0, f"lowered ops went to aten: {dict(ember.metrics.fallback_ops)}"
    for name, got, expected in zip(accepted, actual, program(*inputs)):
        if name in exact and expected.is_floating_point():
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")
        if signed_zeros and expected.is_floating_point() and name not in ZERO_SIGN_VARIES:
            zeros = expected == 0
            assert torch.equal(got[zeros].signbit(), expected[zeros].signbit()), f"{name}: sign of zero differs"


def dtype_id(dtype) -> str:
    return "-".join(dtype_id(d) for d in dtype) if isinstance(dtype, tuple) else str(dtype).removeprefix("torch.")


# ---- unary ops -----------------------------------------------------------------------------

UNARY: dict[str, tuple[Callable, str]] = {  # name: (fn, input domain)
    "exp": (torch.exp, "real"),
    "exp2": (torch.exp2, "real"),
    "expm1": (torch.expm1, "real"),
    "sin": (torch.sin, "real"),
    "cos": (torch.cos, "real"),
    "tan": (torch.tan, "real"),
    "atan": (torch.atan, "real"),
    "sinh": (torch.sinh, "real"),
    "cosh": (torch.cosh, "real"),
    "tanh": (torch.tanh, "real"),
    "sigmoid": (torch.sigmoid, "real"),
    "erf": (torch.erf, "real"),
    "relu": (torch.relu, "real"),
    "gelu": (F.gelu, "real"),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), "real"),
    "silu": (F.silu, "real"),
    "softplus": (F.softplus, "real"),
    "softplus_beta": (lambda x: F.softplus(x, beta=2.0, threshold=3.0), "real"),
    "hardtanh": (F.hardtanh, "real"),
    "hardtanh_range": (lambda x: F.hardtanh(x, -0.5, 2.0), "real"),
    "neg": (torch.neg, "real"),
    "abs": (torch.abs, "real"),
    "sign": (torch.sign, "real"),
    "floor": (torch.floor, "real"),
    "ceil": (torch.ceil, "real"),
    "round": (torch.round, "real"),
    "trunc": (torch.trunc, "real"),
    "reciprocal": (torch.reciprocal, "nonzero"),
    "isnan": (torch.isnan, "real"),
    "isinf": (torch.isinf, "real"),
    "logical_not": (torch.logical_not, "real"),
    "bitwise_not": (torch.bitwise_not, "real"),
    "clamp": (lambda x: x.clamp(-1.5, 2), "real"),
    "clamp_int": (lambda x: x.clamp(-3, 4), "real"),
    "clamp_only_min": (lambda x: x.clamp(min=-0.5), "real"),
    "clamp_only_max": (lambda x: x.clamp(max=1), "real"),
    "clamp_min": (lambda x: torch.clamp_min(x, 0.25), "real"),
    "clamp_max": (lambda x: torch.clamp_max(x, 2), "real"),
    "pow_2": (lambda x: x**2, "real"),
    "pow_3": (lambda x: x**3, "real"),
    "pow_0": (lambda x: x**0, "real"),
    "pow_1": (lambda x: x**1, "real"),
    "pow_float_2": (lambda x: x**2.0, "real"),
    "pow_neg_1": (lambda x: x**-1, "nonzero"),
    "pow_neg_2": (lambda x: x**-2.0, "nonzero"),
    "scalar_pow": (lambda x: 2**x, "real"),
    "float_scalar_pow": (lambda x: 0.5**x, "real"),
    "log": (torch.log, "positive"),
    "log2": (torch.log2, "positive"),
    "log10": (torch.log10, "positive"),
    "log1p": (torch.log1p, "positive"),
    "sqrt": (torch.sqrt, "positive"),
    "rsqrt": (torch.rsqrt, "positive"),
    "pow_half": (lambda x: x**0.5, "positive"),
    "pow_1_5": (lambda x: x**1.5, "positive"),
    "asin": (torch.asin, "unit"),
    "acos": (torch.acos, "unit"),
}
UNARY_DOMAINS = sorted({domain for _, domain in UNARY.values()})
LAYOUT_CASES = [("transposed", f32), ("transposed", i64), ("sliced", f64), ("sliced", i32), ("0d", f32), ("0d", i64),
                ("empty", f32), ("empty", i32), ("large", f32)]  # fmt: skip
UNARY_CASES = [("contiguous", d) for d in DTYPES] + [("special", f32), ("special", f64)] + LAYOUT_CASES


@pytest.mark.parametrize("domain", UNARY_DOMAINS)
@pytest.mark.parametrize("variant,dtype", UNARY_CASES, ids=[f"{v}-{dtype_id(d)}" for v, d in UNARY_CASES])
def test_unary(domain, variant, dtype):
    ops = {name: fn for name, (fn, d) in UNARY.items() if d == domain}
    check_ops(ops, laid_out(variant, dtype, domain), signed_zeros=variant == "special", exact=EXACT)


# ---- binary ops ----------------------------------------------------------------------------

BINARY: dict[str, tuple[Callable, str, str]] = {  # name: (fn, domain of a, domain of b)
    "add": (torch.add, "real", "real"),
    "sub": (torch.sub, "real", "real"),
    "add_alpha": (lambda a, b: torch.add(a, b, alpha=2), "real", "real"),
    "sub_alpha": (lambda a, b: torch.sub(a, b, alpha=3), "real", "real"),
    "add_float_alpha": (lambda a, b: torch.add(a, b, alpha=0.5), "real", "real"),
    "mul": (torch.mul, "real", "real"),
    "atan2": (torch.atan2, "real", "real"),
    "maximum": (torch.maximum, "real", "real"),
    "minimum": (torch.minimum, "real", "real"),
    "eq": (torch.eq, "real", "real"),
    "ne": (torch.ne, "real", "real"),
    "lt": (torch.lt, "real", "real"),
    "le": (torch.le, "real", "real"),
    "gt": (torch.gt, "real", "real"),
    "ge": (torch.ge, "real", "real"),
    "logical_and": (torch.logical_and, "real", "real"),
    "logical_or": (torch.logical_or, "real", "real"),
    "logical_xor": (torch.logical_xor, "real", "real"),
    "bitwise_and": (torch.bitwise_and, "real", "real"),
    "bitwise_or": (torch.bitwise_or, "real", "real"),
    "bitwise_xor": (torch.bitwise_xor, "real", "real"),
    "div": (torch.div, "real", "nonzero"),
    "div_floor": (lambda a, b: torch.div(a, b, rounding_mode="floor"), "real", "nonzero"),
    "div_trunc": (lambda a, b: torch.div(a, b, rounding_mode="trunc"), "real", "nonzero"),
    "floor_divide": (torch.floor_divide, "real", "nonzero"),
    "remainder": (torch.remainder, "real", "nonzero"),
    "fmod": (torch.fmod, "real", "nonzero"),
    "pow": (torch.pow, "base", "exponent"),
    "left_shift": (torch.bitwise_left_shift, "real", "shift"),
    "right_shift": (torch.bitwise_right_shift, "real", "shift"),
    "left_shift_operator": (lambda a, b: a << b, "real", "shift"),
    "right_shift_operator": (lambda a, b: a >> b, "real", "shift"),
}
BINARY_DOMAINS = sorted({(da, db) for _, da, db in BINARY.values()})
BINARY_CASES = (
    [("same", (d, d)) for d in DTYPES]
    + [("promote", pair) for pair in ((i32, f32), (b8, i64), (f32, f64), (i64, i32), (b8, f32), (f64, i32))]
    + [("special", (f32, f32)), ("special", (f64, f64)), ("special", (f32, f64))]
    + [("int_signs", (i32, i32)), ("int_signs", (i64, i64))]
    + [("outer", (f32, f32)), ("row", (f32, f32)), ("row", (i32, i32)), ("nd_0d", (f32, f64)), ("nd_0d", (i64, f32))]
    + [("0d_nd", (i32, i64)), ("noncontiguous", (f32, f32)), ("noncontiguous", (i64, i64)), ("0d", (f32, f32))]
    + [("0d", (i64, i64)), ("empty", (f32, f32)), ("empty", (i32, i32)), ("outer", (i64, i64))]
    + [("large", (f32, f32)), ("large", (i64, i64)), ("outer_3d", (f32, f32))]
)


def binary_inputs(case: str, dtypes: tuple, domains: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    (ta, tb), (da, db) = dtypes, domains
    shapes = {"same": ((3, 5), (3, 5)), "promote": ((3, 5), (3, 5)), "outer": ((4, 1), (1, 5)),
              "row": ((5,), (3, 5)), "nd_0d": ((3, 5), ()), "0d_nd": ((), (3, 5)), "0d": ((), ()),
              "empty": ((0, 5), (5,)), "large": ((1, 300), (200, 300)), "outer_3d": ((2, 1, 4), (3, 1))}  # fmt: skip
    if case in shapes:
        sa, sb = shapes[case]
        return draw(sa, ta, da, seed=1), draw(sb, tb, db, seed=2)
    if case == "noncontiguous":
        return laid_out("transposed", ta, da, seed=1), laid_out("sliced", tb, db, seed=2)
    if case == "special":  # every pair of special values
        return specials(ta, (15, 1)), specials(tb, (1, 15))
    if case == "int_signs":  # every pair of integer patterns
        a, b = INT_PATTERNS[da], INT_PATTERNS[db]
        return torch.tensor(a, dtype=ta).reshape(-1, 1), torch.tensor(b, dtype=tb).reshape(1, -1)
    raise ValueError(case)


@pytest.mark.parametrize("domains", BINARY_DOMAINS, ids=["-".join(d) for d in BINARY_DOMAINS])
@pytest.mark.parametrize("case,dtypes", BINARY_CASES, ids=[f"{c}-{dtype_id(d)}" for c, d in BINARY_CASES])
def test_binary(domains, case, dtypes):
    ops = {name: fn for name, (fn, da, db) in BINARY.items() if (da, db) == domains}
    check_ops(ops, *binary_inputs(case, dtypes, domains), signed_zeros=case == "special", exact=EXACT)


# ---- where and clamp with tensor bounds ------------------------------------------------------


def _cond(shape, seed=3):
    return draw(shape, b8, "real", seed)


WHERE_CASES: dict[str, Callable[[], tuple]] = {  # name: inputs of torch.where(cond, a, b)
    "same": lambda: (_cond((3, 5)), draw((3, 5), f32, "real", 1), draw((3, 5), f32, "real", 2)),
    "int": lambda: (_cond((3, 5)), draw((3, 5), i64, "real", 1), draw((3, 5), i64, "real", 2)),
    "bool": lambda: (_cond((3, 5)), draw((3, 5), b8, "real", 1), draw((3, 5), b8, "real", 2)),
    "promote_int_float": lambda: (_cond((3, 5)), draw((3, 5), i32, "real", 1), draw((3, 5), f32, "real", 2)),
    "promote_bool_int": lambda: (_cond((3, 5)), draw((3, 5), b8, "real", 1), draw((3, 5), i64, "real", 2)),
    "promote_float": lambda: (_cond((3, 5)), draw((3, 5), f64, "real", 1), draw((3, 5), f32, "real", 2)),
    "broadcast": lambda: (_cond((3, 1)), draw((1, 5), f32, "real", 1), draw((), f32, "real", 2)),
    "noncontiguous": lambda: (
        laid_out("transposed", b8, "real", 3),
        laid_out("sliced", f32, "real", 1),
        laid_out("transposed", f32, "real", 2),
    ),  # fmt: skip
    "0d": lambda: (_cond(()), draw((), f32, "real", 1), draw((), f32, "real", 2)),
    "empty": lambda: (_cond((0, 5)), draw((0, 5), f32, "real", 1), draw((5,), f32, "real", 2)),
    "special": lambda: (_cond((3, 5)), specials(f32), specials(f32).flip(0)),
}


@pytest.mark.parametrize("case", WHERE_CASES)
def test_where(case):
    check_ops({"where": torch.where}, *WHERE_CASES[case](), signed_zeros=case == "special", exact=EXACT)


WHERE_SCALAR: dict[str, Callable] = {
    "float_other": lambda c, x: torch.where(c, x, 0.0),
    "int_self": lambda c, x: torch.where(c, 2, x),
    "both_scalars": lambda c, x: torch.where(c, 1.5, -2) + x,
    "from_comparison": lambda c, x: torch.where(x > 0, x, -1.5),
    "nan_other": lambda c, x: torch.where(c, x, nan),
}


@pytest.mark.parametrize("dtype", [f32, i64, b8], ids=dtype_id)
def test_where_with_scalars(dtype):
    check_ops(WHERE_SCALAR, _cond((3, 5)), draw((3, 5), dtype, "real", 1), exact=WHERE_SCALAR)


CLAMP: dict[str, Callable] = {
    "clamp": lambda x, lo, hi: torch.clamp(x, lo, hi),
    "only_min": lambda x, lo, hi: torch.clamp(x, min=lo),
    "only_max": lambda x, lo, hi: torch.clamp(x, max=hi),
    "clamp_min": lambda x, lo, hi: torch.clamp_min(x, lo),
    "clamp_max": lambda x, lo, hi: torch.clamp_max(x, hi),
}
CLAMP_CASES: dict[str, Callable[[], tuple]] = {  # name: (x, lo, hi); some lo > hi, where eager gives hi
    "float": lambda: (draw((3, 5), f32, "real", 1), draw((3, 5), f32, "real", 2) - 1, draw((3, 5), f32, "real", 3)),
    "int": lambda: (draw((3, 5), i32, "real", 1), draw((3, 5), i32, "real", 2), draw((3, 5), i32, "real", 3)),
    "int_float_bounds": lambda: (
        draw((3, 5), i64, "real", 1),
        draw((3, 5), f32, "real", 2),
        draw((3, 5), f32, "real", 3),
    ),  # fmt: skip
    "float64_bounds": lambda: (
        draw((3, 5), f32, "real", 1),
        draw((3, 5), f64, "real", 2),
        draw((3, 5), f64, "real", 3),
    ),  # fmt: skip
    "broadcast": lambda: (draw((3, 5), f32, "real", 1), draw((3, 1), f32, "real", 2), draw((5,), f32, "real", 3)),
    "noncontiguous": lambda: (
        laid_out("transposed", f32, "real", 1),
        laid_out("sliced", f32, "real", 2),
        draw((), f32, "real", 3),
    ),  # fmt: skip
    "0d": lambda: (draw((), f64, "real", 1), draw((), f64, "real", 2), draw((), f64, "real", 3)),
    "empty": lambda: (draw((0, 5), f32, "real", 1), draw((5,), f32, "real", 2), draw((1, 5), f32, "real", 3)),
    "special": lambda: (specials(f32), specials(f32).flip(0), specials(f32).flip(1)),
}


@pytest.mark.parametrize("case", CLAMP_CASES)
def test_clamp_with_tensor_bounds(case):
    check_ops(CLAMP, *CLAMP_CASES[case](), signed_zeros=case == "special", exact=CLAMP)


@pytest.mark.parametrize("dtype", [f32, f64], ids=dtype_id)
def test_floor_division_ties_round_like_eager(dtype):
    """Quotients of about 2**(mantissa bits - 1): the float quotient is an integer plus exactly 0.5,
    which ATen's div_floor rounds down."""
    gen = torch.Generator().manual_seed(0)
    mantissa = 24 if dtype is f32 else 53
    b = (torch.rand(64, generator=gen, dtype=f64) * 0.15 + 0.05).to(dtype)
    q = (torch.rand(64, generator=gen, dtype=f64) + 1) * 2.0 ** (mantissa - 2)
    ops = {"div_floor": BINARY["div_floor"][0], "floor_divide": torch.floor_divide, "remainder": torch.remainder}
    check_ops(ops, (q * b.double()).to(dtype), b, exact=ops)


@pytest.mark.parametrize("dtype", [f32, f64], ids=dtype_id)
def test_floor_division_matches_eager_on_every_pair_of_hard_values(dtype):
    """Every pair of signed zeros, infinities, NaN, subnormals, the largest finite values, exact
    and inexact quotients (1 // 0.1 is 9) and quotients past 2**mantissa, bit for bit (the sign
    of a zero quotient included), plus random values of wide magnitudes (Note: float floor division)."""
    info = torch.finfo(dtype)
    hard = [0.0, -0.0, inf, -inf, nan, 1.0, -1.0, 0.1, -0.1, 3.0, -3.0, 7.5, -7.5, 0.3, 1e-30, -1e-30,
            info.tiny, -info.tiny, info.tiny / 4, -info.tiny / 4, info.max, -info.max, 2.0**60, -(2.0**60),
            1e10 + 1, 5.0, -5.0, 2.5, 0.5, -0.5]  # fmt: skip
    values = torch.tensor(hard, dtype=dtype)
    a, b = values.repeat_interleave(len(hard)), values.repeat(len(hard))
    gen = torch.Generator().manual_seed(0)

    def magnitudes():
        return torch.randn(4096, generator=gen, dtype=f64) * 10.0 ** torch.randint(-8, 9, (4096,), generator=gen)

    a, b = torch.cat([a, magnitudes().to(dtype)]), torch.cat([b, magnitudes().to(dtype)])
    ember.metrics.reset()
    for fn in (BINARY["div_floor"][0], torch.floor_divide):
        got, want = compile_fn(fn)(a, b), fn(a, b)  # near overflow a float64 reference differs: eager only
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(got[want == 0].signbit(), want[want == 0].signbit()), "sign of a zero quotient"
    assert ember.metrics.fallback_calls == 0, dict(ember.metrics.fallback_ops)


def test_multiply_add_rounds_twice():
    """a * b + c rounds the product and then the sum, as eager does: never fused into one FMA."""
    ops = {"mul_add": lambda a, b, c: a * b + c, "mul_sub": lambda a, b, c: c - a * b}
    check_ops(ops, *(draw((64,), dtype, "real", seed) for dtype, seed in ((f32, 1), (f32, 2), (f32, 3))), exact=ops)


WRAPPING: dict[str, Callable] = {  # signed overflow wraps around in eager (two's complement)
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "neg": lambda a, b: -a,
    "abs": lambda a, b: a.abs(),
    "square": lambda a, b: a * a,
    "cube": lambda a, b: a**3,
    "add_one_is_larger": lambda a, b: (a + 1) > a,
    "linear_congruential": lambda a, b: a * 1103515245 + 12345,
}


@pytest.mark.parametrize("dtype", [i32, i64], ids=dtype_id)
def test_integer_overflow_wraps_like_eager(dtype):
    low, high = torch.iinfo(dtype).min, torch.iinfo(dtype).max
    a = torch.tensor([low, high, low + 1, high - 1, 0, -1, 1, 2**20, -(2**20), high // 2 + 1], dtype=dtype)
    b = torch.tensor([high, 1, -2, 2, low, low, high, 2**20, 3, high // 2 + 2], dtype=dtype)
    check_ops(WRAPPING, a, b)


# ---- python scalars mixed into expressions ---------------------------------------------------

WITH_SCALARS: dict[str, Callable] = {
    "add_int": lambda x: x + 1,
    "add_float": lambda x: x + 2.5,
    "add_bool": lambda x: x + True,
    "radd_mul": lambda x: 1 - x * 2,
    "mul_float": lambda x: x * 0.5,
    "rsub_float": lambda x: 1.5 - x,
    "div_int": lambda x: x / 2,
    "rdiv": lambda x: 3 / (x * x + 1),
    "floordiv_int": lambda x: x // 2,
    "floordiv_negative": lambda x: x // -3,
    "floordiv_float": lambda x: x // 0.75,
    "mod_int": lambda x: x % 3,
    "mod_negative": lambda x: x % -4,
    "mod_float": lambda x: x % 1.25,
    "compare_float": lambda x: x > 0.5,
    "compare_int": lambda x: x == 1,
    "chain": lambda x: (x * 3 - 1) / 4 + 0.25,
    "add_scalar_alpha": lambda x: torch.add(x, 2, alpha=3),
    "sub_scalar_float_alpha": lambda x: torch.sub(x, 1.5, alpha=2),
    "rsub_int": lambda x: 5 - x,
    "rmod": lambda x: 7 % (x * x + 1),
    "rfloordiv": lambda x: -7 // (x * x + 1),
    "and_int": lambda x: x & 3,
    "or_int": lambda x: x | 1,
    "xor_bool": lambda x: x ^ True,
    "shift_left": lambda x: x << 2,
    "shift_right": lambda x: x >> 1,
    "add_inf": lambda x: x + inf,
    "mul_nan": lambda x: x * nan,
    "less_than_nan": lambda x: x < nan,
    "not_equal_nan": lambda x: x != nan,
    "div_by_zero": lambda x: x / 0,
    "floordiv_by_zero": lambda x: x // 0.0,
    "mod_by_zero": lambda x: x % 0.0,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_python_scalars(dtype):
    check_ops(WITH_SCALARS, draw((3, 5), dtype, "real"), exact=WITH_SCALARS)


# ---- casts -----------------------------------------------------------------------------------

CAST_VALUES = {  # source dtype -> values (3, 5) that every target dtype represents without UB
    "float_to_float": (nan, inf, -inf, -0.0, 0.0, 0.5, -0.5, 1.5, -2.5, 2.7, -3.9, 1e-3, 1e30, 1e-30, -1.0),
    "float_to_int": (0.0, -0.0, 0.5, -0.5, 1.5, -2.5, 2.7, -3.9, 1e-3, 100.25, 7.0, -1.0, -1e5, 65536.5, 3.0),
    "int32": (-(2**31), 2**31 - 1, 0, -1, 1, 5, -7, 2**24 + 1, 100, -100, 3, 2, 16777217, -16777217, 42),
    "int64": (-(2**31) - 1, 2**33 + 7, 0, -1, 1, 5, -7, 2**40 + 5, 2**53 + 1, -100, 3, 2, 2**31, -(2**63), 42),
}
CAST_PAIRS = [(s, d) for s in DTYPES for d in DTYPES if s != d]


def cast_input(source: torch.dtype, target: torch.dtype) -> torch.Tensor:
    if source is b8:
        return draw((3, 5), b8, "real")
    if source.is_floating_point:
        key = "float_to_int" if target in (i32, i64) else "float_to_float"
        return torch.tensor(CAST_VALUES[key], dtype=torch.float64).to(source).reshape(3, 5)
    return torch.tensor(CAST_VALUES[dtype_id(source)], dtype=torch.int64).to(source).reshape(3, 5)


@pytest.mark.parametrize("source,target", CAST_PAIRS, ids=[f"{dtype_id(s)}-to-{dtype_id(d)}" for s, d in CAST_PAIRS])
def test_cast(source, target):
    x = cast_input(source, target)
    casts = {"to": lambda x: x.to(target), "to_of_view": lambda x: x.t().to(target)}
    check_ops(casts, x, signed_zeros=True, exact=casts)


def test_cast_in_expression():
    check_ops({"mixed": lambda x: x.to(i32) * 2 + x.to(f64) / 3, "bool_mask": lambda x: x * (x > 0).to(f32)},
              draw((3, 5), f32, "real"))  # fmt: skip


# ---- constants -------------------------------------------------------------------------------

CONSTANTS: dict[str, Callable[[torch.Tensor], object]] = {  # x = (3, 5) float32; made on x's device
    "full_float": lambda x: torch.full((3, 5), 2.5, device=x.device),
    "full_int": lambda x: torch.full((2, 3), 7, dtype=i32, device=x.device),
    "full_bool": lambda x: torch.full((4,), True, device=x.device),
    "full_nan": lambda x: torch.full((2, 2), nan, device=x.device) + x[:2, :2],
    "full_neg_inf": lambda x: torch.full((3, 5), -inf, dtype=f64, device=x.device),
    "full_0d": lambda x: torch.full((), -3.25, device=x.device) * x,
    "full_empty": lambda x: torch.full((0, 3), 1.0, device=x.device),
    "full_float_into_int": lambda x: torch.full((2,), -2.7, dtype=i64, device=x.device),
    "neg_of_negative": lambda x: -torch.full((3, 5), -0.5, device=x.device) + x,
    "neg_of_neg_inf": lambda x: torch.neg(torch.full((3, 5), -inf, device=x.device)),
    "neg_of_negative_int": lambda x: -torch.full((3, 5), -2, dtype=i32, device=x.device),
    "zeros": lambda x: torch.zeros(3, 5, device=x.device),
    "zeros_int": lambda x: torch.zeros(2, 4, dtype=i64, device=x.device),
    "ones": lambda x: torch.ones(5, device=x.device) + x,
    "ones_bool": lambda x: torch.ones(3, dtype=b8, device=x.device),
    "zeros_like": lambda x: torch.zeros_like(x),
    "ones_like_int": lambda x: torch.ones_like(x, dtype=i32),
    "full_like": lambda x: torch.full_like(x, 7),
    "arange_end": lambda x: torch.arange(6, device=x.device),
    "arange_start_end": lambda x: torch.arange(2, 11, device=x.device),
    "arange_step": lambda x: torch.arange(1, 12, 3, device=x.device),
    "arange_negative_step": lambda x: torch.arange(10, 0, -3, device=x.device),
    "arange_float_step": lambda x: torch.arange(0, 1, 0.1, device=x.device),
    "arange_float_start": lambda x: torch.arange(0.5, 3.0, 0.25, device=x.device),
    "arange_negative_float_step": lambda x: torch.arange(1.0, -1.0, -0.3, device=x.device),
    "arange_float64": lambda x: torch.arange(5, dtype=f64, device=x.device),
    "arange_int32": lambda x: torch.arange(-3, 4, 2, dtype=i32, device=x.device),
    "arange_empty": lambda x: torch.arange(4, 2, device=x.device),
    "arange_int_dtype_float_step": lambda x: torch.arange(0, 5, 1.5, dtype=i64, device=x.device),
    "arange_in_expression": lambda x: (
        x * torch.arange(5, device=x.device) + torch.arange(3, device=x.device).unsqueeze(1)
    ),
}
TENSOR_LITERALS: dict[str, Callable[[torch.Tensor], object]] = {  # graph constants (get_attr), not aten ops
    "tensor_scalar": lambda x: x + torch.tensor(2.5, device=x.device),
    "tensor_vector": lambda x: x * torch.tensor([1.0, -2.0, 3.0, 0.5, 0.0], device=x.device),
    "scalar_tensor_int": lambda x: x + torch.tensor(3, dtype=i64, device=x.device),
}


def test_constants():
    check_ops(CONSTANTS, draw((3, 5), f32, "real"), signed_zeros=True, exact=CONSTANTS)


def test_tensor_literals():
    check_ops(TENSOR_LITERALS, draw((3, 5), f32, "real"), exact=TENSOR_LITERALS)


# ---- views -----------------------------------------------------------------------------------

VIEWS: dict[str, tuple[Callable, tuple[int, ...]]] = {  # name: (view, input shape)
    "view": (lambda x: x.view(6, 4), (4, 6)),
    "view_infer": (lambda x: x.view(-1, 3), (4, 6)),
    "view_3d": (lambda x: x.view(2, 2, 6), (4, 6)),
    "view_flat": (lambda x: x.view(-1), (4, 6)),
    "view_of_transposed": (lambda x: x.t().view(6, 2, 2), (4, 6)),
    "view_of_slice": (lambda x: x[:, 1:5].view(4, 2, 2), (4, 6)),
    "reshape": (lambda x: x.reshape(3, 8), (4, 6)),
    "reshape_transposed": (lambda x: x.t().reshape(3, 8), (4, 6)),
    "reshape_sliced": (lambda x: x[:, ::2].reshape(-1), (4, 6)),
    "reshape_permuted_3d": (lambda x: x.permute(2, 0, 1).reshape(8, 3), (2, 3, 4)),
    "permute": (lambda x: x.permute(2, 0, 1), (2, 3, 4)),
    "permute_negative": (lambda x: x.permute(-1, 0, -2), (2, 3, 4)),
    "transpose": (lambda x: x.transpose(0, 2), (2, 3, 4)),
    "transpose_negative": (lambda x: x.transpose(-1, -3), (2, 3, 4)),
    "t": (lambda x: x.t(), (4, 6)),
    "t_1d": (lambda x: x.t(), (5,)),
    "t_0d": (lambda x: x.t(), ()),
    "expand": (lambda x: x.expand(4, 6), (4, 1)),
    "expand_keep": (lambda x: x.expand(-1, 5), (4, 1)),
    "expand_new_dims": (lambda x: x.expand(2, 5, 6), (1, 6)),
    "expand_0d": (lambda x: x.expand(3, 2), ()),
    "slice_step": (lambda x: x[::2, 1::3], (4, 6)),
    "slice_negative": (lambda x: x[-3:, -4:-1], (4, 6)),
    "slice_clamped": (lambda x: x[1:100, -100:2], (4, 6)),
    "slice_step_end": (lambda x: x[:, 1:5:3], (4, 6)),
    "slice_empty": (lambda x: x[3:1], (4, 6)),
    "select": (lambda x: x[1], (4, 6)),
    "select_negative": (lambda x: x[-1], (4, 6)),
    "select_dim1_negative": (lambda x: x[:, -2], (4, 6)),
    "select_3d": (lambda x: x[:, 1, -1], (2, 3, 4)),
    "select_to_0d": (lambda x: x[2], (5,)),
    "unsqueeze": (lambda x: x.unsqueeze(0), (4, 6)),
    "unsqueeze_negative": (lambda x: x.unsqueeze(-1), (4, 6)),
    "unsqueeze_middle": (lambda x: x.unsqueeze(1), (4, 6)),
    "unsqueeze_0d": (lambda x: x.unsqueeze(0), ()),
    "squeeze_dim": (lambda x: x.squeeze(1), (4, 1, 6)),
    "squeeze_all": (lambda x: x.squeeze(), (1, 4, 1, 6)),
    "squeeze_negative": (lambda x: x.squeeze(-2), (4, 1, 6)),
    "squeeze_dims": (lambda x: x.squeeze((0, 2)), (1, 4, 1, 6)),
    "squeeze_not_one": (lambda x: x.squeeze(0), (4, 6)),
    "flatten": (lambda x: x.flatten(), (2, 3, 4)),
    "flatten_from": (lambda x: x.flatten(1), (2, 3, 4)),
    "flatten_range": (lambda x: x.flatten(0, 1), (2, 3, 4)),
    "unflatten": (lambda x: x.unflatten(1, (2, 3)), (4, 6)),
    "unflatten_infer": (lambda x: x.unflatten(0, (-1, 2)), (4, 6)),
    "as_strided": (lambda x: x.as_strided((3, 3), (1, 2)), (4, 6)),
    "as_strided_offset": (lambda x: x.as_strided((2, 4), (6, 1), 3), (4, 6)),
    "as_strided_windows": (lambda x: x.as_strided((5, 3), (2, 1)), (4, 6)),
    "as_strided_broadcast": (lambda x: x.as_strided((3, 4), (0, 1)), (4, 6)),
    "chain": (lambda x: x.t()[::2].unsqueeze(0).expand(2, -1, -1), (4, 6)),
    "chain_reshape": (lambda x: x.permute(1, 2, 0)[1:, ::2].flatten(1).t()[-1], (2, 3, 4)),
    "chain_transposed_reshape": (lambda x: x.transpose(0, 1).reshape(3, 8).t().unflatten(0, (4, 2))[:, 1], (2, 3, 4)),
    "chain_expand_reshape": (lambda x: x.unsqueeze(1).expand(4, 3, 6)[:, 1:].reshape(8, 6)[::3], (4, 6)),
}
VIEW_BASES = ("contiguous", "transposed")


def view_input(shape: tuple[int, ...], base: str, dtype: torch.dtype = f32) -> torch.Tensor:
    """An input of `shape`: contiguous, or the transpose of a contiguous tensor (for 2+ dims)."""
    if base == "contiguous" or len(shape) < 2:
        return draw(shape, dtype, "real")
    return draw(shape[::-1], dtype, "real").permute(*reversed(range(len(shape))))


@pytest.mark.parametrize("base", VIEW_BASES)
@pytest.mark.parametrize("name", VIEWS)
def test_view(name, base):
    """The view itself (of an input: eager returns a view, ember too) and an op through it."""
    view, shape = VIEWS[name]
    if base != "contiguous" and (len(shape) < 2 or name.startswith("as_strided")):
        pytest.skip("as_strided reads storage: only a contiguous input is expressible; 1-d has one layout")
    ops = {"view": view, "computed_through_view": lambda x: view(x * 2) + 1}
    check_ops(ops, view_input(shape, base), exact=ops)


@pytest.mark.parametrize("dtype", [i64, b8], ids=dtype_id)
def test_view_chains_of_other_dtypes(dtype):
    ops = {name: view for name, (view, shape) in VIEWS.items() if name.startswith("chain") and shape == (4, 6)}
    check_ops({**ops, "through_op": lambda x: (x.t() & x.t()[:, :1])[1::2]}, draw((4, 6), dtype, "real"))


def test_as_strided_of_computed_value():
    ops = {"as_strided": lambda x: (x * 2).as_strided((3, 3), (1, 2), 1)}
    check_ops(ops, draw((4, 6), f32, "real"), exact=ops)


def test_as_strided_of_input_with_storage_offset():
    """The storage offset of as_strided is absolute: it may even start before the input's first element.
    int64, so that the float64 reference of `check` (a fresh copy, offset 0) is not involved."""
    x = torch.arange(30)[6:].view(4, 6)
    ops = {"default_offset": lambda x: x.as_strided((2, 3), (3, 1)), "later": lambda x: x.as_strided((2, 3), (1, 2), 9),
           "earlier": lambda x: x.as_strided((2, 3), (3, 1), 2) + 1}  # fmt: skip
    check_ops(ops, x)
