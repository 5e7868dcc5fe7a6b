"""Graphs with symbolic shapes, compiled once per concrete shape: where the symbolic compile
refuses (compile_symbolic.py, Note: symbolic sizes), or with `symbolic_shapes` off.

Note: dynamic shapes by specialization
    A graph ember cannot compile with symbolic sizes gets kernels for static shapes.
    torch.compile's default (`dynamic=None`)
    recompiles a function whose input shapes change with those dims *symbolic*, so the second
    batch size a user runs used to reach ember as a graph of SymInts and run eagerly. Instead,
    such a graph is compiled at its first call with each new set of concrete shapes: the
    symbolic aten graph is run again on fake tensors of the call's shapes and strides
    (`static_graph`), its SymInt inputs and every size it computes become constants, and the static
    graph goes through `compile_graph` like any other (graph cache included). The compiled
    graphs are kept per (shapes, strides, dtypes, devices, scalar values), up to
    `config.shape_specializations`; past that, new shapes run the graph eagerly with one warning.
    `EMBER_STRICT` makes a failing specialization raise, as for any graph.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten

from ember.errors import EmberError, warn_at_user_code, warn_running_eagerly
from ember.metrics import metrics

SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def is_symbolic(example_inputs: list[Any]) -> bool:
    """Whether a graph's inputs carry symbolic sizes (torch.compile's dynamic shapes)."""
    for x in example_inputs:
        if isinstance(x, SYMBOLIC):
            return True
        sizes = (*x.shape, *x.stride(), x.storage_offset()) if isinstance(x, torch.Tensor) else ()
        if any(isinstance(s, torch.SymInt) for s in sizes):
            return True
    return False


def call_key(args: list[Any]) -> tuple:
    """What a specialization is compiled for: every tensor's metadata, every scalar's value."""
    return tuple(
        (tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device, a.requires_grad)
        if isinstance(a, torch.Tensor)
        else (type(a), a)
        for a in args
    )


class ShapeSpecializedGraph:
    """A boxed callable AOTAutograd runs in place of a symbolic graph (Note: dynamic shapes by
    specialization): `compile_static(gm, example_inputs)` compiles one static graph."""

    def __init__(self, gm: torch.fx.GraphModule, compile_static: Callable, limit: int, strict: bool):
        self._boxed_call = True  # per instance: wrappers (dynamo's disable) copy __dict__, not class attributes
        self.gm, self.compile_static, self.limit, self.strict = gm, compile_static, limit, strict
        self.compiled: dict[tuple, Callable] = {}
        self.warned = False
        self.lock = threading.Lock()

    def __call__(self, args: list[Any]) -> Any:
        key = call_key(args)
        call = self.compiled.get(key)
        if call is None:
            with self.lock:
                call = self.compiled.get(key) or self.specialize(key, args)
        return call(args)

    def specialize(self, key: tuple, args: list[Any]) -> Callable:
        if len(self.compiled) >= self.limit:
            if self.strict:
                raise RuntimeError(f"ember: more than {self.limit} shapes for one graph (shape_specializations)")
            if not self.warned:
                self.warned = True
                warn_at_user_code(f"ember: this graph has run with more than {self.limit} input shapes; "
                                  "new shapes run eagerly (raise EMBER_SHAPE_SPECIALIZATIONS)")  # fmt: skip
            return self.run_eagerly
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        try:
            static_gm = static_graph(self.gm, args)
        except Exception as e:  # a failure here is a graph ember cannot compile, as any other
            error = EmberError("specialize", f"the graph could not be run on fake tensors of this call's shapes: "
                                             f"{type(e).__name__}: {e}")  # fmt: skip
            if self.strict:
                raise error from e
            metrics.add(graphs_failed=1)
            warn_running_eagerly(error)
            self.compiled[key] = self.run_eagerly
            return self.run_eagerly
        call = self.compile_static(static_gm, [args[i] for i in tensors])
        specialized = self.tensors_only(call, tensors)
        self.compiled[key] = specialized
        metrics.add(shape_specializations=1)
        return specialized

    @staticmethod
    def tensors_only(call: Callable, tensors: list[int]) -> Callable:
        def run(args: list[Any]) -> Any:
            tensor_args = [args[i] for i in tensors]
            return call(tensor_args) if getattr(call, "_boxed_call", False) else call(*tensor_args)

        return run

    def run_eagerly(self, args: list[Any]) -> Any:
        return self.gm(*args)


def static_graph(gm: torch.fx.GraphModule, args: list[Any]) -> torch.fx.GraphModule:
    """`gm` for this call's shapes: its tensor inputs only, every scalar it computes (a SymInt
    input, a size, an assert on sizes) folded to its value, each node's fake value recomputed.

    Not `make_fx`: FX tracing sets a process-wide flag (`torch.fx._symbolic_trace`) under which
    dynamo refuses to run any compiled function, so specializing on one thread made other
    threads' compiled calls raise. Running the graph's ops on fake tensors sets no such flag."""
    graph, env, values = torch.fx.Graph(), {}, {}
    inputs = iter(args)
    with FakeTensorMode() as mode, torch.no_grad():
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                arg = next(inputs)
                values[node] = mode.from_tensor(arg) if isinstance(arg, torch.Tensor) else arg
            elif node.op == "get_attr":
                values[node] = mode.from_tensor(getattr(gm, node.target))
            elif node.op == "call_function":
                call_args, call_kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
                values[node] = node.target(*call_args, **call_kwargs)
            else:  # output
                graph.output(torch.fx.node.map_arg(node.args[0], env.__getitem__))
                continue
            env[node] = _static_node(graph, node, values[node], env)
    return torch.fx.GraphModule(gm, graph)


def _static_node(graph: torch.fx.Graph, node: torch.fx.Node, value: Any, env: dict) -> Any:
    """The node of the static graph for `node` (its value `value` on fake tensors), or the
    value itself when it holds no tensor: a scalar is a constant of this specialization."""
    if not any(isinstance(v, torch.Tensor) for v in tree_flatten(value)[0]):
        return value
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
    made = graph.create_node(node.op, node.target, args, kwargs, name=node.name)
    made.meta = {k: v for k, v in node.meta.items() if k != "tensor_meta"} | {"val": value}
    return made
