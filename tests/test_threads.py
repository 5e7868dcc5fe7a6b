"""Compiled graphs called from several threads at once: every piece of process-wide state
(error flags, kernel loaders, launchers, searches, specializations, metrics) gives each call
its own answer. Races are forced where a bad interleaving can be built (barriers at the
point that used to be unguarded), and stressed with many threads elsewhere; every result is
checked against eager. The buffer pool's own tests are in test_buffer_pool.py."""

import os
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.wrapper import runtime as wrapper_runtime
from tests.helpers import compile_fn, run_threads

interpreter_only = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter needs TRITON_INTERPRET=1 at start-up"
)
BACKENDS = ["cpp", pytest.param("triton", marks=interpreter_only)]


@pytest.fixture
def backend(request, monkeypatch):
    monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")
    if request.param == "triton":
        monkeypatch.setenv("EMBER_BACKEND", "triton")
    return request.param


def embed_twice(w, i):
    return F.embedding(i, w) * 2


# ---- kernel error flags --------------------------------------------------------------------


def valid_checks_first(monkeypatch, flag_class) -> None:
    """Both threads have run their kernels before either reads its flag, and the thread with
    valid indices ("worker-0") reads first: were the flag shared, it would see the other's error."""
    barrier, valid_read = threading.Barrier(2, timeout=60), threading.Event()
    check = flag_class.check

    def check_in_order(self, errors, **deferred):
        barrier.wait()
        valid = threading.current_thread().name == "worker-0"
        if not valid:
            assert valid_read.wait(60)
        try:
            return check(self, errors, **deferred)
        finally:
            if valid:
                valid_read.set()

    monkeypatch.setattr(flag_class, "check", check_in_order)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_each_call_reads_only_its_own_kernel_errors(monkeypatch, backend):
    weight, good, bad = torch.randn(10, 4), torch.tensor([1, 9, 3]), torch.tensor([1, 10, 3])
    fn = compile_fn(embed_twice)
    torch.testing.assert_close(fn(weight, good), embed_twice(weight, good))  # compiled before the threads
    flag_class = wrapper_runtime.GpuErrorFlags if backend == "triton" else wrapper_runtime.KernelErrorFlag
    valid_checks_first(monkeypatch, flag_class)
    outcome = {}

    def worker(i):
        try:
            outcome[i] = fn(weight, good if i == 0 else bad)
        except IndexError as e:
            outcome[i] = e

    run_threads(worker, 2)
    assert isinstance(outcome[0], torch.Tensor), f"valid indices raised {outcome[0]!r}"
    torch.testing.assert_close(outcome[0], embed_twice(weight, good))
    assert isinstance(outcome[1], IndexError), "an index out of range returned rows"


def test_errors_stay_with_their_calls_under_stress():
    """Three threads with valid indices, one with an index out of range, 150 calls each."""
    weight, good, bad = torch.randn(64, 256), torch.randint(0, 64, (512,)), torch.randint(0, 64, (512,))
    bad[300] = 64
    fn = compile_fn(embed_twice)
    want = embed_twice(weight, good)
    # compiled before the threads, so each call runs the compiled graph (Threads, README)
    torch.testing.assert_close(fn(weight, good), want)
    wrong = wrong_outcomes(fn, weight, good, bad, want, calls=150)
    assert not wrong, f"{len(wrong)} wrong outcomes, e.g. {wrong[:3]}"


@pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.13",
    reason="before torch 2.13 dynamo's compiling flag is off between its compiles, so torch raises its "
    "nested-FX-trace error in the other thread, before ember runs (README: Threads)",
)
@interpreter_only
@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_gpu_error_flags_are_lent_again_zeroed_and_per_thread(backend):
    """Note: error flags lent per thread (the interpreter's rows live on the CPU): a thread's calls
    borrow one flag set, zeroed after a call whose kernels reported an error, so the next valid
    call raises nothing; threads alternating valid and bad indices, their calls interleaved, each
    get their own outcomes from sets of their own. (Calls overlapping in time, each reading only its
    own rows: test_each_call_reads_only_its_own_kernel_errors.)"""
    import ember

    weight, good, bad = torch.randn(10, 4), torch.tensor([1, 9, 3]), torch.tensor([1, 10, 3])
    fn = compile_fn(embed_twice)
    want = embed_twice(weight, good)
    torch.testing.assert_close(fn(weight, good), want)
    made = ember.metrics.gpu_error_flag_sets  # 1, or 0 where this thread's earlier test left one
    assert made <= 1
    for _ in range(4):
        with pytest.raises(IndexError, match="index 10"):
            fn(weight, bad)
        torch.testing.assert_close(fn(weight, good), want)
    assert ember.metrics.gpu_error_flag_sets == made
    wrong, interpreter = [], threading.Lock()  # Triton's interpreter runs one kernel at a time

    def worker(i):
        for call in range(12):
            valid = (call + i) % 2 == 0
            try:
                with interpreter:
                    got = fn(weight, good if valid else bad)
                if not torch.equal(got, want) or not valid:
                    wrong.append((i, call, "rows"))
            except IndexError:
                if valid:
                    wrong.append((i, call, "IndexError"))

    run_threads(worker, 4)
    assert not wrong, wrong
    assert ember.metrics.gpu_error_flag_sets <= made + 4  # at most one more per thread


@pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13),
    reason="before torch 2.13 dynamo refuses any compiled call while another thread traces (README, Threads)",
)
def test_a_call_while_another_thread_traces_a_graph_runs_compiled(monkeypatch):
    """AOTAutograd's trace sets torch.fx's process-wide tracing flag, under which dynamo refuses
    to run a compiled function ("FX to symbolically trace a dynamo-optimized function"); since
    torch 2.13 dynamo also holds its process-wide compiling flag for the whole compile session,
    and the refusal needs the first without the second. A call from another thread made from
    inside the trace (a decomposition ember runs there) must get its result (Threads, README)."""
    from ember.lower import decompositions

    seen = {}
    x, y = torch.randn(8), torch.randn(2, 4, 3)
    traced = compile_fn(lambda y: F.group_norm(y, 2))
    ready = torch.compile(lambda x: x * 2 + 1, backend="ember", dynamic=False)  # no dynamo reset after it
    ready(x)

    def call_ready():
        try:
            seen["result"] = ready(x)
        except Exception as e:  # noqa: BLE001 - reported by the test
            seen["result"] = e

    def decomposition_calling_from_another_thread(*args):
        seen["tracing"] = torch.fx._symbolic_trace._is_fx_tracing_flag
        caller = threading.Thread(target=call_ready)
        caller.start()
        caller.join(timeout=120)  # a call that had to compile would wait for this compile's lock
        return decompositions.native_group_norm(*args)

    monkeypatch.setitem(decompositions.CORRECTED, torch.ops.aten.native_group_norm.default,
                        decomposition_calling_from_another_thread)  # fmt: skip
    decompositions.decomposition_table.cache_clear()
    try:
        torch.testing.assert_close(traced(y), F.group_norm(y, 2))
    finally:
        monkeypatch.undo()
        decompositions.decomposition_table.cache_clear()
    assert seen["tracing"], "the decomposition ran outside an FX trace: the test tests nothing"
    assert isinstance(seen.get("result"), torch.Tensor), f"the other thread's call: {seen.get('result')!r}"
    torch.testing.assert_close(seen["result"], x * 2 + 1)


def wrong_outcomes(fn, weight, good, bad, want, calls: int, start: threading.Barrier | None = None) -> list:
    """Four threads call `fn` `calls` times each, thread 3 with the bad indices: the calls that
    returned rows where they should raise, or raised where they should return `want`."""
    wrong = []

    def worker(i):
        if start is not None:
            start.wait()
        for _ in range(calls):
            try:
                got = fn(weight, bad if i == 3 else good)
                if i == 3 or not torch.equal(got, want):
                    wrong.append((i, "rows"))
            except IndexError:
                if i != 3:
                    wrong.append((i, "IndexError"))
            except RuntimeError as e:
                # torch 2.11: dynamo's entry check reads FX's process-wide tracing flag, which the
                # thread compiling the graph sets while AOTAutograd traces; this call never started
                if "symbolically trace a dynamo-optimized function" not in str(e):
                    raise

    run_threads(worker, 4)
    return wrong


