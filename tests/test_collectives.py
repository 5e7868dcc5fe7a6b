"""Functional collectives in ember's graph, without a process group: how they are scheduled and
what the memory plan keeps alive (Note: collectives in the graph, ember/schedule/collectives.py).

The graphs are traced with fake tensors (the collectives' meta kernels need no process group)
and go through ember's lower, schedule and wrapper stages; nothing is run. Running them on two
ranks is tests/test_distributed.py's job.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ember.lower import lower_graph
from ember.schedule import graph_last_uses, schedule
from ember.wrapper import lines as L
from ember.wrapper.python import generate_wrapper

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch has no torch.distributed")

c10d = torch.ops._c10d_functional if torch.distributed.is_available() else None


def traced(fn, *shapes):
    import torch.distributed._functional_collectives  # noqa: F401  (the collectives' meta kernels)

    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def gather_beside_independent_work(x, v):
    """A buffer `y` in flight in an all-gather while an independent buffer `z` of y's size and
    dtype is computed (after a matmul, so no fusion puts it before the collective): freeing y at
    the collective would hand its storage to z, which a kernel then overwrites."""
    y = torch.relu(x) * 2
    gathered = c10d.all_gather_into_tensor(y, 2, "0")
    z = (x @ v).sin()
    m = z @ v
    return c10d.wait_tensor(gathered) * 3, m


def compiled_stages(gm, shapes):
    inputs = [torch.empty(s) for s in shapes]
    graph, _ = lower_graph(gm, inputs)
    scheduled = schedule(graph)
    wrapper = generate_wrapper(graph, scheduled.steps, kernels={})  # the plan; no kernel is built
    return graph, scheduled, wrapper


def first_line(lines, predicate) -> int:
    return next(i for i, line in enumerate(lines) if predicate(line))


def test_buffer_in_flight_is_not_freed_or_reused_before_the_wait():
    shapes = [(4, 8), (8, 8)]
    graph, scheduled, wrapper = compiled_stages(traced(gather_beside_independent_work, *shapes), shapes)
    lines = wrapper.lines
    gather = first_line(lines, lambda ln: isinstance(ln, L.ExternCall) and "all_gather_into_tensor" in ln.target)
    wait = first_line(lines, lambda ln: isinstance(ln, L.ExternCall) and "wait_tensor" in ln.target)
    (in_flight,) = [a for a in gather_arguments(scheduled.steps)]
    # the storage of the gathered buffer is handed on (freed, or taken over by an allocation) only after the wait
    handed_on = [i for i, ln in enumerate(lines) if isinstance(ln, (L.FreeIfNotReused, L.Reuse))
                 and (ln.buffer if isinstance(ln, L.FreeIfNotReused) else ln.old).name == in_flight]  # fmt: skip
    assert handed_on and min(handed_on) > wait > gather, (in_flight, gather, wait, handed_on)
    assert all(ln.old.name != in_flight for ln in lines if isinstance(ln, L.Reuse)), "in-flight buffer reused"
    # its last use, which also decides in-place kernels (codegen/kernel.py choose_inplace), is the wait
    steps = scheduled.steps
    wait_step = next(i for i, s in enumerate(steps) if "wait_tensor" in str(getattr(s, "op", "")))
    assert in_flight in graph_last_uses(graph, steps)[wait_step]


def gather_arguments(steps) -> list[str]:
    from ember.ir import BufferRef

    (gather,) = [s for s in steps if "all_gather_into_tensor" in str(getattr(s, "op", ""))]
    return [a.name for a in gather.args if isinstance(a, BufferRef)]


def test_independent_work_runs_between_collective_and_wait():
    shapes = [(4, 8), (8, 8)]
    _, scheduled, _ = compiled_stages(traced(gather_beside_independent_work, *shapes), shapes)
    (overlap,) = scheduled.overlaps
    # the matmuls (externs) and sin (a kernel) run while the all-gather is in flight
    assert overlap.kernels >= 1 and overlap.externs >= 1, overlap


def chained_reductions(x, w):
    """Two collectives, the second on the first's result, and work that needs neither."""
    a = c10d.all_reduce(x * 2, "sum", "0")
    b = c10d.wait_tensor(a)
    r = c10d.reduce_scatter_tensor(b + 1, "sum", 2, "0")
    h = torch.tanh(x @ w)
    return c10d.wait_tensor(r), h


