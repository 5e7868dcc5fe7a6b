"""Stage `schedule` (Triton): which 0-d CPU inputs of a graph its Triton kernels take by value.

Note: host scalars by value
    Eager mixes 0-d CPU tensors into CUDA ops, and dynamo hands a GPU graph such inputs: a loss's
    count of targets, and under `dynamic=True` every float attribute of a model (an RMS norm's
    eps, a rotary scaling), which it turns into float64 graph inputs. A kernel reads device
    memory, so the wrapper used to copy each to the device with `.to(device)` at every call: a
    copy from pageable memory that the host waits for, about 15 us each, six of them per call of
    a symbolic LLaMA. Instead each Triton kernel that reads such a value takes it as a typed
    scalar argument (`x.item()` once per call, no copy, no wait), as it takes the random seed.
    A float travels as the integer of its bits (`scalar_carrier`), which the kernel bitcasts
    back: Triton's interpreter makes a Python float a constant, and a constant -0.0 is +0.0.

    Only where nothing else needs the tensor on the device: an extern (aten) step reading it, an
    output returning it, or a step writing into it keeps the copy. Under CUDA graphs a recorded
    launch would bake the value in, so there the copy into the recording's static input stays
    (runtime/cuda_graphs.py). Under Triton's interpreter (CPU graphs, as in CI) every 0-d input
    is on the CPU and goes by value the same way.
"""

from __future__ import annotations

from ember.ir import LoweredGraph
from ember.schedule import KernelStep, Step, reads_of, writes_of
from ember.schedule.nodes import mutated_buffers
from ember.uop.dtypes import DType, dtypes

# what a Triton kernel takes by value: Triton's scalar argument types (and a Python number's)
BY_VALUE_DTYPES = frozenset({dtypes.float32, dtypes.float64, dtypes.int32, dtypes.int64})


def scalar_carrier(dtype: DType) -> DType:
    """The type a value taken by value travels as: a float as the integer of its bits, anything
    else as itself."""
    return {dtypes.float32: dtypes.int32, dtypes.float64: dtypes.int64}.get(dtype, dtype)


def scalar_inputs(graph: LoweredGraph, steps: list[Step], on_cpu: frozenset[str],
                  cuda_graphs: bool) -> frozenset[str]:  # fmt: skip
    """The 0-d inputs among `on_cpu` (those the call brings on the CPU) that the graph's Triton
    kernels take by value: read by kernels only, of a dtype Triton takes by value, never written."""
    if cuda_graphs or not on_cpu:
        return frozenset()
    needed_as_tensors = {o.ref.name for o in graph.outputs if o.ref is not None} | set(graph.mutated_inputs)
    for step in steps:
        needed_as_tensors |= set(writes_of(step))
        if not isinstance(step, KernelStep):
            needed_as_tensors |= {*reads_of(step), *mutated_buffers(step)}
    return frozenset(b.name for b in graph.inputs
                     if b.name in on_cpu and b.name not in needed_as_tensors and b.dtype in BY_VALUE_DTYPES
                     and not b.layout.size)  # fmt: skip
