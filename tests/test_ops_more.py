"""The rest of the elementwise surface (libm's functions, copysign, fmax, special functions,
frexp, ...), views (diagonal, unfold, *_copy) and pooling, against eager, with no fallback extern.

libm's functions are compared with eager in the same dtype: eager vectorizes some of them (erfc
through Sleef), so they agree to a few ulp, not bit for bit; float64 is checked as tightly as
float32 allows. Special functions past libm's are aten extern kernels by design (Note: special
functions, lower/math_functions.py): those tests check the extern calls' plumbing (dtypes,
layouts, 0-d, empty, several outputs) and that the pointwise work around them still fuses.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.lower.math_functions import EXTERN_SPECIAL_FUNCTIONS
from ember.lower.registry import lookup
from tests.helpers import check, compile_fn, to_test_device

f32, f64, i64 = torch.float32, torch.float64, torch.int64
nan, inf = math.nan, math.inf
SPECIALS = (nan, inf, -inf, -0.0, 0.0, 0.5, -0.5, 1.5, -2.5, 1.0, -1.0, 3.0, 2**-10, 0.7, -7.25, 12.0)


def variants(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same values contiguous, transposed, strided, as a 0-d tensor and empty."""
    grid = values.reshape(4, 4)
    return {
        "contiguous": grid.contiguous(),
        "transposed": grid.t(),
        "strided": values.repeat(2)[::2].reshape(4, 4),
        "0-d": values[5].clone(),
        "empty": values[:0].reshape(0, 4),
    }


