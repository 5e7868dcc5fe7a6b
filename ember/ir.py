"""Lowering-level program: buffers, computed buffers, extern calls.

`lower/` turns an FX graph into a `LoweredGraph`; `schedule/` groups its computations into
kernels; `codegen/` turns each kernel's UOp bodies into source; `wrapper/` calls them in
order. Tensors that are never realized never appear here: they were inlined as UOps
into the bodies of the buffers that read them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import BufferArg, Ops, UOp
from ember.uop.symbolic_division import normal_form
from ember.uop.variables import index_size, known_zero


@dataclass(frozen=True)
class Layout:
    """Where a tensor's elements live in its buffer: sizes, strides and offset, in elements."""

    size: tuple[int, ...]  # (torch SymInts where sizes are symbolic: Note: symbolic sizes, uop/variables.py)
    stride: tuple[int, ...]
    offset: int = 0

    def __eq__(self, other: object) -> bool:
        """The same layout; symbolic sizes must be the same expression (never a guard on their values)."""
        if not isinstance(other, Layout):
            return NotImplemented
        return same_sizes(self.size, other.size) and same_sizes(self.stride, other.stride) and \
            same_sizes((self.offset,), (other.offset,))  # fmt: skip

    def __hash__(self) -> int:
        return hash(tuple(_size_key(x) for x in (*self.size, *self.stride, self.offset)))

    @staticmethod
    def contiguous(size: tuple[int, ...]) -> Layout:
        return Layout(tuple(size), contiguous_strides(size))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n

    @property
    def storage_size(self) -> int:
        """Elements the buffer must hold for this layout to be in bounds."""
        if known_zero(self.numel):
            return 0
        return self.offset + 1 + sum((s - 1) * st for s, st in zip(self.size, self.stride))

    def index(self, axes: list[UOp]) -> UOp:
        """The linear element index of position `axes`."""
        from ember.uop.dtypes import dtypes

        idx = UOp.const(dtypes.index, self.offset)
        for axis, size, stride in zip(axes, self.size, self.stride):
            if size != 1 or axis.op is Ops.CHECK:  # a checked position into a dim of size 1 still checks
                idx = idx + axis * stride
        return idx


def same_sizes(a: tuple, b: tuple) -> bool:
    """Equal tuples of sizes; a symbolic one equals only the same expression."""
    if len(a) != len(b):
        return False
    return all(x == y if type(x) is int and type(y) is int else _same_size(x, y) for x, y in zip(a, b))


def _size_key(size: Any) -> Any:
    """What `_same_size` compares: an int, or a symbolic size's normal form (equal keys, equal hashes)."""
    x = index_size(size)
    return x if isinstance(x, int) else normal_form(x)


def _same_size(a: Any, b: Any) -> bool:
    x, y = index_size(a), index_size(b)
    if isinstance(x, int) or isinstance(y, int):
        return x == y if isinstance(x, int) and isinstance(y, int) else False
    return x is y or normal_form(x) == normal_form(y)


def contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for s in reversed(size):
        strides.append(running)
        running *= max(s, 1)
    return tuple(reversed(strides))


@dataclass
class Buffer:
    """A named allocation: a graph input, a kernel output, or an extern's output."""

    name: str
    dtype: DType
    layout: Layout
    # "input" | "computed" | "extern" | "constant" | "seed" (drawn by the wrapper per call) |
    # "random_offset" (a random op's first Philox counter, set by the wrapper: lower/random.py)
    kind: str

    def uop(self) -> UOp:
        return UOp(Ops.BUFFER, self.dtype, (), BufferArg(self.name, index_size(self.layout.storage_size)))


@dataclass
class ComputedBuffer:
    """A buffer whose every element is `body`, a UOp over AXIS placeholders of its size."""

    buffer: Buffer
    body: UOp
    origins: tuple[str, ...] = ()  # FX node names this computation came from, for debugging
    split_partials: bool = False  # the first level of a split reduction (Note: split reductions)

    @property
    def name(self) -> str:
        return self.buffer.name


