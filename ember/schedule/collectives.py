"""Stage `schedule`: collectives placed for overlap, and what their waits keep alive.

Takes the ordered steps (after fusion) and gives them with each collective moved as early and
each wait as late as the data allows, each wait naming the buffers its collective reads while in
flight (`ExternCall.keeps_alive`), and the overlap that resulted (`collective_overlaps`).

Note: collectives in the graph
    A functional collective is two externs (lower/collectives.py): the collective issues the
    communication and returns at once, `wait_tensor` blocks until it is done. Whatever runs
    between the two overlaps with the communication, so:
    - the steps are put in a topological order of their data dependencies (reads after writes,
      writes after reads and writes) that issues each collective as soon as its inputs are
      ready and takes a wait only when nothing else can run: whatever does not need a
      collective's result runs before its wait; the other steps keep their order where the data
      allows, and collectives keep theirs (every rank issues them in the same order: they
      compile the same graph);
    - until its wait returns, a collective may still read its inputs (NCCL on its own stream,
      gloo on its own thread), so the wait counts as a read of them: their last use, and with
      it their free, their reuse by the memory planner (wrapper/plan.py) and an in-place kernel
      writing over them (codegen/kernel.py `choose_inplace`), all come after the wait;
    - a collective's result is bound as aten returns it and only the wait's result is put in
      the layout kernels expect (a copy before the wait would read data still in flight);
    - a collective that mutates a buffer (`all_reduce_`, `..._out`) has its wait count as a
      write of that buffer, so its readers run after the wait (schedule/nodes.py).
    `collective_overlaps` says, per collective, which steps ran between it and its wait;
    `ember explain` prints it and `ember.metrics` counts collectives and overlapped kernels.
    `config.collective_overlap` off (EMBER_COLLECTIVE_OVERLAP=0) keeps the steps in the graph's
    order, waits still keeping their buffers alive: it measures what the reordering buys.

    Issued as early as the data allows, every all-gather of an FSDP forward goes out at its
    start (parameters are inputs): the gathered weights are alive from there on, and on 2 H100s
    the step was slower than with no reordering at all (SimpleFSDP, LLaMA 8 x 1024: 105.4 ms
    against 101.7; GPT-2 12 x 768: 120.3 against 147.1 but 400 MiB more peak). So at most
    `config.collectives_in_flight` collectives are issued and not waited for; the next is held
    back until a wait is taken (`_overlapping_order` says which). 9 measured best of 2, 4, 9, 18,
    24 and none on both models (LLaMA 97.7-98.2 ms, GPT-2 116.2; inductor 100.4-107.4 and 140.2):
    about a layer of a transformer's parameters, as FSDP2 prefetches one layer. To a gloo group
    the bound is 1 (Note: gloo runs collectives one at a time, lower/collectives.py).
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

from torch.utils._pytree import tree_flatten

from ember.ir import BufferRef, Communication, ExternCall


@dataclass(frozen=True)
class Overlap:
    """One collective of a schedule: where it is issued and waited for, and what runs between."""

    op: str
    start: int  # step index of the collective
    wait: int | None  # step index of its wait; None when this graph does not wait for it
    kernels: int  # ember kernels between the two
    externs: int  # other externs between the two (matmuls, ...), collectives and waits excluded


def is_start(step) -> bool:
    return isinstance(step, ExternCall) and step.communication is Communication.START


def is_wait(step) -> bool:
    return isinstance(step, ExternCall) and step.communication is Communication.WAIT


def argument_buffers(step: ExternCall) -> list[str]:
    refs, _ = tree_flatten((step.args, step.kwargs))
    return list(dict.fromkeys(r.name for r in refs if isinstance(r, BufferRef)))


def waited_collectives(steps: list) -> dict[int, int]:
    """Wait's step index -> the index of the collective whose result it waits for."""
    started = {b.name: i for i, step in enumerate(steps) if is_start(step) for b in step.outputs}
    found = {}
    for i, step in enumerate(steps):
        if is_wait(step):
            starts = [started[name] for name in argument_buffers(step) if name in started]
            if starts:
                found[i] = starts[0]
    return found


def place_collectives(steps: list, reads_of, writes_of, overlap: bool = True, in_flight: int = 0) -> list:
    """`steps` reordered for overlap (unless not `overlap`: in their order), each wait keeping its
    collective's inputs alive (Note: collectives in the graph). `reads_of`/`writes_of`: a step's
    buffers (mutated ones included); `in_flight`: the most collectives issued and not yet waited
    for (0: no bound)."""
    if not any(is_start(s) or is_wait(s) for s in steps):
        return steps
    steps = list(steps)
    start_of = waited_collectives(steps)  # the same indexes after the waits are replaced
    for i, start in start_of.items():
        outputs = {b.name for b in steps[start].outputs}
        steps[i] = dataclasses.replace(steps[i], keeps_alive=tuple(n for n in argument_buffers(steps[start])
                                                                   if n not in outputs))  # fmt: skip
    if not overlap:
        return steps
    effects = [(set(reads_of(s)), set(writes_of(s))) for s in steps]
    for i, start in start_of.items():  # what a collective mutates is done at its wait
        effects[i][1].update(effects[start][1] - {b.name for b in steps[start].outputs})
    order = _overlapping_order(steps, _predecessors(steps, effects), start_of, in_flight)
    return [steps[i] for i in order]