def sample(domain: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == i64:
        return torch.randint(-5 if domain == "real" else 0, 6, (16,), generator=g)
    if domain == "specials":
        return torch.tensor(SPECIALS, dtype=dtype)
    x = torch.randn(16, generator=g, dtype=torch.float64) * 3
    x = {"real": x, "positive": x.abs() + 0.05, "unit": torch.tanh(x) * 0.999, "above1": x.abs() + 1.0,
         "prob": torch.sigmoid(x)}[domain]  # fmt: skip
    return x.to(dtype)


def assert_matches_eager(fn, *inputs, rtol=None, atol=None):
    ember.metrics.reset()
    got = compile_fn(fn)(*map(to_test_device, inputs))
    got = tuple(g.cpu() for g in got) if isinstance(got, tuple) else got.cpu()
    want = fn(*inputs)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        if g.is_floating_point():
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
        else:
            assert torch.equal(g, w), f"ember {g}\neager {w}"
    assert ember.metrics.fallback_calls == 0, dict(ember.metrics.fallback_ops)


def test_special_functions_are_externs_with_the_pointwise_work_fused_around_them():
    """No lowering, on any backend: each call runs the aten op; the ops before and after fuse."""
    assert all(lookup(packet) is None for packet in EXTERN_SPECIAL_FUNCTIONS)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    for special in (torch.digamma, torch.erfinv, torch.special.i0e, torch.special.bessel_j0):
        fn = lambda a, b, special=special: special(torch.tanh(a * 0.5) * 0.9 + 0.01).exp() * b + a
        assert_matches_eager(fn, x, y, rtol=1e-4, atol=1e-5)  # (exp of large values: CUDA's exp differs by 1e-5)
        assert ember.metrics.extern_calls == 1 and ember.metrics.kernels_generated <= 2, special


UNARY = {  # name: (function, domain)
    "acosh": (torch.acosh, "above1"), "asinh": (torch.asinh, "real"), "atanh": (torch.atanh, "unit"),
    "erfc": (torch.erfc, "real"), "lgamma": (torch.lgamma, "real"), "digamma": (torch.digamma, "real"),
    "erfinv": (torch.erfinv, "unit"), "i0": (torch.i0, "real"), "i0e": (torch.special.i0e, "real"),
    "i1": (torch.special.i1, "real"), "i1e": (torch.special.i1e, "real"), "ndtri": (torch.special.ndtri, "prob"),
    "erfcx": (torch.special.erfcx, "real"), "log_ndtr": (torch.special.log_ndtr, "real"),
    "airy_ai": (torch.special.airy_ai, "real"), "bessel_j0": (torch.special.bessel_j0, "real"),
    "bessel_j1": (torch.special.bessel_j1, "real"), "bessel_y0": (torch.special.bessel_y0, "positive"),
    "bessel_y1": (torch.special.bessel_y1, "positive"),
    "modified_bessel_i0": (torch.special.modified_bessel_i0, "real"),
    "modified_bessel_i1": (torch.special.modified_bessel_i1, "real"),
    "modified_bessel_k0": (torch.special.modified_bessel_k0, "positive"),
    "modified_bessel_k1": (torch.special.modified_bessel_k1, "positive"),
    "scaled_modified_bessel_k0": (torch.special.scaled_modified_bessel_k0, "positive"),
    "scaled_modified_bessel_k1": (torch.special.scaled_modified_bessel_k1, "positive"),
    "spherical_bessel_j0": (torch.special.spherical_bessel_j0, "real"),
    "polygamma0": (lambda x: torch.polygamma(0, x), "real"), "polygamma1": (lambda x: torch.polygamma(1, x), "real"),
    "polygamma3": (lambda x: torch.polygamma(3, x), "positive"), "mvlgamma": (lambda x: torch.mvlgamma(x, 3), "above1"),
    "signbit": (torch.signbit, "real"), "frexp": (torch.frexp, "real"),
    "round2": (lambda x: torch.round(x, decimals=2), "real"),
    "round-1": (lambda x: torch.round(x * 50, decimals=-1), "real"),
    "angle": (torch.angle, "real"),
    "elu": (F.elu, "real"), "selu": (F.selu, "real"), "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), "real"),
}  # fmt: skip
INT_INPUTS = {"angle", "acosh", "asinh", "erfc", "lgamma", "digamma", "i0", "i0e", "i1", "bessel_j0", "signbit"}
FLOAT_ONLY_SPECIALS = {"frexp"}  # frexp rejects integers in eager
TOLERANCE = {f32: (2e-5, 2e-5), f64: (1e-11, 1e-11)}


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("dtype", [f32, f64])
def test_unary_special(name, dtype):
    # Layouts reach every unary op through the same lowering (tested at length in test_ops.py),
    # so float64 runs one layout.
    fn, domain = UNARY[name]
    rtol, atol = TOLERANCE[dtype]
    cases = variants(sample(domain, dtype))
    for layout in ("contiguous", "transposed", "0-d") if dtype == f32 else ("contiguous",):
        assert_matches_eager(fn, cases[layout], rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", sorted(set(UNARY) - {"mvlgamma"}))
def test_unary_special_values(name):
    """NaN, ±inf, ±0.0, poles and ties, in float32."""
    fn, _ = UNARY[name]
    x = torch.tensor(SPECIALS, dtype=f32).reshape(4, 4)
    assert_matches_eager(fn, x, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", sorted(INT_INPUTS))
def test_unary_special_integer_input(name):
    assert_matches_eager(UNARY[name][0], sample("real", i64).reshape(4, 4), rtol=2e-5, atol=2e-5)


BINARY = {  # name: (function, domain of a, domain of b)
    "copysign": (torch.copysign, "real", "real"), "nextafter": (torch.nextafter, "real", "real"),
    "hypot": (torch.hypot, "real", "real"), "fmax": (torch.fmax, "specials", "real"),
    "fmin": (torch.fmin, "specials", "real"), "zeta": (torch.special.zeta, "above1", "positive"),
    "igamma": (torch.igamma, "positive", "positive"), "igammac": (torch.igammac, "positive", "positive"),
    "ldexp": (lambda a, b: torch.ldexp(a, b.to(i64)), "real", "real"),
    "chebyshev_t": (torch.special.chebyshev_polynomial_t, "unit", "n"),
    "chebyshev_u": (torch.special.chebyshev_polynomial_u, "unit", "n"),
    "chebyshev_v": (torch.special.chebyshev_polynomial_v, "unit", "n"),
    "chebyshev_w": (torch.special.chebyshev_polynomial_w, "unit", "n"),
    "shifted_chebyshev_t": (torch.special.shifted_chebyshev_polynomial_t, "prob", "n"),
    "shifted_chebyshev_u": (torch.special.shifted_chebyshev_polynomial_u, "prob", "n"),
    "shifted_chebyshev_v": (torch.special.shifted_chebyshev_polynomial_v, "prob", "n"),
    "shifted_chebyshev_w": (torch.special.shifted_chebyshev_polynomial_w, "prob", "n"),
    "hermite_h": (torch.special.hermite_polynomial_h, "real", "n"),
    "hermite_he": (torch.special.hermite_polynomial_he, "real", "n"),
    "laguerre_l": (torch.special.laguerre_polynomial_l, "real", "n"),
    "legendre_p": (torch.special.legendre_polynomial_p, "unit", "n"),
}  # fmt: skip


def binary_operand(domain: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    if domain == "n":  # polynomial degrees 0..7 (and a negative one, which gives 0)
        return torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, -1, 2, 3, 4, 5, 6, 7, 1], dtype=dtype)
    return sample(domain, dtype, seed)


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("dtype", [f32, f64])
def test_binary_special(name, dtype):
    fn, domain_a, domain_b = BINARY[name]
    rtol, atol = TOLERANCE[dtype]
    a, b = binary_operand(domain_a, dtype, 1).reshape(4, 4), binary_operand(domain_b, dtype, 2).reshape(4, 4)
    assert_matches_eager(fn, a, b, rtol=rtol, atol=atol)
    assert_matches_eager(fn, a.t(), b, rtol=rtol, atol=atol)  # non-contiguous
    assert_matches_eager(fn, a, b[:1], rtol=rtol, atol=atol)  # broadcast
    assert_matches_eager(fn, a[:0], b[:0], rtol=rtol, atol=atol)  # empty


def test_binary_special_values():
    a = torch.tensor(SPECIALS).reshape(4, 4)
    for fn in (torch.copysign, torch.nextafter, torch.hypot, torch.fmax, torch.fmin):
        assert_matches_eager(fn, a, a.flip(0))
        assert_matches_eager(fn, a, a.t())


def test_integer_binary():
    a, b = sample("real", i64, 1).reshape(4, 4), sample("real", i64, 2).reshape(4, 4)
    for fn in (torch.fmax, torch.fmin, torch.copysign, torch.special.zeta):
        assert_matches_eager(fn, a, b, rtol=2e-5, atol=2e-5)
    assert_matches_eager(lambda x: torch.copysign(x, -2.0), a)  # a Python scalar operand


def test_decomposed_composites():
    """addmv, grid_sample and batch norm with update come from torch's decompositions."""
    m, v, bias = torch.randn(5, 7), torch.randn(7), torch.randn(5)
    assert_matches_eager(lambda a, b, c: torch.addmv(c, a, b, beta=0.5, alpha=2.0), m, v, bias, rtol=1e-5, atol=1e-5)
    image, grid = torch.randn(2, 3, 6, 5), torch.rand(2, 4, 3, 2) * 2.2 - 1.1
    for mode, padding in [("bilinear", "zeros"), ("nearest", "border"), ("bilinear", "reflection")]:
        assert_matches_eager(lambda a, g: F.grid_sample(a, g, mode, padding, align_corners=False), image, grid,
                             rtol=1e-5, atol=1e-5)  # fmt: skip


def test_round_decimals_of_integers_raises_as_eager():
    with pytest.raises(NotImplementedError, match="round"):
        compile_fn(lambda x: torch.round(x, decimals=2))(torch.tensor([1, 2]))


def test_signbit_of_integers_and_bools():
    x = torch.tensor([-3, 0, 5, -1])
    assert_matches_eager(torch.signbit, x)
    assert_matches_eager(torch.signbit, x > 0)


def test_frexp_special_values():
    x = torch.tensor([0.0, -0.0, 1.0, -3.5, 1e-40, 3e38, inf, -inf, nan, 0.75, 1024.0, -1e-3])
    ember.metrics.reset()
    mantissa, exponent = (t.cpu() for t in compile_fn(torch.frexp)(to_test_device(x)))
    want_mantissa, want_exponent = torch.frexp(x)
    torch.testing.assert_close(mantissa, want_mantissa, equal_nan=True, rtol=0, atol=0)
    finite = torch.isfinite(x)  # the exponent of inf/nan is unspecified in C
    assert torch.equal(exponent[finite], want_exponent[finite]) and exponent.dtype == torch.int32
    assert ember.metrics.fallback_calls == 0 and ember.metrics.extern_calls == 1


# ---- views -------------------------------------------------------------------------------


@pytest.mark.parametrize("offset,dim1,dim2", [(0, 0, 1), (1, 0, 1), (-2, 0, 1), (0, 2, 0), (1, -1, -2), (5, 0, 1)])
def test_diagonal(offset, dim1, dim2):
    x = torch.randn(4, 5, 3)
    assert_matches_eager(lambda t: torch.diagonal(t, offset, dim1, dim2) * 2, x)
    assert_matches_eager(lambda t: torch.diagonal(t, offset, dim1, dim2) + 1, x.transpose(0, 2))


def test_diagonal_family():
    x = torch.randn(5, 4)
    for fn in (torch.diag, torch.trace, torch.diagonal_copy, lambda t: torch.linalg.diagonal(t.unsqueeze(0))):
        assert_matches_eager(fn, x)
    assert_matches_eager(torch.diag, torch.randn(5).expand(5))


@pytest.mark.parametrize("dim,size,step", [(0, 2, 1), (1, 3, 2), (-1, 1, 1), (1, 5, 5), (0, 4, 3)])
def test_unfold(dim, size, step):
    x = torch.randn(7, 5)
    assert_matches_eager(lambda t: t.unfold(dim, size, step) * 1.5, x)
    assert_matches_eager(lambda t: t.unfold(dim, size, step) * 1.5, x.t().contiguous().t())
    assert_matches_eager(lambda t: torch.unfold_copy(t, dim, size, step), x)


def test_unfold_of_a_scalar():
    assert_matches_eager(lambda t: t.unfold(0, 1, 1) + 1, torch.tensor(2.5))


def test_view_copies():
    x = torch.randn(3, 4, 5)
    assert_matches_eager(lambda t: torch.permute_copy(t, (2, 0, 1)), x)
    assert_matches_eager(lambda t: torch.expand_copy(t[:, :1], (3, 4, 5)), x)
    assert_matches_eager(lambda t: torch.view_copy(t, (12, 5)), x)
    assert_matches_eager(lambda t: torch.narrow_copy(t, 1, 1, 2), x)
    assert_matches_eager(lambda t: torch.unbind_copy(t, 1), x)


@pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.13",
    reason="torch 2.11's dynamo runs view_copy's meta kernel, which raises for these strides, before any backend",
)
def test_view_copy_of_strides_no_view_expresses():
    # eager copies where a view cannot (torch's decomposition is a view, which raised)
    x = torch.randn(5, 5, 5)
    for strided in (x.mT, x[:1].expand(5, 5, 5), torch.randn(5, 10, 5)[:, ::2]):
        assert_matches_eager(lambda t: torch.view_copy(t, (25, 5)), strided)


@pytest.mark.parametrize("offset,dim1,dim2", [(0, 1, 2), (1, 1, 2), (-2, 2, 1), (0, 0, 2), (3, -1, 0), (9, 0, 1)])
def test_diagonal_scatter(offset, dim1, dim2):
    x = torch.randn(4, 5, 6)
    src_shape = torch.diagonal(x, offset, dim1, dim2).shape
    src = torch.randn(src_shape)
    assert_matches_eager(lambda a, b: torch.diagonal_scatter(a, b, offset, dim1, dim2), x, src)
    assert_matches_eager(lambda a, b: torch.diagonal_scatter(a, b, offset, dim1, dim2), x.transpose(0, 2).contiguous()
                         .transpose(0, 2), src)  # fmt: skip
    ints = torch.randint(0, 9, (4, 5, 6))
    assert_matches_eager(lambda a, b: torch.diagonal_scatter(a, b, offset, dim1, dim2), ints, src.long())


def test_as_strided_of_inputs_with_size_one_dims():
    for x in (torch.randn(1), torch.randn(3, 1), torch.randn(1, 4)):
        n = x.numel()
        assert_matches_eager(lambda t: torch.as_strided(t, (n,), (1,), 0) * 2, x)
        assert_matches_eager(lambda t: torch.as_strided_copy(t, (1, n), (n, 1)), x)


def test_empty_permuted_shape():
    ember.metrics.reset()
    out = compile_fn(lambda t: torch.empty_permuted((2, 3, 4), (0, 2, 1)) + t)(torch.zeros(4))
    assert out.shape == (2, 3, 4) and ember.metrics.fallback_calls == 0


# ---- pooling -------------------------------------------------------------------------------


def images(shape, seed=0, nans=False):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    if nans:
        x.view(-1)[::7] = nan
        x.view(-1)[3::11] = -inf
    return x


AVG_POOL_2D = [  # kernel, stride, padding, ceil_mode, count_include_pad, divisor_override
    (3, 2, 1, False, True, None), ((3, 2), (2, 3), (1, 1), True, False, None), (2, None, 0, False, True, 3),
    (3, 1, 1, True, True, None), ((1, 3), 2, (0, 1), True, False, None),
]  # fmt: skip


@pytest.mark.parametrize("config", AVG_POOL_2D)
def test_avg_pool2d(config):
    kernel, stride, padding, ceil_mode, include_pad, divisor = config
    fn = lambda t: F.avg_pool2d(t, kernel, stride, padding, ceil_mode, include_pad, divisor)  # noqa: E731
    for x in (images((2, 3, 9, 11)), images((3, 8, 7)), images((2, 9, 11, 3)).permute(0, 3, 1, 2)):
        ember.metrics.reset()
        check(fn, x)
        assert ember.metrics.fallback_calls == 0
    check(fn, images((2, 3, 9, 11)).double())


def test_avg_pool1d_and_3d():
    for fn, x in [
        (lambda t: F.avg_pool1d(t, 3, 2, 1, ceil_mode=True), images((2, 3, 10))),
        (lambda t: F.avg_pool3d(t, 2, 1, 1, count_include_pad=False), images((2, 2, 5, 7, 6))),
        (lambda t: F.avg_pool3d(t, (3, 2, 2), (2, 2, 1), ceil_mode=True), images((2, 5, 7, 6))),
    ]:
        ember.metrics.reset()
        check(fn, x)
        assert ember.metrics.fallback_calls == 0


def test_integer_pooling():
    """Integers: max pooling with eager's indices, average pooling with C's truncating division."""
    x = torch.randint(-20, 20, (2, 3, 9, 11))
    pools = [
        lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True), lambda t: F.avg_pool2d(t, 3, 2, 1),
        lambda t: F.avg_pool2d(t, 2, ceil_mode=True, count_include_pad=False),
        lambda t: F.avg_pool3d(t, 2, 1, divisor_override=3), lambda t: F.max_pool3d(t, 2, return_indices=True),
    ]  # fmt: skip
    for fn in pools:
        assert_matches_eager(fn, x)


