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
from torch.utils._pytree import tree_map

import ember
from tests.helpers import compile_fn, test_device, to_test_device

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


def zero_signs_of_either(got, want, fn, on_device, i: int):
    """`want` with the sign of each zero `got` has where eager on the test device gives that
    zero: CPU and CUDA eager disagree on some (relu(-0.0) is -0.0 on the CPU, 0.0 on CUDA)."""
    if test_device() == "cpu" or not got.is_floating_point():
        return want
    outputs = fn(*on_device)
    there = (outputs if isinstance(outputs, tuple) else (outputs,))[i].cpu()
    same_zero = (got == 0) & (want == 0) & (got.signbit() == there.signbit())
    return torch.where(same_zero, got, want)


def run(fn, *inputs, max_ulps: int = 0, reference: bool = True, eager_on_device: bool = False):
    """`fn` through ember (on the test device) against eager on the same inputs (on the CPU, or
    `eager_on_device`: where both call the same aten kernels, e.g. cuBLAS), with no fallback
    extern; 0 ulps means bit for bit. Returns ember's outputs (a tuple)."""
    ember.metrics.reset()
    on_device = tree_map(to_test_device, inputs)
    got = tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, compile_fn(fn)(*on_device))
    want = fn(*on_device) if eager_on_device else fn(*inputs)
    want = tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, want)
    precise = fn(*upcast(inputs)) if reference and max_ulps else None
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    precise = precise if precise is None or isinstance(precise, tuple) else (precise,)
    for i, (g, w) in enumerate(zip(got, want)):
        if max_ulps == 0:
            assert_same_bits(g, zero_signs_of_either(g, w, fn, on_device, i), f"output {i}")
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


# ---- type promotion -------------------------------------------------------------------------


def promotion_operands(dtype: torch.dtype) -> dict[str, object]:
    torch.manual_seed(0)
    x = torch.randn(4, 6) * 3
    return {
        "float32": x.flip(0), "float64": x.double().flip(1), "other 16-bit": x.to(f16 if dtype is bf16 else bf16),
        "int64": torch.randint(-5, 6, (4, 6)), "int32": torch.randint(-5, 6, (6,), dtype=torch.int32),
        "uint8": torch.randint(0, 9, (4, 6), dtype=torch.uint8), "bool": torch.rand(4, 6) > 0.5,
        "0-d float32": torch.tensor(0.3), "0-d float64": torch.tensor(-1.7, dtype=f64),
        "0-d other 16-bit": torch.tensor(0.3, dtype=f16 if dtype is bf16 else bf16),
        "0-d int64": torch.tensor(3), "python float": 0.3, "python int": 3, "python bool": True,
    }  # fmt: skip


def binary_ops(a, b):
    """Each op with the operands both ways round; eager decides the result dtype and rounding."""
    out, positive = [], a > 0
    for x, y in ((a, b), (b, a)):
        out += [x + y, x * y, x / y, x == y, x < y, torch.where(positive, x, y)]
        if not any(isinstance(v, bool) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool) for v in (x, y)):
            out.append(x - y)
    if isinstance(b, torch.Tensor):
        out += [torch.maximum(a, b), torch.atan2(a, b.to(a.dtype) if b.dtype == torch.bool else b)]
    return tuple(out)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("other", list(promotion_operands(bf16)))
def test_promotion_with_every_kind_of_operand(dtype, other):
    """Result dtypes as eager's, and the values bit for bit: an operand of another type is
    rounded to the common dtype first (bfloat16 + 0.3 adds bfloat16(0.3)), except the scalar
    second operand of mul and div, which eager's kernels read in float32."""
    torch.manual_seed(1)
    a = (torch.randn(4, 6) * 3).to(dtype)
    b = promotion_operands(dtype)[other]
    if isinstance(b, torch.Tensor):
        got = run(lambda a, b: binary_ops(a, b)[:-1], a, b)
        run(lambda a, b: binary_ops(a, b)[-1:], a, b, max_ulps=1)  # atan2: float32 libm
    else:
        got = run(lambda a: binary_ops(a, b), a)
    assert got[0].dtype == torch.result_type(a, b)


# ---- reductions and composites --------------------------------------------------------------


