"""Optimizer steps compiled with ember: prims.fma as one rounding, parameters and optimizer states
written in place (Note: inputs written in place, lower/mutation.py), each parameter's update one
kernel, and whole training steps (forward, backward, step) against eager float32 and float64."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers import check_lowered, compile_fn, cpu_kernels_only

OPTIMIZERS = {
    "adam": lambda params, foreach: torch.optim.Adam(params, lr=1e-2, foreach=foreach),
    "adamw": lambda params, foreach: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=foreach),
    "sgd_momentum": lambda params, foreach: torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=foreach),
}


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def traced_targets(fn, *inputs) -> set[str]:
    """The ops in the graph dynamo gives a backend for `fn`."""
    seen: set[str] = set()

    def record(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes)
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=record)(*inputs)
    return seen


def test_fma_rounds_once():
    """prims.fma(a, b, c) rounds once: with a = b = 1 + 2^-12 and c = -(1 + 2^-11), the exact
    result 2^-24 survives, where rounding a * b first gives 0."""
    from torch._inductor import inductor_prims  # registers prims.fma (tests may import inductor)

    a = torch.full((64,), 1 + 2**-12)
    c = torch.full((64,), -(1 + 2**-11))
    got = compile_fn(lambda a, c: inductor_prims.fma(a, a, c))(a, c)
    assert torch.equal(got, torch.full((64,), 2**-24))
    assert ember.metrics.fallback_calls == 0


def test_addcmul_in_place_rounds_once():
    """addcmul_(t1, t2, value=v) is fma(t1 * t2, v, self): with t2 = 1 and v = 1 + 2^-12, the fma
    computes (1 + 2^-12)^2 - (1 + 2^-11) = 2^-24 exactly, where rounding v * t1 first gives 0."""
    t1 = torch.full((64,), 1 + 2**-12)
    c = torch.full((64,), -(1 + 2**-11))

    def addcmul_in_place(c, t1):
        c = c.clone()
        c.addcmul_(t1, torch.ones_like(t1), value=1 + 2**-12)  # dynamo: mul, then prims.fma
        return c

    if not any("fma" in target for target in traced_targets(addcmul_in_place, c, t1)):
        pytest.skip("this torch's dynamo traces addcmul_ without prims.fma (torch 2.11): its graph rounds twice")
    got = compile_fn(addcmul_in_place)(c, t1)
    want = addcmul_in_place(c.double(), t1.double()).float()
    assert want[0].item() == 2**-24 and torch.equal(got, want)
    assert ember.metrics.fallback_calls == 0


def test_moving_average_and_update_reach_lowering_whole():
    """Adam's moving average (lerp_ with a number weight) and its update (addcdiv_) are lowered
    whole (lower/pointwise.py): torch's decompositions trace both sides of lerp and a select per
    element, which AOTAutograd and lowering would then pay once per parameter. Fails when they
    are decomposed again."""
    seen: set[str] = set()

    def record(graph: torch.fx.Graph) -> None:
        seen.update(str(n.target) for n in graph.nodes)

    def step(p, g, m, v):
        m.lerp_(g, 0.1)
        v.mul_(0.999).add_(g * g, alpha=0.001)
        p.addcdiv_(m * -0.01, v.sqrt().add_(1e-8))  # (with a value, dynamo writes a quotient and an fma)

    torch.manual_seed(0)
    p, g, m, v = torch.randn(64), torch.randn(64), torch.randn(64), torch.rand(64)
    want = [x.clone() for x in (p, g, m, v)]
    step(*want)
    torch._dynamo.reset()
    ember.compile(step, pre_passes=(record,))(p, g, m, v)
    for got, expected in zip((p, m, v), (want[0], want[2], want[3])):
        torch.testing.assert_close(got, expected)
    assert {"aten.lerp.Scalar", "aten.addcdiv.default"} <= seen
    assert "aten.where.self" not in seen


LERP_WEIGHTS = (0.1, 0.7, -0.6, 1.0, 0.5, -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_lerp_addcdiv_addcmul_match_eager(dtype):
    """Each side of lerp (|weight| below and from 0.5, a number or a tensor of weights, weight 1
    giving `end` exactly), addcdiv and addcmul with and without `value`, broadcast operands."""
    torch.manual_seed(0)
    start, end = torch.randn(8, 32, dtype=dtype), torch.randn(32, dtype=dtype)
    weights = torch.tensor(LERP_WEIGHTS * 6, dtype=dtype)[:32]

    def ops(start, end, weights):
        lerps = [torch.lerp(start, end, w) for w in LERP_WEIGHTS] + [torch.lerp(start, end, weights)]
        divisor = end.abs() + 1
        return (*lerps, torch.addcdiv(start, end, divisor), torch.addcdiv(start, end, divisor, value=-0.3),
                torch.addcmul(start, end, start, value=2.5), torch.addcmul(start, start, end))  # fmt: skip

    tolerance = {"rtol": 1e-2, "atol": 1e-2} if dtype in (torch.float16, torch.bfloat16) else {}
    check_lowered({"ops": ops}, start, end, weights, **tolerance)
    exact_end = compile_fn(lambda s, e: torch.lerp(s, e, 1.0))(start, end)
    assert torch.equal(exact_end, end.expand_as(start))


def test_fma_low_precision_and_broadcast():
    torch.manual_seed(0)
    x, t = torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)

    def step(x, t):
        x = x.clone()
        x.addcdiv_(t, t.abs() + 1, value=-0.5)
        return x

    got = compile_fn(step)(x, t)
    want = step(x.double(), t.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)
    assert ember.metrics.fallback_calls == 0


def run_steps(model, optimizer, step_fn, x, y, steps):
    for _ in range(steps):
        step_fn(model, optimizer, x, y)
    return [p.detach().clone() for p in model.parameters()], states(optimizer)


def states(optimizer) -> list[torch.Tensor]:
    """Every state tensor, by parameter and name (a compiled step may create the names in another order)."""
    per_parameter = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]
    return [s[name].detach().clone() for s in per_parameter for name in sorted(s) if isinstance(s[name], torch.Tensor)]


def training_step(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def assert_close_to_float64(got, eager, precise, what: str):
    """Compiled float32 within four times eager float32's own error of float64, per element, plus
    a little (the division by sqrt(v) + eps magnifies last-bit differences of the gradients)."""
    for i, (g, e, p) in enumerate(zip(got, eager, precise)):
        allowed = 4 * (e.double() - p).abs() + 1e-5 + 1e-4 * p.abs()
        excess = (g.double() - p).abs() - allowed
        assert excess.max() <= 0, f"{what} {i}: off float64 by {(g.double() - p).abs().max():.3g}"


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_training_step_with_optimizer_matches_eager(name, foreach):
    """torch.compile around forward, backward and optimizer.step(), several steps."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randint(0, 8, (32,))
    models = {"ember": mlp()}
    models["eager"] = copy.deepcopy(models["ember"])
    models["float64"] = copy.deepcopy(models["ember"]).double()
    results = {}
    for kind, model in models.items():
        optimizer = OPTIMIZERS[name](model.parameters(), foreach)
        step = torch.compile(training_step, backend="ember") if kind == "ember" else training_step
        inputs = (x.double(), y) if kind == "float64" else (x, y)
        results[kind] = run_steps(model, optimizer, step, *inputs, steps=4)
    for part, what in enumerate(("parameter", "state")):
        assert_close_to_float64(results["ember"][part], results["eager"][part], results["float64"][part], what)
    assert ember.metrics.graphs_failed == 0
    assert ember.metrics.fallback_calls == 0, ember.metrics.fallback_ops