@pytest.mark.parametrize("out_size", [(4, 5), (3, 1), (9, 11), (1, 1), (2, 4)])
def test_adaptive_pool2d(out_size):
    x = images((2, 3, 9, 11), nans=True)
    for fn in (lambda t: F.adaptive_max_pool2d(t, out_size, return_indices=True),
               lambda t: F.adaptive_avg_pool2d(t, out_size)):  # fmt: skip
        ember.metrics.reset()
        check(fn, x)
        check(fn, x[0].transpose(1, 2))
        assert ember.metrics.fallback_calls == 0


def test_adaptive_pool1d_and_3d():
    for fn, x in [
        (lambda t: F.adaptive_max_pool1d(t, 4, return_indices=True), images((2, 3, 10), nans=True)),
        (lambda t: F.adaptive_max_pool3d(t, (2, 3, 4), return_indices=True), images((2, 2, 5, 7, 6), nans=True)),
        (lambda t: F.adaptive_avg_pool3d(t, (3, 4, 5)), images((2, 2, 5, 7, 6))),
        (lambda t: F.adaptive_avg_pool3d(t, (5, 1, 6)), images((2, 5, 7, 6))),
        (lambda t: F.adaptive_avg_pool3d(t, (5, 7, 4)), images((0, 8, 8, 8, 8))),  # an empty batch
        (lambda t: F.adaptive_max_pool2d(t, (2, 3), return_indices=True), images((0, 3, 4, 4))),
        (lambda t: F.avg_pool2d(t, 2), images((0, 3, 4, 4))),
        (lambda t: F.adaptive_max_pool2d(t, (2, 3), return_indices=True), images((1, 4, 4, 4))),
    ]:
        ember.metrics.reset()
        check(fn, x)
        assert ember.metrics.fallback_calls == 0