def reduction_inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(7, 12, 33) * 2
    with_nan, with_inf = base.clone(), base.clone()
    with_nan[2, 3, 1] = nan
    with_inf[1, :, 2] = inf
    inputs = {
        "contiguous": base, "transposed": torch.randn(33, 12, 7).permute(2, 1, 0),
        "sliced": torch.randn(7, 24, 33)[:, ::2], "broadcast": torch.randn(7, 1, 33).expand(7, 12, 33),
        "nan": with_nan, "inf": with_inf, "empty": torch.randn(0, 12, 33),
    }  # fmt: skip
    return {name: x.to(dtype) for name, x in inputs.items()}


def reductions(x):
    """Accumulated in float32 or wider, rounded once at the end, as eager."""
    out = (x.sum(1), x.sum((0, 2), keepdim=True), x.mean(-1), x.var(1), x.std(-1, correction=0), x.amax(1), x.amin(-1))
    out += (x.argmax(1), x.softmax(-1), x.log_softmax(1), F.layer_norm(x, (33,)), x.logsumexp(-1), x.norm(dim=-1))
    out += (x.prod(1),)  # eager rounds every partial product of a bfloat16 prod: ember is closer to exact
    return out if x.numel() == 0 else out + (x.sum(), x.amax(), x.mean())


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("variant", ["contiguous", "transposed", "sliced", "broadcast", "nan", "inf", "empty"])
def test_reductions_and_normalizations(dtype, variant):
    run(reductions, reduction_inputs(dtype)[variant], max_ulps=1)


@pytest.mark.parametrize("dtype", LOW)
def test_reductions_of_a_scalar(dtype):
    x = torch.tensor(-2.5, dtype=dtype)
    run(lambda x: (x.sum(), x.mean(), x.amax(), x.softmax(-1), x.log_softmax(0), x.argmax(), x.prod()), x)


@pytest.mark.parametrize("dtype", LOW)
def test_linear_gelu_calls_the_matmul_and_fuses_the_rest(dtype):
    """mm is an extern (aten's BLAS, in the dtype as eager); bias and gelu are ember's kernels."""
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 4, 64, dtype=dtype), torch.randn(96, 64, dtype=dtype) / 8, torch.randn(96, dtype=dtype)
    run(lambda x, w, b: (F.gelu(F.linear(x, w, b)), F.gelu(F.linear(x, w), approximate="tanh")), x, w, b, max_ulps=1,
        eager_on_device=True)  # fmt: skip
    assert ember.metrics.extern_calls >= 2 and ember.metrics.kernels_generated >= 1


# ---- training -------------------------------------------------------------------------------


def relative_error(x: torch.Tensor, exact: torch.Tensor) -> float:
    return float((x.double() - exact).norm() / exact.norm())