@cpu_kernels_only
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_step_is_one_kernel_per_parameter_in_place(name, foreach):
    """optimizer.step() alone: each parameter's update reads parameter, gradient and states once
    and writes them in place, one part of one kernel; nothing goes to aten, nothing is copied back."""
    torch.manual_seed(0)
    model = mlp()
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    optimizers = [OPTIMIZERS[name](m.parameters(), foreach) for m in (model, twin)]
    for optimizer in optimizers:  # eagerly, so that the states exist and one graph is compiled
        optimizer.step()
    compiled_step = torch.compile(optimizers[0].step, backend="ember")
    for _ in range(3):
        compiled_step()
        optimizers[1].step()
    for got, want in zip([*model.parameters(), *states(optimizers[0])], [*twin.parameters(), *states(optimizers[1])]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    parameters = len(list(model.parameters()))
    assert ember.metrics.graphs_compiled == 1 and ember.metrics.graphs_failed == 0
    assert ember.metrics.extern_calls == 0
    # parameter and momentum (SGD); parameter, both moments and the step count (Adam, AdamW)
    assert ember.metrics.inputs_written_in_place == parameters * (2 if name == "sgd_momentum" else 4)
    # one launch for every update (Note: horizontal fusion, schedule/horizontal.py)
    assert ember.metrics.kernels_generated == 1 and ember.metrics.horizontal_kernels_saved == parameters - 1


def test_in_place_store_reading_another_input_at_other_elements():
    """Stores into inputs that read each other's old contents (a swap) and their own at other
    elements (a flip): each sees the old contents, as eager's functional graph says."""

    def swap_and_flip(a, b):
        old_a = a.clone()
        a.copy_(b * 2)
        b.copy_(old_a.flip(0) + 1)
        return None

    torch.manual_seed(0)
    a, b = torch.randn(64), torch.randn(64)
    want_a, want_b = a.clone(), b.clone()
    swap_and_flip(want_a, want_b)
    with torch.no_grad():
        compile_fn(swap_and_flip)(a, b)
    torch.testing.assert_close(a, want_a)
    torch.testing.assert_close(b, want_b)
    assert ember.metrics.inputs_written_in_place == 2


def test_in_place_store_of_a_reduction():
    """x.sub_(x.mean()): the mean reads every element, so it is computed before any is overwritten."""

    def center(x):
        x.sub_(x.mean())

    torch.manual_seed(0)
    x = torch.randn(4096) + 3
    want = x.clone()
    center(want)
    with torch.no_grad():
        compile_fn(center)(x)
    torch.testing.assert_close(x, want)
    assert ember.metrics.inputs_written_in_place == 1


def test_gpt2_training_step_with_adamw_matches_eager():
    """The whole step compiled against the model compiled and AdamW run eagerly (the same gradients:
    what differs is the update, which must agree closely), and both against float64 eager (loosely:
    AdamW's m / (sqrt(v) + eps) magnifies the rounding of gradients near eps, in eager float32 too)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    base = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 16))

    def step(model, optimizer, ids, _):
        optimizer.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        optimizer.step()

    results = {}
    for kind in ("whole step", "model only", "float64"):
        model = copy.deepcopy(base).double() if kind == "float64" else copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fn = torch.compile(step, backend="ember") if kind == "whole step" else step
        compiled_model = torch.compile(model, backend="ember") if kind == "model only" else model
        results[kind] = run_steps(compiled_model, optimizer, fn, ids, None, steps=3)
        results[kind] = (list(model.parameters()), results[kind][1])
    # the key third of each c_attn.bias has a gradient that is zero up to rounding (a constant added
    # to every key shifts all of a query's scores equally): its moves are rounding noise, left out
    noise = [name.endswith("attn.c_attn.bias") for name, _ in base.named_parameters()]
    kept = [torch.arange(p.numel()).reshape(p.shape) // 64 != 1 if n else torch.ones_like(p, dtype=torch.bool)
            for p, n in zip(base.parameters(), noise)]  # fmt: skip
    parameters = zip(kept, *(results[kind][0] for kind in ("whole step", "model only", "float64")))
    for keep, got, want, precise in parameters:
        torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[keep].double(), precise[keep].double(), rtol=0, atol=1e-4)
    for got, want in zip(results["whole step"][1], results["model only"][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert ember.metrics.graphs_failed == 0
    assert ember.metrics.fallback_calls == 0, ember.metrics.fallback_ops