def test_max_pool_with_indices():
    for fn, x in [
        (lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True), images((2, 3, 9, 11), nans=True)),
        (lambda t: F.max_pool2d(t, 2, ceil_mode=True), images((2, 11, 9, 3)).permute(0, 3, 1, 2)),
        (lambda t: F.max_pool1d(t, 3, 2), images((2, 3, 10))),
        (lambda t: F.max_pool3d(t, 2, return_indices=True), images((1, 2, 4, 6, 5))),
        (lambda t: F.max_pool2d(t, 3, 2, 1, dilation=2, return_indices=True), images((1, 3, 9, 11), nans=True)),
        (
            lambda t: F.max_pool3d(t, (3, 2, 2), (2, 1, 2), 1, ceil_mode=True, return_indices=True),
            images((2, 5, 7, 6), nans=True),
        ),
        (lambda t: F.max_pool2d(t, 2, return_indices=True), images((0, 3, 4, 4))),
    ]:
        ember.metrics.reset()
        check(fn, x)
        assert ember.metrics.fallback_calls == 0


BACKWARD = {
    "avg_pool2d": lambda t: F.avg_pool2d(t, 3, 2, 1) * 2,
    "avg_pool2d_ceil": lambda t: F.avg_pool2d(t, (3, 2), (2, 3), 1, ceil_mode=True, count_include_pad=False),
    "avg_pool2d_divisor": lambda t: F.avg_pool2d(t, 2, 1, divisor_override=3),
    "avg_pool3d": lambda t: F.avg_pool3d(t.unsqueeze(2).expand(-1, -1, 3, -1, -1), 2, 1, 1),
    "avg_pool1d": lambda t: F.avg_pool1d(t.flatten(2), 4, 3, 2, ceil_mode=True),
    "adaptive_avg_pool2d": lambda t: F.adaptive_avg_pool2d(t, (3, 5)),
    "adaptive_avg_pool2d_up": lambda t: F.adaptive_avg_pool2d(t, (11, 9)),
    "hardshrink": lambda t: F.hardshrink(t, 0.7),
    "softshrink": lambda t: F.softshrink(t, 0.3),
    "adaptive_avg_pool3d": lambda t: F.adaptive_avg_pool3d(t.unsqueeze(2).expand(-1, -1, 3, -1, -1), (2, 3, 5)),
}


@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_backward_graphs(name):
    """The backward graphs compile with no fallback, and the gradients match eager."""
    pool = BACKWARD[name]
    x = images((2, 3, 8, 7))
    weights = torch.randn_like(pool(x))

    def step(t):
        return (pool(t) * weights).sum()

    ember.metrics.reset()
    leaf = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(torch.compile(step, backend="ember")(leaf), leaf)
    reference = x.double().requires_grad_()
    (want,) = torch.autograd.grad((pool(reference) * weights.double()).sum(), reference)
    torch.testing.assert_close(grad, want.float(), rtol=1e-5, atol=1e-5)
    assert ember.metrics.fallback_calls == 0, dict(ember.metrics.fallback_ops)