@pytest.mark.parametrize("dtype", LOW)
def test_mlp_training_step_matches_eager(dtype):
    """Forward, cross-entropy and backward of an MLP in the dtype. The loss equals eager's bit for
    bit. Gradients are as eager's to an ulp of their largest element, and no farther from a
    float64 run of the same step than eager's are, give or take half an ulp (layer norm's weight
    and bias gradients sum over the batch: ember in double, eager's kernel in its own way)."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 64), torch.nn.SiLU(),
        torch.nn.Linear(64, 10),
    ).to(dtype)  # fmt: skip
    model = model.to(test_device())  # eager on the same device: the same matmuls (CPU BLAS or cuBLAS)
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    x, target = torch.randn(16, 32, dtype=dtype).to(test_device()), torch.randint(0, 10, (16,)).to(test_device())

    ember.metrics.reset()
    torch._dynamo.reset()
    loss = F.cross_entropy(torch.compile(model, backend="ember")(x), target)
    loss.backward()
    assert ember.metrics.graphs_compiled == 2 and ember.metrics.fallback_calls == 0
    eager_loss = F.cross_entropy(eager(x), target)
    eager_loss.backward()
    F.cross_entropy(exact(x.double()), target).backward()

    assert_same_bits(loss, eager_loss, "loss")
    eps = torch.finfo(dtype).eps
    for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), exact.parameters()):
        scale = float(q.grad.abs().max())
        torch.testing.assert_close(p.grad, q.grad, rtol=eps, atol=eps * scale, msg=lambda m, n=name: f"{n}: {m}")
        ember_error, eager_error = relative_error(p.grad, r.grad), relative_error(q.grad, r.grad)
        assert ember_error <= eager_error + eps / 2, f"{name}: {ember_error:.3g} from exact, eager {eager_error:.3g}"


# ---- the rewrite, without a device ----------------------------------------------------------


def test_low_precision_values_are_only_loaded_stored_selected_and_cast():
    """After pm_low_precision no ALU op or REDUCE computes on float16/bfloat16, and a rounding
    (CAST to bfloat16 and back) is kept, not folded away."""
    from ember.codegen.low_precision import pm_low_precision
    from ember.uop.dtypes import dtypes
    from ember.uop.ops import BufferArg, Ops, RangeKind, UOp
    from ember.uop.pattern import graph_rewrite

    def load(name, dtype):
        buffer = UOp(Ops.BUFFER, dtype, (), BufferArg(name, 8))
        index = UOp(Ops.INDEX, dtype, (buffer, UOp.range(8, 0)))
        return UOp(Ops.LOAD, dtype, (index,))

    a, b = load("a", dtypes.bfloat16), load("b", dtypes.float16)
    rounded = (a.cast(dtypes.float32) * 3.0).cast(dtypes.bfloat16)
    shifted = a + UOp.const(dtypes.bfloat16, 0.3)
    total = UOp(Ops.REDUCE, dtypes.bfloat16, (shifted, UOp.range(4, 1, RangeKind.REDUCE)), Ops.MAX)
    values = [rounded.cast(dtypes.float32) - 1.0, b.alu(Ops.MAX, b), a.lt(UOp.const(dtypes.bfloat16, 0.3)), total]
    sink = graph_rewrite(UOp(Ops.SINK, dtypes.void, tuple(values)), pm_low_precision)
    computing = {Ops.CAST, Ops.WHERE, Ops.LOAD, Ops.INDEX, Ops.BUFFER, Ops.CONST, Ops.SINK}
    low = (dtypes.float16, dtypes.bfloat16)
    for u in sink.toposort:
        if u.op not in computing:
            assert u.dtype not in low and all(s.dtype not in low for s in u.src), u.op
    assert rounded.cast(dtypes.float32) in sink.toposort, "a rounding to bfloat16 was folded away"
    assert UOp.const(dtypes.float32, 0.30078125) in sink.toposort, "the constant is bfloat16(0.3), widened"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_signbit_of_a_vectorized_16_bit_loop(dtype):
    # gcc 12 crashed vectorizing __builtin_signbit of a converted float (20 lanes exactly)
    x = torch.randn(20, 20).to(dtype)
    x[0, :3] = torch.tensor([-0.0, float("nan"), -float("inf")]).to(dtype)
    assert torch.equal(compile_fn(torch.signbit)(to_test_device(x)).cpu(), torch.signbit(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scatter_and_scans_of_16_bit_floats_call_aten(dtype):
    # their kernels work on the storage type itself: aten does them, and says so in the metrics
    torch.manual_seed(0)
    x, src = torch.randn(4, 5).to(dtype), torch.randn(4, 5).to(dtype)
    index = torch.tensor([[0, 1, 2, 0, 1], [3, 2, 1, 0, 0], [1, 1, 1, 1, 1], [2, 3, 0, 1, 2]])
    f = lambda x, i, s: (x.scatter_add(0, i, s), x.cumsum(1), x.cummax(0).values)
    inputs = tuple(map(to_test_device, (x, index, src)))
    # aten's accumulation order may differ: on CUDA scatter_add's atomics add in any order
    tolerance = {} if test_device() == "cpu" else {"atol": 2e-3, "rtol": 1e-2}
    for got, want in zip(compile_fn(f)(*inputs), f(*inputs)):  # the same aten kernels on the same device
        torch.testing.assert_close(got.cpu(), want.cpu(), **tolerance)
    assert ember.metrics.fallback_calls >= 3
    # index_add is ember's own: it adds a row's sources in float and rounds once, where eager's
    # CPU kernel rounds after each add; so it is held to the float64 result, within a rounding
    for seed in range(8):
        torch.manual_seed(seed)
        x, src = torch.randn(4, 5).to(dtype), torch.randn(4, 5).to(dtype)
        got = compile_fn(lambda x, i, s: x.index_add(0, i, s))(*map(to_test_device, (x, index[0, :4], src[:4])))
        want = x.double().index_add(0, index[0, :4], src[:4].double())
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got.cpu().double(), want, rtol=eps, atol=eps)