@dataclass
class IndexedStore:
    """A kernel that writes into `buffer`, which an earlier step created, at positions computed
    from data: for every position p of `shape`, buffer[index(p)] (combine)= value(p). `index`
    and `value` are UOps over AXIS placeholders of `shape` (Note: stores at computed
    positions, lower/scatter.py)."""

    buffer: Buffer
    shape: tuple[int, ...]
    index: UOp  # linear element index into `buffer`
    value: UOp
    combine: Ops | None = None  # None overwrites; ADD/MUL/MAX/MIN fold into the element
    origins: tuple[str, ...] = ()
    # dims of `shape` whose position alone fixes the position along a dim of `buffer`:
    # iterations that differ there never write the same element
    owner_dims: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return self.buffer.name

    @property
    def body(self) -> UOp:
        """Everything the kernel reads, for dependencies and the debug dump."""
        return UOp(Ops.SINK, dtypes.void, (self.index, self.value))


class Communication(enum.Enum):
    """An extern's part in a collective (Note: collectives in the graph, schedule/collectives.py)."""

    START = "start"  # issues a collective (all_reduce, all_gather_into_tensor, ...): returns before it is done
    WAIT = "wait"  # wait_tensor: returns its argument once the collective that produces it is done


@dataclass
class ExternCall:
    """A call of an aten op on realized buffers. `args`/`kwargs` hold `BufferRef`s for tensors."""

    op: Any  # torch OpOverload
    args: tuple
    kwargs: dict
    outputs: list[Buffer]  # one per tensor the op returns, in order
    output_structure: Any  # "single" or the number of leaves of a tuple result
    output_positions: tuple[int, ...] = ()  # leaf index of each output in a tuple result
    origin: str = ""
    is_fallback: bool = True
    communication: Communication | None = None
    # a WAIT: the buffers its collective reads while in flight, alive (never freed, reused or
    # overwritten) until this call returns; set by the scheduler (schedule/collectives.py)
    keeps_alive: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.outputs[0].name if self.outputs else f"extern_{self.origin}"


@dataclass(frozen=True)
class BufferRef:
    """A tensor argument of an extern call: buffer `name` seen through `layout`."""

    name: str
    layout: Layout
    dtype: DType


@dataclass(frozen=True)
class OpaqueInput:
    """A graph input that is no tensor nor number: an object DTensor's graphs pass along (torch's
    opaque objects), which the wrapper binds by name and hands on where the graph uses it."""

    name: str


@dataclass(frozen=True)
class OutputSpec:
    """A graph output: a buffer seen through a layout, or a Python constant."""

    ref: BufferRef | None
    constant: Any = None


@dataclass
class LoweredGraph:
    inputs: list[Buffer]
    constants: dict[str, Any]  # name -> torch.Tensor held by the wrapper
    steps: list[ComputedBuffer | IndexedStore | ExternCall] = field(default_factory=list)
    outputs: list[OutputSpec] = field(default_factory=list)
    buffers: dict[str, Buffer] = field(default_factory=dict)  # every named buffer, by name
    arguments: list[str] = field(default_factory=list)  # every input's name in call order, opaque ones too
    # buffer name -> (the first FX node whose value is that buffer read through a layout, the
    # layout): which aten computation a buffer holds, for EMBER_VERIFY (wrapper/verify.py)
    holds: dict[str, tuple[str, Layout]] = field(default_factory=dict)
    # "random_offset" buffer -> its value (Note: counter-based random numbers, lower/random.py)
    random_offsets: dict[str, int] = field(default_factory=dict)
    # inputs a step stores into, in place (Note: inputs written in place, lower/mutation.py)
    mutated_inputs: list[str] = field(default_factory=list)
    # extern results that may be views of their arguments (aten's view ops): never written over in
    # place, as the storage is an argument's, maybe a graph input's (codegen/kernel.py choose_inplace)
    aliasing_outputs: set[str] = field(default_factory=set)
    # inputs the graph owns once called (a backward's donated saved tensors, Note: donated inputs,
    # donation.py): each dies at its last use, where a kernel may write over it
    donated_inputs: set[str] = field(default_factory=set)
    # size inputs of a graph with symbolic sizes: argument name -> its SymInt (Note: symbolic sizes)
    size_arguments: dict[str, Any] = field(default_factory=dict)
    # 0-d CPU inputs of a GPU graph that its Triton kernels take by value (Note: host scalars by
    # value, schedule/host_scalars.py)
    scalar_inputs: frozenset[str] = frozenset()