def _predecessors(steps: list, effects: list[tuple[set[str], set[str]]]) -> list[set[int]]:
    """Per step, the earlier steps it must follow: it reads what they write, writes what they read
    or write; and each collective follows the one before it."""
    preds: list[set[int]] = [set() for _ in steps]
    last_writer: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    for i, (reads, writes) in enumerate(effects):
        preds[i].update(last_writer[b] for b in reads | writes if b in last_writer)
        for b in writes:
            preds[i].update(r for r in readers.get(b, ()) if r != i)
        for b in reads:
            readers.setdefault(b, []).append(i)
        for b in writes:
            last_writer[b], readers[b] = i, []
    starts = [i for i, s in enumerate(steps) if is_start(s)]
    for before, after in zip(starts, starts[1:]):
        preds[after].add(before)
    return preds


def _overlapping_order(steps: list, preds: list[set[int]], start_of: dict[int, int], in_flight: int = 0) -> list[int]:
    """A topological order that issues each collective as soon as its inputs are ready and takes
    a wait only when nothing else can run; other steps keep their order where the data allows.
    With `in_flight` collectives issued and not waited for, the next one is held back until a
    wait is taken: at once if some wait's result is read by no step (a gradient's reduce-scatter,
    waited for only for the graph's outputs), else when nothing else can run (an all-gather whose
    parameter the next layer needs: then the gather `in_flight` ahead is issued, as FSDP2
    prefetches). `start_of`: wait -> its collective (`waited_collectives`)."""
    users: list[list[int]] = [[] for _ in steps]
    for i, before in enumerate(preds):
        for j in before:
            users[j].append(i)
    waiting = [len(p) for p in preds]
    bounded = set(start_of.values()) if in_flight > 0 else set()  # collectives whose wait this graph takes
    ready: list[tuple[int, int]] = []  # (0 for a collective, 1 otherwise; step index)
    waits: list[int] = []  # ready waits whose result some step reads
    unread_waits: list[int] = []  # and those whose result only the graph's outputs are
    held: int | None = None  # a collective kept back while `in_flight` are

    def make_ready(i: int) -> None:
        if is_wait(steps[i]):
            heapq.heappush(unread_waits if not users[i] else waits, i)
        else:
            heapq.heappush(ready, (0 if is_start(steps[i]) else 1, i))

    def oldest_wait() -> int:
        if unread_waits and (not waits or unread_waits[0] < waits[0]):
            return heapq.heappop(unread_waits)
        return heapq.heappop(waits)

    for i, n in enumerate(waiting):
        if n == 0:
            make_ready(i)
    order, issued = [], 0
    while ready or waits or unread_waits or held is not None:
        if held is not None and (issued < in_flight or not (ready or waits or unread_waits)):
            i, held = held, None
        elif held is not None and unread_waits:
            i = heapq.heappop(unread_waits)
        elif ready:
            i = heapq.heappop(ready)[1]
            if i in bounded and issued >= in_flight:
                held = i
                continue
        else:
            i = oldest_wait()
        order.append(i)
        issued += 1 if i in bounded else -1 if start_of.get(i) in bounded else 0
        for user in users[i]:
            waiting[user] -= 1
            if waiting[user] == 0:
                make_ready(user)
    assert len(order) == len(steps), "the steps' dependencies have a cycle"
    return order


def most_in_flight(overlaps: list[Overlap], steps: int) -> int:
    """The most collectives issued and not yet waited for at once, over `steps` ordered steps
    (one not waited for in its graph counts to the end)."""
    in_flight = [0] * (steps + 1)
    for o in overlaps:
        in_flight[o.start] += 1
        in_flight[o.wait if o.wait is not None else steps] -= 1
    most = running = 0
    for change in in_flight:
        running += change
        most = max(most, running)
    return most


def collective_overlaps(steps: list) -> list[Overlap]:
    """Per collective of the ordered `steps`, what runs between it and its wait."""
    waits = {start: wait for wait, start in waited_collectives(steps).items()}
    overlaps = []
    for i, step in enumerate(steps):
        if not is_start(step):
            continue
        between = steps[i + 1 : waits[i]] if i in waits else []
        kernels = sum(1 for s in between if not isinstance(s, ExternCall))
        externs = sum(1 for s in between if isinstance(s, ExternCall) and s.communication is None)
        overlaps.append(Overlap(str(step.op), i, waits.get(i), kernels, externs))
    return overlaps