# ---- the Triton launcher (a stand-in module: the fast launch path runs only on a GPU) -------


class StandInKernel:
    """What ember's compile gives (runtime/triton_compile.py): a compiled kernel that records how
    it is run and the block sizes it was compiled for."""

    def __init__(self, blocks: dict, runs: list) -> None:
        self.blocks, self.runs = tuple(blocks.values()), runs
        self.function = self.packed_metadata = None

    def run(self, grid, _y, _z, _stream, _function, _metadata, _a, _b, _c, *args):
        self.runs.append((grid, args[-len(self.blocks) :], self.blocks))


@pytest.fixture
def stand_in_launcher(monkeypatch):
    from ember.runtime import triton as triton_runtime

    runs: list = []
    module = type("StandInModule", (), {"k_pointwise": object(), "_sha256": "0" * 64})
    monkeypatch.setattr(triton_runtime, "torch_cuda_current_device", lambda: 0)
    monkeypatch.setattr(triton_runtime, "raw_stream", lambda device: 0)
    monkeypatch.setattr(triton_runtime, "stream_getter", lambda: lambda device: 0)
    monkeypatch.setattr(triton_runtime, "device_facts", lambda device: (("cuda", 90, 32), "stand-in GPU"))
    monkeypatch.setattr(triton_runtime, "compile_kernel",
                        lambda fn, request: StandInKernel(dict(request.constexprs), runs))  # fmt: skip
    launcher = triton_runtime.TritonLauncher(module, "k", ["pointwise"], 4096, 0, [0], interpret=False,
                                             autotune=False)  # fmt: skip
    return launcher, runs


def test_a_trial_launch_never_changes_what_other_calls_run(stand_in_launcher):
    """A benchmark (another thread's first call) launches other configurations on the launcher:
    the fast path of every later call still runs the chosen one's grid and block sizes."""
    from ember.runtime.triton import LaunchConfig

    launcher, runs = stand_in_launcher
    t = torch.zeros(4096)
    launcher(t)  # chooses (XBLOCK 1024: a grid of 4) and compiles for this alignment
    launcher.trial(LaunchConfig("pointwise", 256, 0, 2), (t,), ("cuda", 90, 32))()  # as `benchmark` runs them
    assert runs[-1] == (16, (256,), (256,))
    runs.clear()
    launcher(t)
    assert runs, "the second call took the fast path"
    for grid, blocks, compiled_for in runs:
        assert (grid, blocks) == (4, (1024,)) and compiled_for == (1024,)


def test_a_kernel_taking_numbers_takes_the_fast_path_after_its_first_launch(stand_in_launcher, monkeypatch):
    """Note: the fast launch. Numbers (a seed, the value of a 0-d CPU input, dynamo's unspecialized
    floats under dynamic=True) are never specialized, so a kernel taking them launches directly once
    its pointers' alignment was compiled for; before, every call of such a kernel recomputed the
    alignment of all its arguments (0.4 ms of a GPT-2 + AdamW step under dynamic=True)."""
    from ember.runtime import triton as triton_runtime

    _, runs = stand_in_launcher
    module = type("StandInModule", (), {"k_pointwise": object(), "_sha256": "0" * 64})
    arguments = ["*float32", "float32", "*float32", "int64"]  # a buffer, a number, a buffer, a seed
    launcher = triton_runtime.TritonLauncher(module, "k", ["pointwise"], 4096, 0, [0], interpret=False,
                                             autotune=False, arguments=arguments)  # fmt: skip
    slow = []
    direct_for = launcher.direct_for
    monkeypatch.setattr(launcher, "direct_for", lambda args: slow.append(args) or direct_for(args))
    out, x = torch.zeros(4096), torch.zeros(4097)
    for step in range(3):
        launcher(out, 0.5 * step, x, 7 + step)
    assert len(slow) == 1 and len(runs) == 3
    launcher(out, 1.0, x[1:], 7)  # a pointer 4 bytes off alignment: its own compiled kernel
    assert len(slow) == 2 and len(runs) == 4


