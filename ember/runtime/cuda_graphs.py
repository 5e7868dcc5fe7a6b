"""Runtime: a compiled CUDA graph's launches recorded once as a CUDA graph and replayed.

Takes the loaded wrapper's `call` (boxed: a list of inputs in, a list of outputs out) and gives a
callable of the same kind. Used when `config.cuda_graphs` is on (EMBER_CUDA_GRAPHS=1, or
`torch.compile(..., backend="ember", mode="reduce-overhead")`).

Note: CUDA graphs
    A small model's call is dominated by launching its kernels (a few microseconds of Python and
    driver work each); a CUDA graph launches all of them at once. Replaying one is correct only
    while every address it baked in holds what this call means, so a `CudaGraphRunner`:
      - runs the first call as is (a warm-up: Triton's autotuning, cuBLAS's workspace, lazily
        moved constants), watching what the call does that a graph cannot replay: CPU tensor
        inputs other than 0-d ones, a random seed taken by value (see below). Such a graph runs
        as is ever after, with one warning naming why. A 0-d CPU tensor (a scalar eager mixes in,
        as a loss's count of targets) is a static input from the start, on the device;
      - records at the second call. An input is read where it lies (its address is baked in)
        until a call brings it at another address: from then on it is copied into a buffer of
        the recording (a "static input") before each replay, and the graph is recorded again.
        Parameters and a backward's saved activations keep their addresses, so they are never
        copied; a fresh batch is. An input the graph writes into is always read where it lies
        (a copy would take the write), so a new address for it records the graph again;
      - returns outputs that stay right while the user holds them (Note: outputs lent or copied):
        an output is either copied out of the recording's memory at every call, or lent as it
        lies, and the next call replays into a lent one only once nothing outside the runner
        holds its storage (the storage's use count, as runtime/memory.py's pool checks); while
        one is held, the call uses another recording (at most `MAX_RECORDINGS`, each with its own
        memory pool) or, past that, runs without a graph. Outputs that alias an input are
        rebuilt as views of the caller's input. Outputs that share a storage still share one;
      - checks the kernels' error flags after each replay (the flags live in the recording; their
        zeroing is recorded too), so a bad index still raises;
      - orders replays from several threads: one lock per runner around picking a recording,
        copying inputs and replaying, and each replay's stream waits for the previous replay of
        that recording to finish (static inputs are overwritten only after it read them).
    Every recording, replay and refusal is counted in `ember.metrics` (cuda_graph_*).

Note: random numbers in CUDA graphs
    ember's Triton kernels take the random seed by value (an int argument: no device buffer to
    fill per call), which a recording would bake in, repeating the same dropout mask at every
    replay. With CUDA graphs on (`config.cuda_graphs`, in the cache key), the seed is a one-element
    device buffer the kernels load instead (compile_triton.py `seed_in_memory`): the wrapper's
    `random_seed_on` fills a fresh one per call, and while recording hands out a buffer of the
    recording, which `_replay` fills with a fresh draw from torch's generator before each replay,
    on the replay's stream. So dropout-trained models replay, and `torch.manual_seed` still
    reproduces a run. A graph compiled with the seed by value refuses recording, as before.

Note: outputs lent or copied
    Copying an output out costs a copy and, for the graph that reads it next, a copy in (it comes
    at a new address each call); lending it costs nothing but blocks the recording while the
    user holds it. What a training step's graphs hand each other is dropped by the next call:
    a forward's saved activations (autograd frees them in the backward) and a backward's
    gradients (`zero_grad` drops them before the next backward). So those are lent, and the
    backward and the optimizer read them where they lie, with no copy at all; the outputs a
    user sees (`visible_outputs`: the leading ones, a forward's loss or logits) are copied when
    their storage is at most `COPY_OUT_BYTES`, as a user may keep them (a list of losses). A
    small lent output found still held at a later call (gradients kept by `zero_grad(set_to_none
    =False)`, or kept by hand) is copied from then on, and the recordings it blocks are dropped,
    so each such output costs one recording more, once. Large outputs are always lent: copying
    them would cost more than a recording.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.metrics import metrics
from ember.wrapper.runtime import capture_state, current_stream_object, draw_seed, report_earlier_gpu_errors

log = logging.getLogger("ember")

COPY_OUT_BYTES = 1 << 20  # outputs on storages this small are copied out at every call
MAX_RECORDINGS = 4  # recordings per runner (each holds its own memory pool)

# Storages that recordings hand out as outputs (a forward's saved activations), by address: a
# graph reading one (the backward) records again when it moves rather than copying it at every
# call, since it moves only when its producer records again.
_recorded_outputs: dict[int, int] = {}  # storage data_ptr -> how many live recordings hold it
_recorded_lock = threading.Lock()


def _hold_outputs(storages: list[torch.UntypedStorage]) -> list[int]:
    pointers = [s.data_ptr() for s in storages]
    with _recorded_lock:
        for p in pointers:
            _recorded_outputs[p] = _recorded_outputs.get(p, 0) + 1
    return pointers


def _release_outputs(pointers: list[int]) -> None:
    with _recorded_lock:
        for p in pointers:
            if _recorded_outputs.get(p, 0) <= 1:
                _recorded_outputs.pop(p, None)
            else:
                _recorded_outputs[p] -= 1


def _is_recorded_output(x: torch.Tensor) -> bool:
    with _recorded_lock:
        return x.untyped_storage().data_ptr() in _recorded_outputs


def _use_count(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


@dataclass
class _Output:
    """How one output is rebuilt after a replay."""

    kind: str  # "value" (not a tensor), "input" (a view of input `index`), "copied" or "held" (in the pool)
    value: Any = None
    index: int = 0  # the input it views, or the pool storage it lies on
    size: tuple = ()
    stride: tuple = ()
    offset: int = 0  # in elements, from the start of its storage
    dtype: torch.dtype | None = None
    layout: dict = field(default_factory=dict)  # where it is rebuilt (`_lay_out`)


@dataclass
class _Recording:
    graph: torch.cuda.CUDAGraph
    inputs: list  # its static buffers of the copied inputs (None for those read where they lie)
    addresses: dict[int, tuple]  # input index -> (data_ptr, shape, stride) baked in (read where they lie),
    # or ("value", v) for a non-tensor input (its value is baked in)
    copied: list[int]  # the inputs copied into static buffers before each replay
    storages: list[torch.UntypedStorage]  # pool storages the outputs lie on
    outputs: list[_Output]
    error_checks: list = field(default_factory=list)  # (GpuErrorFlags, errors, deferred) recorded in it
    seeds: list = field(default_factory=list)  # its random seeds' device buffers, drawn afresh per replay
    lent: list[int] = field(default_factory=list)  # storages its last replay lent out (Note: outputs lent or copied)
    held: list[int] = field(init=False)  # storages each replay lends out (the others' outputs are copied)
    done: torch.cuda.Event | None = None  # recorded after its last replay
    copy_out: _CopyOut | None = None  # how its small outputs are copied out (Note: one copy per replay)
    device: torch.device = torch.device("cuda")  # the device it was recorded on (current then)

    def __post_init__(self) -> None:  # `addresses` split for a quick `matches`, the per-call test
        self._tensors = [(i, *placed) for i, placed in self.addresses.items() if placed[0] != "value"]
        self._values = [(i, placed) for i, placed in self.addresses.items() if placed[0] == "value"]
        self.held = _lent_storages(self.outputs)

    def matches(self, args: list) -> bool:
        for i, pointer, shape, stride in self._tensors:
            x = args[i]
            if not isinstance(x, torch.Tensor) or x.data_ptr() != pointer or x.stride() != stride or x.shape != shape:
                return False
        return all(_placement(args[i]) == placed for i, placed in self._values)

    def outputs_free(self) -> bool:
        """Nothing outside the runner holds a storage its last replay lent out."""
        return all(_use_count(self.storages[i]) == 1 for i in self.lent)

    def kept_by_users(self) -> set[int]:
        """The storages its last replay lent out that someone still holds."""
        return {i for i in self.lent if _use_count(self.storages[i]) > 1}

    def copy_from_now_on(self, kept: set[int]) -> None:
        """Copy the outputs on storages `kept` out at every replay instead of lending them."""
        for o in self.outputs:
            if o.kind == "held" and o.index in kept:
                o.kind = "copied"
        self.held = _lent_storages(self.outputs)  # (`lent` keeps the last replay's, still out)
        self.copy_out = _CopyOut.plan(self.storages, self.outputs)
        _lay_out(self.outputs, self.copy_out)


def _placement(x: Any) -> tuple:
    if not isinstance(x, torch.Tensor):
        return ("value", x)
    return x.data_ptr(), tuple(x.shape), tuple(x.stride())


class CudaGraphRunner:
    """`call` replayed from CUDA graphs (Note: CUDA graphs). `mutated_inputs`: the indices of the
    inputs the graph writes into."""

    def __init__(self, call: Callable, mutated_inputs: frozenset[int], name: str,
                 visible_outputs: int | None = None) -> None:  # fmt: skip
        self.call, self.mutated_inputs, self.name = call, mutated_inputs, name
        self.visible_outputs = visible_outputs  # the leading outputs a user sees (None: all); the rest are lent
        self._kept: set[int] = set()  # output storages found held at a later call: copied from then on
        self._boxed_call = True
        for attribute in ("wrapper_path", "summary"):
            if hasattr(call, attribute):
                setattr(self, attribute, getattr(call, attribute))
        self._lock = threading.Lock()
        self._warmed_up = False
        self.refused: str | None = None  # why this graph runs without a CUDA graph
        self._copied: set[int] = set()  # inputs copied into static buffers (they moved between calls)
        self._recordings: list[_Recording] = []
        self._records = 0

    def __call__(self, args: list) -> list:
        if self.refused is not None:
            return self.call(args)
        with self._lock:
            if not self._warmed_up:
                return self._warm_up(args)
            recording = self._pick(args)
            if recording is None:
                metrics.add(cuda_graph_skips=1)
                return self.call(args)
            return self._replay(recording, args)

    def _warm_up(self, args: list) -> list:
        on_host = [(i, x) for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.device.type != "cuda"]
        scalars = {i for i, x in on_host if x.dim() == 0 and i not in self.mutated_inputs}
        host = [f"input {i} (shape {tuple(x.shape)}, {x.dtype}) is on {x.device}"
                for i, x in on_host if i not in scalars]  # fmt: skip
        self._copied |= scalars  # 0-d host tensors: copied to a device buffer of the recording before each replay
        probe = capture_state.probe = _Probe()
        try:
            outputs = self.call(args)
        finally:
            capture_state.probe = None
        self._warmed_up = True
        if host:
            self.refuse(f"{host[0]} (a CUDA graph reads device memory only)")
        elif probe.random:
            self.refuse("it draws random numbers with a seed its kernels take by value (compiled without "
                         "cuda_graphs), so a replay would repeat the same numbers")  # fmt: skip
        return outputs

    def refuse(self, reason: str) -> None:
        """Run this graph without CUDA graphs from now on, saying why once."""
        self.refused = reason
        metrics.add(cuda_graph_refusals=1)
        log.warning("ember: %s graph runs without CUDA graphs: %s", self.name, reason)

    def _pick(self, args: list) -> _Recording | None:
        """A recording this call can replay, recording one if none can."""
        moved = False
        for recording in self._recordings:
            if not recording.matches(args):
                moved = True
                continue
            if recording.outputs_free():
                return recording
            self._copy_kept_outputs(recording)
        if moved:  # an input came at another address: copy it from now on, unless the graph writes it or
            # another recording made it (it moves only when that one records again)
            for recording in self._recordings:
                self._copy_moved_inputs(recording, args)
        if self._records >= MAX_RECORDINGS * 2:
            if self._records == MAX_RECORDINGS * 2:
                self._records += 1
                log.warning(
                    "ember: %s graph recorded %d times (inputs keep moving, or outputs are held); "
                    "later calls that match no recording run without a graph",
                    self.name,
                    MAX_RECORDINGS * 2,
                )
            return None
        fresh = self._record(args)
        if fresh is not None:  # recordings that read a now-copied input where it lay are obsolete
            kept = [r for r in self._recordings if not r.addresses.keys() & self._copied]
            self._recordings = kept[-(MAX_RECORDINGS - 1) :] + [fresh]
        return fresh

    def _copy_moved_inputs(self, recording: _Recording, args: list) -> None:
        moved = {i for i, placed in recording.addresses.items() if _placement(args[i]) != placed
                 and isinstance(args[i], torch.Tensor) and i not in self.mutated_inputs
                 and not _is_recorded_output(args[i])}  # fmt: skip
        for i in sorted(moved - self._copied):
            log.debug("ember: %s graph: input %d (shape %s, %s) moved: copied in before each replay from now on",
                      self.name, i, tuple(args[i].shape), args[i].dtype)  # fmt: skip
        self._copied |= moved

    def _copy_kept_outputs(self, blocked: _Recording) -> None:
        """Small outputs still held from `blocked`'s last replay are copied from now on, by every
        recording, and recordings only they block are dropped (Note: outputs lent or copied)."""
        kept = {i for i in blocked.kept_by_users() if blocked.storages[i].nbytes() <= COPY_OUT_BYTES}
        if not kept - self._kept:
            return
        self._kept |= kept
        metrics.add(cuda_graph_outputs_kept=len(kept))
        for recording in self._recordings:
            recording.copy_from_now_on(kept)
        self._recordings = [r for r in self._recordings if not _blocked_only_by(r.kept_by_users(), self._kept)]

    def _record(self, args: list) -> _Recording | None:
        inputs = list(args)
        addresses, copied = {}, []
        for i, x in enumerate(args):
            if isinstance(x, torch.Tensor) and i in self._copied:
                device = x.device if x.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
                inputs[i] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device).copy_(x)
                copied.append(i)
            else:
                addresses[i] = _placement(x)
        graph = torch.cuda.CUDAGraph()
        checks: list = []
        seeds: list = []
        capture_state.recorder, capture_state.seeds = checks, seeds
        try:
            with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local"):
                outputs = self.call(list(inputs))
        except Exception as e:  # a graph that cannot be recorded runs as it is
            self.refuse(f"recording failed: {type(e).__name__}: {e}")
            return None
        finally:
            capture_state.recorder, capture_state.seeds = None, None
        self._records += 1
        metrics.add(cuda_graphs_recorded=1)
        storages, rebuilt = _describe_outputs(outputs, inputs, self.visible_outputs, self._kept)
        # only its own buffers are kept: a reference to an input read where it lies would hold that
        # input's storage, and so block the recording that lent it (its forward) for good
        static = [x if i in copied else None for i, x in enumerate(inputs)]
        recording = _Recording(graph, static, addresses, copied, storages, rebuilt, checks, seeds)
        recording.copy_out = _CopyOut.plan(storages, rebuilt)
        _lay_out(rebuilt, recording.copy_out)
        recording.device = torch.device("cuda", torch.cuda.current_device())
        weakref.finalize(recording, _release_outputs, _hold_outputs([storages[i] for i in recording.held]))
        return recording

    def _replay(self, recording: _Recording, args: list) -> list:
        report_earlier_gpu_errors()  # (a replay runs no wrapper call, which would read them)
        stream = current_stream_object(recording.device)
        if recording.done is not None:
            stream.wait_event(recording.done)
        else:
            recording.done = torch.cuda.Event()
        _copy_static_inputs(recording, args)
        for seed in recording.seeds:  # Note: random numbers in CUDA graphs
            seed.fill_(draw_seed())
        recording.graph.replay()
        outputs = _rebuild_outputs(recording, args)
        recording.lent = recording.held
        recording.done.record(stream)
        metrics.add(cuda_graph_replays=1)
        for flags, errors, deferred in recording.error_checks:
            flags.check(errors, deferred)
        args.clear()
        return outputs


def _lent_storages(outputs: list[_Output]) -> list[int]:
    return sorted({o.index for o in outputs if o.kind == "held"})


def _blocked_only_by(held: set[int], copied: set[int]) -> bool:
    return bool(held) and held <= copied


class _Probe:
    """What a warm-up call did that a recording cannot replay (set by wrapper/runtime.py)."""

    random = False


def _describe_outputs(outputs, inputs: list, visible: int | None,
                      kept: set[int]) -> tuple[list[torch.UntypedStorage], list[_Output]]:  # fmt: skip
    """How each output of a recording is handed out (Note: outputs lent or copied): copied when
    its storage is small and a user sees an output on it (`visible`: the leading outputs a user
    sees, None for all) or kept one (`kept`: storage positions), else lent."""
    input_storages = {x.untyped_storage().data_ptr(): i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)}
    storages: list[torch.UntypedStorage] = []
    by_pointer: dict[int, int] = {}
    described = []
    seen_by_users: set[int] = set()
    for position, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            described.append(_Output("value", value=out))
            continue
        storage = out.untyped_storage()
        layout: dict[str, Any] = dict(
            size=tuple(out.shape), stride=tuple(out.stride()), offset=out.storage_offset(), dtype=out.dtype
        )
        if storage.data_ptr() in input_storages:
            index = input_storages[storage.data_ptr()]
            layout["offset"] -= inputs[index].storage_offset()
            described.append(_Output("input", index=index, **layout))
            continue
        if storage.data_ptr() not in by_pointer:
            by_pointer[storage.data_ptr()] = len(storages)
            storages.append(storage)
        index = by_pointer[storage.data_ptr()]
        if visible is None or position < visible:
            seen_by_users.add(index)
        described.append(_Output("held", index=index, **layout))
    copied = {i for i in seen_by_users | kept if i < len(storages) and storages[i].nbytes() <= COPY_OUT_BYTES}
    for o in described:
        if o.kind == "held" and o.index in copied:
            o.kind = "copied"
    return storages, described


def _copy_static_inputs(recording: _Recording, args: list) -> None:
    """The moved inputs into the recording's buffers: the device ones in one launch."""
    on_device = [i for i in recording.copied if args[i].device.type == "cuda"]
    metrics.add(cuda_graph_input_copies=len(on_device))
    if on_device:
        torch._foreach_copy_([recording.inputs[i] for i in on_device], [args[i] for i in on_device])
    for i in recording.copied:
        if args[i].device.type != "cuda":  # a 0-d host tensor
            recording.inputs[i].fill_(args[i].item())