def test_waits_stay_before_their_readers_and_collectives_keep_their_order():
    shapes = [(4, 8), (8, 8)]
    _, scheduled, _ = compiled_stages(traced(chained_reductions, *shapes), shapes)
    names = [str(getattr(s, "op", "kernel")) for s in scheduled.steps]
    starts = [i for i, n in enumerate(names) if "all_reduce" in n or "reduce_scatter" in n]
    assert "all_reduce" in names[starts[0]] and "reduce_scatter" in names[starts[1]], names
    overlaps = scheduled.overlaps
    assert [o.op.split(".")[1] for o in overlaps] == ["all_reduce", "reduce_scatter_tensor"]
    # the matmul and tanh overlap with one of the two; the first wait precedes the kernel reading it
    assert sum(o.kernels + o.externs for o in overlaps) >= 2, overlaps
    assert all(o.wait is not None and o.start < o.wait for o in overlaps)
    second_input = max(i for i in range(starts[1]) if "kernel" == names[i])  # b + 1
    assert overlaps[0].wait < second_input < starts[1]


def test_verify_checks_a_collective_by_its_wait():
    """EMBER_VERIFY compares buffers after the step that writes them: a collective's result is
    still in flight there, so only its wait's result is compared."""
    from ember.ir import Communication
    from ember.wrapper.python import verified_buffers

    shapes = [(4, 8), (8, 8)]
    graph, scheduled, _ = compiled_stages(traced(gather_beside_independent_work, *shapes), shapes)
    started = {b.name for s in scheduled.steps if getattr(s, "communication", None) is Communication.START
               for b in s.outputs}  # fmt: skip
    checked = {name for names in verified_buffers(graph, scheduled.steps, {}).values() for name in names}
    assert started and not started & checked, (started, checked)


def test_overlap_off_keeps_the_traced_order_and_the_buffers_in_flight():
    """EMBER_COLLECTIVE_OVERLAP=0: collectives and waits where the graph has them (the matmul and
    tanh traced after the all-reduce's wait stay after it), waits still keeping their inputs."""
    shapes = [(4, 8), (8, 8)]
    graph, _ = lower_graph(traced(chained_reductions, *shapes), [torch.empty(s) for s in shapes])
    moved, kept = schedule(graph).overlaps, schedule(graph, overlap=False).overlaps
    assert moved[0].kernels + moved[0].externs >= 1, moved  # reordered: work between all_reduce and its wait
    assert kept[0].kernels + kept[0].externs == 0, kept
    steps = schedule(graph, overlap=False).steps
    waits = [s for s in steps if "wait_tensor" in str(getattr(s, "op", ""))]
    assert len(waits) == 2 and all(w.keeps_alive for w in waits), waits


def layers_of_gathered_weights(x, w0, w1, w2, w3):
    """An FSDP-style forward: each layer all-gathers its weight shard, then uses it."""
    for w in (w0, w1, w2, w3):
        x = torch.tanh(x @ c10d.wait_tensor(c10d.all_gather_into_tensor(w, 2, "0")))
    return x


def layers_reduce_scattered(x, w0, w1, w2, w3):
    """An FSDP-style backward: each layer's result (a gradient) reduce-scattered, waited for only
    at the end."""
    scattered = []
    for w in (w0, w1, w2, w3):
        x = torch.tanh(x @ w)
        scattered.append(c10d.reduce_scatter_tensor(x * 2, "sum", 2, "0"))
    return x, *(c10d.wait_tensor(s) for s in scattered)


def most_in_flight(scheduled) -> int:
    from ember.schedule.collectives import most_in_flight

    return most_in_flight(scheduled.overlaps, len(scheduled.steps))


def collective_names(steps) -> list[str]:
    return [str(s.op) for s in steps if "c10d" in str(getattr(s, "op", "")) and "wait" not in str(s.op)]


@pytest.mark.parametrize("bound", [1, 2, 3])
@pytest.mark.parametrize("fn", [layers_of_gathered_weights, layers_reduce_scattered], ids=["gathers", "scatters"])
def test_a_bound_on_collectives_in_flight_holds_back_the_next_and_still_overlaps(fn, bound):
    """EMBER_COLLECTIVES_IN_FLIGHT: unbounded, every all-gather is issued at the start (each
    gathered weight alive from there on) and every reduce-scatter waited for at the end; with a
    bound, never more than that many are in flight, and each collective but the last ones still
    has work running beside it."""
    weight = (4, 8) if fn is layers_of_gathered_weights else (8, 8)  # a shard of an (8, 8) weight, or all of it
    shapes = [(4, 8)] + [weight] * 4
    graph, _ = lower_graph(traced(fn, *shapes), [torch.empty(s) for s in shapes])
    unbounded = schedule(graph)
    assert most_in_flight(unbounded) == 4, [str(getattr(s, "op", "kernel")) for s in unbounded.steps]
    bounded = schedule(graph, in_flight=bound)
    assert most_in_flight(bounded) == bound
    overlaps = bounded.overlaps
    assert len(overlaps) == 4 and all(o.wait is not None for o in overlaps)
    assert sum(1 for o in overlaps if o.kernels + o.externs) >= 4 - bound, overlaps
    assert collective_names(bounded.steps) == collective_names(unbounded.steps)