def test_racing_first_calls_choose_a_configuration_once(stand_in_launcher, monkeypatch):
    launcher, _ = stand_in_launcher
    choose, entered, second = type(launcher).choose, [], threading.Event()

    def slow_choose(self, args):
        entered.append(threading.current_thread().name)
        if len(entered) == 1:
            second.wait(2)  # would another thread come in meanwhile?
        else:
            second.set()
        return choose(self, args)

    monkeypatch.setattr(type(launcher), "choose", slow_choose)
    start = threading.Barrier(4, timeout=60)

    def worker(i):
        start.wait()
        launcher(torch.zeros(4096))

    run_threads(worker, 4)
    assert len(entered) == 1, f"chosen by {entered}"


def sized_stand_in_launcher(monkeypatch):
    """A symbolic pointwise kernel's launcher (Note: size classes) over the stand-in module of
    `stand_in_launcher`: x extent s0 * s1, one buffer, then the sizes."""
    from ember.runtime.triton_sized import SizedTritonLauncher

    module = type("StandInModule", (), {"k_pointwise": object(), "_sha256": "0" * 64})
    return SizedTritonLauncher(module, "k", ["pointwise"], 2**62, 0, [0], interpret=False, autotune=False,
                               arguments=["*float32", "int64", "int64"], variables=["s0", "s1"], variables_at=1,
                               grid_numel="s0*s1")  # fmt: skip


def test_a_symbolic_kernel_launches_each_size_class_with_its_own_blocks(stand_in_launcher, monkeypatch):
    """Note: size classes. The fast path runs each call with its class's block sizes and a grid
    of its own sizes; a call in a class met before chooses and compiles nothing new."""
    _, runs = stand_in_launcher
    launcher = sized_stand_in_launcher(monkeypatch)
    t = torch.zeros(8)
    for sizes in ((2, 3), (64, 100), (3, 2), (64, 100)):
        launcher(t, *sizes)
    assert [(grid, blocks) for grid, blocks, _ in runs] == [(1, (8,)), (7, (1024,)), (1, (8,)), (7, (1024,))]
    assert all(blocks == compiled_for for _, blocks, compiled_for in runs)
    assert len(launcher.classes) == 2 and ember.metrics.triton_size_classes == 2


def test_racing_first_calls_of_a_size_class_choose_its_configuration_once(stand_in_launcher, monkeypatch):
    from ember.runtime.triton_sized import SizedTritonLauncher

    launcher = sized_stand_in_launcher(monkeypatch)
    choose, entered, second = SizedTritonLauncher.choose_for_class, [], threading.Event()

    def slow_choose(self, key, args):
        entered.append(threading.current_thread().name)
        if len(entered) == 1:
            second.wait(2)  # would another thread come in meanwhile?
        else:
            second.set()
        return choose(self, key, args)

    monkeypatch.setattr(SizedTritonLauncher, "choose_for_class", slow_choose)
    start = threading.Barrier(4, timeout=60)

    def worker(i):
        start.wait()
        launcher(torch.zeros(8), 2, 3 + i % 2)  # (two sizes, one class)

    run_threads(worker, 4)
    assert len(entered) == 1, f"chosen by {entered}"
    assert ember.metrics.triton_size_classes == 1


# ---- UOp interning and metrics ---------------------------------------------------------------


def test_two_threads_building_one_uop_get_one_object(monkeypatch):
    """Both threads miss the intern table before either fills it (the barrier in __init__ lets
    them meet there if the miss is not guarded): they must still get one object."""
    from ember.uop.dtypes import dtypes
    from ember.uop.ops import Ops, UOp

    meeting, init = threading.Barrier(2), UOp.__init__

    def meeting_init(self, op, dtype=dtypes.void, src=(), arg=None):
        if arg == "thread-test":
            try:
                meeting.wait(1)
            except threading.BrokenBarrierError:
                pass  # the other thread waits for the table: as it should
        init(self, op, dtype, src, arg)

    monkeypatch.setattr(UOp, "__init__", meeting_init)
    made = [None, None]

    def worker(i):
        made[i] = UOp(Ops.SINK, dtypes.void, (), "thread-test")

    run_threads(worker, 2)
    assert made[0] is made[1]


