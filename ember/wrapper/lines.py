"""The wrapper as data: one object per line of the generated `call`, each rendering itself.

Memory planning (plan.py) rewrites this list before it is rendered: a freed
buffer's FreeIfNotReused becomes Null and a later Allocate of the same size becomes Reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.ir import Buffer, BufferRef, Layout
from ember.uop.dtypes import to_torch
from ember.uop.variables import size_source as S


def tensor_expr(ref: BufferRef, own_layout: Layout, view: str = "as_strided") -> str:
    """Python for the tensor `ref` names: the buffer itself, or a view of it; `view` "reinterpret"
    for a tensor of its own on the buffer's storage (Note: outputs are never views, wrapper/runtime.py)."""
    if ref.layout == own_layout:
        return ref.name
    return f"{view}({ref.name}, {S(ref.layout.size)}, {S(ref.layout.stride)}, {S(ref.layout.offset)})"


@dataclass
class AssertInput:
    buffer: Buffer

    def render(self) -> str:
        b = self.buffer
        return f"assert_layout({b.name}, {S(b.layout.size)}, {S(b.layout.stride)}, {to_torch(b.dtype)}, {b.name!r})"


@dataclass
class BindSize:
    """A size variable bound from the call's arguments (Note: symbolic sizes, uop/variables.py)."""

    name: str
    source: str  # Python reading it: a size argument, `x.shape[d]`, `x.stride(d)`

    def render(self) -> str:
        return f"{self.name} = {self.source}"


@dataclass
class MoveToDevice:
    """A CPU input of a CUDA graph (a 0-d tensor, which eager mixes in) moved to the graph's device."""

    name: str

    def render(self) -> str:
        return f"{self.name} = {self.name}.to(_device)"


@dataclass
class TakeValue:
    """A 0-d CPU input whose value the graph's Triton kernels take as an argument (Note: host
    scalars by value, schedule/host_scalars.py): a Python number, no copy to the device; a float
    as the integer of its bits (-0.0 and NaN payloads exact, under Triton's interpreter too)."""

    name: str
    bits: str = ""  # a float's: the integer dtype of its bits, which the kernel takes

    def render(self) -> str:
        view = f".view(torch.{self.bits})" if self.bits else ""
        return f"{self.name} = {self.name}{view}.item()"


@dataclass
class Allocate:
    buffer: Buffer
    large: bool = False  # a large CPU buffer (runtime/memory.py): pooled and/or in huge pages
    huge_pages: bool = False  # Note: huge pages for fresh buffers
    pool_bytes: int = 0  # Note: pooled large buffers (0: fresh)
    cuda: bool = False  # on the wrapper's CUDA device, which is current during the call

    def render(self) -> str:
        b = self.buffer
        size, stride = S(b.layout.size), S(b.layout.stride)
        if self.cuda:
            return f"{b.name} = empty_cuda({size}, {stride}, {to_torch(b.dtype)})"
        if self.large:
            nbytes = S(b.layout.storage_size * b.dtype.itemsize)
            return (f"{b.name} = empty_large({size}, {stride}, {to_torch(b.dtype)}, {nbytes}, "
                    f"huge_pages={self.huge_pages}, pool_bytes={self.pool_bytes})")  # fmt: skip
        return f"{b.name} = empty_strided({size}, {stride}, dtype={to_torch(b.dtype)}, device=_device)"


@dataclass
class DrawSeed:
    """A fresh seed for the graph's random ops, from torch's default generator, at every call
    (Note: counter-based random numbers, lower/random.py)."""

    buffer: Buffer
    by_value: bool = False  # Triton kernels take the seed as an int argument, not a tensor
    on_device: bool = False  # ... or read it from device memory (Note: random numbers in CUDA graphs)

    def render(self) -> str:
        if self.on_device:
            return f"{self.buffer.name} = random_seed_on(_device)"
        return f"{self.buffer.name} = {'random_seed_value' if self.by_value else 'random_seed'}()"


@dataclass
class SetRandomOffset:
    """A random op's first Philox counter, a kernel argument rather than a constant of its kernel
    (Note: counter-based random numbers, lower/random.py): an int for Triton kernels (by value),
    else a one-element tensor made once per process (wrapper/runtime.py `random_offset`)."""

    buffer: Buffer
    value: int
    by_value: bool = False

    def render(self) -> str:
        name = self.buffer.name
        return f"{name} = {self.value}" if self.by_value else f"{name} = random_offset({self.value})"


