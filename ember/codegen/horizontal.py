"""Stage `codegen`: a horizontal kernel's parts -> one kernel AST per part and the kernel's parameters
(Note: horizontal fusion, schedule/horizontal.py).

Each part is built as a kernel of its own (codegen/kernel.py: its buffers renamed p0, p1, ...), so
identical parts (an optimizer's updates of tensors of one shape) have one AST, generated once. The
kernel's parameters are every part's buffers once each (a buffer two parts read, a learning rate,
is one parameter); `renames` gives each part's parameter names in the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.codegen.kernel import KernelAST, build_kernel_ast
from ember.ir import Buffer
from ember.schedule import KernelStep


@dataclass(frozen=True)
class HorizontalAST:
    parts: tuple[KernelAST, ...]
    params: tuple[str, ...]  # wrapper buffer name of the kernel's parameter i
    renames: tuple[dict[str, str], ...]  # per part: its parameter name -> the kernel's
    inplace: dict[str, str]  # output buffer -> dying input it overwrites, over every part

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset(rename[p] for part, rename in zip(self.parts, self.renames) for p in part.outputs)

    def arguments(self, kernel_params: list[tuple[str, object, bool]]) -> tuple[str, ...]:
        """The wrapper buffers to pass, for the rendered kernel's parameters (see KernelAST.arguments)."""
        return tuple(self.params[int(name[1:])] for name, _, _ in kernel_params)


def build_horizontal_ast(step: KernelStep, dying: dict[str, Buffer] | None = None) -> HorizontalAST:
    """A part may write over a dying input (Note: in-place kernels, codegen/kernel.py) only when no
    other part reads it: the parts run at once, in any order."""
    dying = dying or {}
    reads = [set(part.reads) for part in step.parts]
    asts = []
    for i, part in enumerate(step.parts):
        others = set().union(*(r for j, r in enumerate(reads) if j != i))
        mine = {name: buffer for name, buffer in dying.items() if name not in others}
        asts.append(build_kernel_ast(part.group, part.stored, mine, part.alignment, part.bodies))
    params = list(dict.fromkeys(name for ast in asts for name in ast.params))
    position = {name: i for i, name in enumerate(params)}
    renames = tuple({f"p{i}": f"p{position[name]}" for i, name in enumerate(ast.params)} for ast in asts)
    inplace = {out: victim for ast in asts for out, victim in ast.inplace.items()}
    return HorizontalAST(tuple(asts), tuple(params), renames, inplace)