def test_metrics_counted_from_many_threads_are_exact():
    import ember

    ember.metrics.reset()
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        run_threads(lambda i: [ember.metrics.add(kernel_searches=1) for _ in range(20000)], 8)
    finally:
        sys.setswitchinterval(switch)
    assert ember.metrics.kernel_searches == 8 * 20000


# ---- first calls racing: kernel search, shape specialization -------------------------------


def softmax_rows(x, w):
    return torch.softmax(x * w, dim=-1) + x.mean(-1, keepdim=True)


def test_threads_racing_a_kernel_search_all_get_eagers_result(tmp_path, monkeypatch):
    import ember

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))  # no earlier winner: a search runs
    x, w = torch.randn(256, 512), torch.randn(512)
    torch._dynamo.reset()
    fn = ember.compile(softmax_rows, dynamic=False, kernel_search=True)
    want = softmax_rows(x.double(), w.double()).float()
    start, results = threading.Barrier(4, timeout=120), {}

    def worker(i):
        start.wait()
        with torch.no_grad():
            results[i] = [fn(x, w) for _ in range(3)]

    fn_compiled_first = fn(x[:1].clone().expand(256, 512).contiguous(), w)  # compile, but search at the threads
    del fn_compiled_first
    ember.metrics.reset()
    run_threads(worker, 4)
    for outs in results.values():
        for out in outs:
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("symbolic", ["0", "1"])
def test_threads_racing_new_shapes_of_a_dynamic_graph(symbolic, monkeypatch):
    """Per shape (symbolic_shapes off): the threads race to specialize; symbolic: one compile
    serves them all (Note: symbolic sizes)."""
    import ember

    monkeypatch.setenv("EMBER_SYMBOLIC_SHAPES", symbolic)
    torch._dynamo.reset()
    fn = torch.compile(softmax_rows, backend="ember", dynamic=True)
    w = torch.randn(64)
    fn(torch.randn(3, 64), w)  # the symbolic graph; its shapes are specialized at the threads' calls
    ember.metrics.reset()
    rows = [5, 9, 17, 33]
    start, wrong = threading.Barrier(8, timeout=120), []

    def worker(i):
        start.wait()
        for r in range(6):
            x = torch.randn(rows[(i + r) % len(rows)], 64)
            got = fn(x, w)
            if not torch.allclose(got, softmax_rows(x.double(), w.double()).float(), rtol=1e-5, atol=1e-5):
                wrong.append((i, r))

    run_threads(worker, 8)
    assert not wrong
    assert ember.metrics.shape_specializations == (len(rows) if symbolic == "0" else 0)
    assert ember.metrics.graphs_compiled == (len(rows) if symbolic == "0" else 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("checks", ["sync", "deferred"])
def test_gpu_calls_racing_first_launches_and_errors(checks, monkeypatch):
    """On a GPU: first calls race the Triton launchers' tuning and fast-path compiles, and one
    thread of four passes an index out of range; every call gets its own result or error.
    Deferred (Note: deferred GPU error checks): each thread's own check raises its own errors."""
    monkeypatch.setenv("EMBER_GPU_ERROR_CHECKS", checks)
    weight = torch.randn(4096, 256, device="cuda")
    good = torch.randint(0, 4096, (8192,), device="cuda")
    bad = good.clone()
    bad[5000] = 4096
    compiled = compile_fn(embed_twice)

    def fn(w, i):
        out = compiled(w, i)
        wrapper_runtime.check_gpu_errors()  # (sync: nothing queued)
        return out

    want = embed_twice(weight, good)
    wrong = wrong_outcomes(fn, weight, good, bad, want, calls=50, start=threading.Barrier(4, timeout=300))
    assert not wrong, f"{len(wrong)} wrong outcomes, e.g. {wrong[:3]}"