@dataclass
class KernelCall:
    kernel: str
    args: list[str]
    can_fail: bool = False  # the kernel reports errors through the wrapper's flag
    triton: bool = False  # a Triton launcher: called with the tensors themselves
    error_slot: int | None = None  # a Triton kernel that can fail: its slot in the device error flags
    label: str = ""  # the profiler's name for this call (Note: profiler ranges, python.py)
    variables: tuple[str, ...] = ()  # size variables the kernel takes after its buffers (Note: symbolic sizes)

    def render(self) -> str:
        if self.triton:
            flag = [f"_gpu_errors.slot({self.error_slot})"] if self.error_slot is not None else []
            return f"{self.kernel}({', '.join(self.args + list(self.variables) + flag)})"
        pointers = [f"{a}.data_ptr()" for a in self.args] + list(self.variables)
        pointers += ["_error.address"] if self.can_fail else []
        call = f"{self.kernel}({', '.join(pointers)})"
        return f"{call}; _error.check({self.kernel}_errors)" if self.can_fail else call


@dataclass
class ExternCall:
    target: str  # Python expression for the op, e.g. aten.sort.default
    call_args: str
    outputs: list[Buffer]
    single: bool
    label: str = ""  # the profiler's name for this call (Note: profiler ranges, python.py)
    as_is: bool = False  # a collective's result, still in flight: bound unchecked, never copied

    def render(self) -> str:
        if self.single:
            out = self.outputs[0]
            call = f"{self.target}({self.call_args})"
            if self.as_is:
                return f"{out.name} = {call}"
            return f"{out.name} = ensure_layout({call}, {S(out.layout.size)}, {S(out.layout.stride)})"
        tmp = f"{self.outputs[0].name}_result" if self.outputs else "_"
        return f"{tmp} = tree_leaves({self.target}({self.call_args}))"


@dataclass
class Unpack:
    source: str
    position: int
    buffer: Buffer
    as_is: bool = False  # a collective's result, still in flight (ExternCall.as_is)

    def render(self) -> str:
        b = self.buffer
        if self.as_is:
            return f"{b.name} = {self.source}[{self.position}]"
        return f"{b.name} = ensure_layout({self.source}[{self.position}], {S(b.layout.size)}, {S(b.layout.stride)})"


@dataclass
class FreeIfNotReused:
    """Release `buffer` after its last use, unless the planner hands it to a later Allocate."""

    buffer: Buffer

    def render(self) -> str:
        return f"del {self.buffer.name}"


@dataclass
class Reuse:
    """`new` takes over the storage of `old` (same dtype and bytes) with its own layout, as a
    tensor of its own, never a view of `old` (Note: outputs are never views, wrapper/runtime.py)."""

    old: Buffer
    new: Buffer

    def render(self) -> str:
        if self.old.layout == self.new.layout:
            view = self.old.name
        else:
            view = f"reinterpret({self.old.name}, {S(self.new.layout.size)}, {S(self.new.layout.stride)})"
        return f"{self.new.name} = {view}; del {self.old.name}  # reuse"


@dataclass
class Del:
    """Drop a temporary Python name (not a planned buffer)."""

    names: list[str]

    def render(self) -> str:
        return f"del {', '.join(self.names)}"


@dataclass
class Null:
    """A line the planner removed."""

    def render(self) -> str:
        return ""


@dataclass
class CheckGpuErrors:
    """Raise what a Triton kernel of this call reported (Note: kernel errors on the GPU,
    renderer/triton.py): now, waiting for the GPU, or `deferred` to a later call (Note: deferred
    GPU error checks, wrapper/runtime.py)."""

    errors: list[list[tuple[str, str]]]  # per slot: (exception name, message) per error code
    deferred: bool = True

    def render(self) -> str:
        return f"_gpu_errors.check({self.errors!r}, deferred={self.deferred})"


@dataclass
class CheckBuffers:
    """EMBER_VERIFY: hand the buffers step `step` completed to the call's verifier
    (wrapper/verify.py), before any of them is freed or reused."""

    step: int
    names: list[str]

    def render(self) -> str:
        return f"_check({self.step}, {{{', '.join(f'{n!r}: {n}' for n in self.names)}}})"


@dataclass
class Return:
    values: list[str]

    def render(self) -> str:
        return f"return ({''.join(v + ', ' for v in self.values)})"


Line = (
    AssertInput
    | BindSize
    | MoveToDevice
    | TakeValue
    | DrawSeed
    | SetRandomOffset
    | Allocate
    | KernelCall
    | CheckGpuErrors
    | CheckBuffers
    | ExternCall
    | Unpack
    | FreeIfNotReused
    | Reuse
    | Del
    | Null
    | Return
)
