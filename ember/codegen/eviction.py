"""Stage `codegen` (GPU): which loads of a block program ask the cache to keep their lines, and
which to let them go first.

Note: cache hints for loads
    A GPU's L2 cache (50 MiB on an H100) keeps lines by recency, so a kernel that streams a large
    tensor through it pushes out lines that other programs, or a later pass of the same program,
    are about to read again. Triton's `tl.load` takes a hint, `eviction_policy`; the hints follow
    what is read again:
      - `evict_last` for a load whose positions depend on no program id and no x-axis position:
        every program reads the same lines (a layer norm's weight and bias);
      - `evict_last` for a load of a buffer that a later load of the program reads again (a
        looped reduction's first pass over a row that its normalizing pass reads again);
      - `evict_first` for the last of several loads of one buffer (that normalizing pass:
        nothing reads those lines again).
    Every other load reads its lines once and gets no hint. A hint changes what the cache keeps,
    never a value; Triton's interpreter ignores it.
"""

from __future__ import annotations

from ember.uop.ops import BlockAxis, Ops, UOp

KEEP, DROP = "evict_last", "evict_first"


def eviction_hints(program: list[UOp]) -> dict[UOp, str]:
    """The hint of each LOAD of the linearized block `program` that gets one."""
    loads = [u for u in program if u.op is Ops.LOAD]
    buffers = [load.src[0].src[0] for load in loads]
    varies: dict[UOp, bool] = {}
    hints = {}
    for i, (load, buffer) in enumerate(zip(loads, buffers)):
        read_again = buffer in buffers[i + 1 :]
        read_before = buffer in buffers[:i]
        if read_again or not _varies_with_x(load.src[0], varies):
            hints[load] = KEEP
        elif read_before:
            hints[load] = DROP
    return hints


def _varies_with_x(u: UOp, memo: dict[UOp, bool]) -> bool:
    """Whether `u`'s value depends on the program id or an x-axis position (iteratively: index
    expressions can be deep)."""
    stack = [u]
    while stack:
        top = stack[-1]
        if top in memo:
            stack.pop()
            continue
        if top.op is Ops.PROGRAM_ID or (top.op is Ops.ARANGE and top.arg.axis is BlockAxis.X):
            memo[top] = True
            stack.pop()
            continue
        pending = [s for s in top.src if s not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[top] = any(memo[s] for s in top.src)
        stack.pop()
    return memo[u]