# Note: one copy per replay
#   A replay's small outputs are copied out of the recording's memory (Note: CUDA graphs), and a
#   training step's backward has one per parameter: a storage allocated and a copy launched for
#   each cost about 14 us of CPU apiece, more than the replay itself. `_CopyOut` packs them
#   instead into one fresh buffer per replay, each at a 256-byte aligned offset (as the caching
#   allocator aligns its own), filled by one `_foreach_copy_` of the recording's storages'
#   bytes; each output is a tensor of its own on that buffer (none is a view of another, and
#   writing one in place touches no other). A user holding one keeps the buffer alive, which is
#   at most the sum of the small outputs.
COPY_OUT_ALIGNMENT = 256


@dataclass
class _CopyOut:
    sources: list[torch.Tensor]  # each copied storage's bytes, as a uint8 tensor
    offsets: list[int]  # where each lands in the packed buffer, in bytes
    total: int
    slot: dict[int, int]  # storage index -> its position in `sources`

    @staticmethod
    def plan(storages: list[torch.UntypedStorage], outputs: list[_Output]) -> _CopyOut | None:
        copied = sorted({o.index for o in outputs if o.kind == "copied"})
        if not copied:
            return None
        sources, offsets, total = [], [], 0
        for i in copied:
            storage = storages[i]
            as_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device)
            sources.append(as_bytes.set_(storage, 0, (storage.nbytes(),)))
            offsets.append(total)
            total += -(-storage.nbytes() // COPY_OUT_ALIGNMENT) * COPY_OUT_ALIGNMENT
        return _CopyOut(sources, offsets, total, {i: k for k, i in enumerate(copied)})

    def run(self) -> torch.Tensor:
        packed = torch.empty(self.total, dtype=torch.uint8, device=self.sources[0].device)
        targets = [packed[offset : offset + source.numel()] for offset, source in zip(self.offsets, self.sources)]
        torch._foreach_copy_(targets, self.sources)
        return packed


def _rebuild_outputs(recording: _Recording, args: list) -> list:
    packed = None
    if recording.copy_out is not None:
        packed = recording.copy_out.run().untyped_storage()
        metrics.add(cuda_graph_output_copies=len(recording.copy_out.sources))
    outputs = []
    for o in recording.outputs:
        if o.kind == "value":
            outputs.append(o.value)
        elif o.kind == "input":
            x = args[o.index]
            outputs.append(x.as_strided(o.size, o.stride, x.storage_offset() + o.offset))
        else:
            storage = packed if o.kind == "copied" else recording.storages[o.index]
            assert storage is not None
            outputs.append(_tensor_on(storage, o.layout))
    return outputs


def _tensor_on(storage: torch.UntypedStorage, layout: dict) -> torch.Tensor:
    """A tensor of `layout` (dtype, size, stride, storage_offset) on `storage`: torch's C helper,
    a third of the cost of an empty tensor `set_` there (an output per parameter per replay)."""
    if _construct_tensor is not None and storage.is_cuda:
        return _construct_tensor(layout, storage)
    empty = torch.empty(0, dtype=layout["dtype"], device=storage.device)
    return empty.set_(storage, layout["storage_offset"], layout["size"], layout["stride"])


_construct_tensor = getattr(torch._C, "_construct_CUDA_Tensor_From_Storage_And_Metadata", None)


def _lay_out(outputs: list[_Output], copy_out: _CopyOut | None) -> None:
    """Each tensor output's layout where `_rebuild_outputs` builds it: in its pool storage, or at
    its place in the buffer its storage is copied into."""
    for o in outputs:
        if o.kind not in ("held", "copied"):
            continue
        assert o.dtype is not None
        offset = o.offset
        if o.kind == "copied":
            assert copy_out is not None
            offset += copy_out.offsets[copy_out.slot[o.index]] // o.dtype.itemsize
        o.layout = {"dtype": o.dtype, "size": o.size, "stride": o.stride, "storage_offset": offset}
