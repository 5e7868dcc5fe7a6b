"""Timed matmul libraries (passes/matmul_timing.py, Note: timed matmul libraries): a static linear
goes to oneDNN where it was timed faster on this machine, the verdict is recorded on disk, and
threads ask for one timing. The tests set the verdicts through `time_both` (the suite's counts
must not depend on the machine), except one that times for real and checks only the record."""

import copy
import threading

import pytest
import torch
from torch import nn

import ember
from ember.passes import matmul_timing, mkldnn
from ember.passes.matmul_timing import LinearShape, onednn_is_faster
from ember.runtime.cache import entry_path, read_entry, write_atomic
from tests.helpers import check, data
from tests.test_passes import check_inference, eval_model

pytestmark = pytest.mark.skipif(not mkldnn.applicable(), reason="torch built without oneDNN")


@pytest.fixture(autouse=True)
def timing_on(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")  # oneDNN takes CPU linears: `check` stays there on a GPU machine too
    monkeypatch.setenv("EMBER_MATMUL_TIMING", "1")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))  # no verdict recorded by another test
    monkeypatch.setenv("EMBER_GRAPH_CACHE", "0")  # the graph cache would skip the passes
    monkeypatch.setattr(mkldnn, "linear_scratchpad_bytes", lambda *args: 0)  # only the timing decides
    matmul_timing.forget_verdicts()
    yield
    matmul_timing.forget_verdicts()


def timed(monkeypatch, aten_ms: float, onednn_ms: float) -> list:
    """`time_both` answering these times; the list collects the shapes it was asked about."""
    asked = []

    def fake(shape):
        asked.append(shape)
        return aten_ms, onednn_ms

    monkeypatch.setattr(matmul_timing, "time_both", fake)
    return asked


def mlp() -> nn.Module:
    # relu is no oneDNN post-op by default: only the timing can send these linears to oneDNN
    return eval_model(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 128))


@pytest.mark.parametrize("aten_ms, onednn_ms, rewritten", [(2.0, 1.0, 2), (1.0, 2.0, 0), (1.0, 0.95, 0)])
def test_a_linear_goes_to_onednn_only_where_it_was_timed_faster(monkeypatch, aten_ms, onednn_ms, rewritten):
    """oneDNN takes a linear when it took at most 1 - MARGIN of aten's time: 0.95 of it is noise."""
    asked = timed(monkeypatch, aten_ms, onednn_ms)
    check_inference(mlp(), data((64, 256)))
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == rewritten
    assert sorted((s.in_features, s.out_features, s.bias) for s in asked) == [(256, 512, True), (512, 128, True)]
    assert ember.metrics.matmul_timings == 2


def test_an_in_out_weight_goes_to_onednn_where_that_layout_was_timed_faster(monkeypatch):
    """GPT-2's Conv1D: addmm(b, x, w) with w stored (in, out) row-major, NaN and inf in x."""
    asked = timed(monkeypatch, 2.0, 1.0)
    x = data((64, 256))
    x[3, 5], x[7, 0], x[9, 1] = float("nan"), float("inf"), -float("inf")
    # sums of 256 products of about 16: float32's rounding in either library's order, about 1e-4 absolute
    check(lambda b, x, w: torch.addmm(b, x, w), data((128,)), x, data((256, 128), seed=1), atol=5e-4)
    check(lambda x, w: torch.nn.functional.gelu(torch.mm(x, w)), data((64, 256)), data((256, 128), seed=1), atol=5e-4)
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == 2
    assert {(s.rows, s.in_features, s.out_features, s.weight_in_out) for s in asked} == {(64, 256, 128, True)}


def test_small_linears_are_not_timed(monkeypatch):
    asked = timed(monkeypatch, 2.0, 1.0)
    check_inference(eval_model(nn.Linear(16, 16)), data((4, 16)))  # under LINEAR_MIN_MACS
    assert asked == [] and ember.metrics.pass_rewrites["mkldnn_linear"] == 0


@pytest.mark.parametrize("aten_ms, onednn_ms, rewritten", [(2.0, 1.0, 1), (1.0, 2.0, 0)])
def test_a_one_row_product_of_a_large_weight_is_timed_under_the_fixed_cost(monkeypatch, aten_ms, onednn_ms, rewritten):
    """A decode step's GPT-2 attention projection: one row by a 768 x 768 (in, out) weight, 590 K
    multiply-adds (under LINEAR_MIN_MACS) but 2.4 MB of weight to stream: timed, and oneDNN's
    where it was timed faster; a one-row product of a 256 KB weight is not timed."""
    asked = timed(monkeypatch, aten_ms, onednn_ms)
    check(lambda b, x, w: torch.addmm(b, x, w), data((768,)), data((1, 768)), data((768, 768), seed=1), atol=5e-4)
    assert 768 * 768 < mkldnn.LINEAR_MIN_MACS and 768 * 768 * 4 >= mkldnn.ONE_ROW_MIN_WEIGHT_BYTES
    assert [(s.rows, s.in_features, s.out_features, s.weight_in_out) for s in asked] == [(1, 768, 768, True)]
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == rewritten
    asked.clear()
    check(lambda b, x, w: torch.addmm(b, x, w), data((256,)), data((1, 256)), data((256, 256), seed=1), atol=5e-4)
    assert asked == []


def test_a_one_row_product_is_timed_over_weights_that_outgrow_the_cache(monkeypatch):
    """Note: timed matmul libraries: one row reads its weight from memory in a real model, so the
    timing reads copies holding twice the last-level cache; more rows, one copy (warm)."""
    monkeypatch.setattr(matmul_timing, "last_level_cache_bytes", lambda: 32 << 20)
    assert matmul_timing.cold_copies(1, 768 * 768 * 4) == 29  # 29 x 2.36 MB >= 64 MiB
    assert matmul_timing.cold_copies(1, 200 << 20) == 1
    assert matmul_timing.cold_copies(1, 1024) == matmul_timing.MAX_COLD_COPIES
    assert matmul_timing.cold_copies(8, 768 * 768 * 4) == 1
    read = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, x, w, *args):
            read.append(w.data_ptr())
            return real(x, w, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Spy())
    aten_ms, onednn_ms = matmul_timing.time_both(LinearShape(1, 768, 768, False, True))
    assert aten_ms > 0 and onednn_ms > 0
    assert len(read) >= 4 and len(set(read)) == len(read), "each call reads a copy no call read before"


def test_last_level_cache_is_read_from_the_machine():
    matmul_timing.last_level_cache_bytes.cache_clear()
    size = matmul_timing.last_level_cache_bytes()
    assert size >= 1 << 20 and size == matmul_timing.last_level_cache_bytes()


@pytest.mark.parametrize("aten_ms, onednn_ms, rewritten", [(2.0, 1.0, 1), (1.0, 2.0, 0)])
def test_a_symbolic_linear_is_timed_at_its_example_and_sized_at_each_call(monkeypatch, aten_ms, onednn_ms, rewritten):
    """A graph with symbolic rows times its linear at the example's rows (the symbol's hint) and,
    where oneDNN won, calls `linear_by_size`, which leaves calls under LINEAR_MIN_MACS to aten."""
    asked = timed(monkeypatch, aten_ms, onednn_ms)
    model = eval_model(nn.Linear(256, 256))
    compiled = torch.compile(model, backend="ember", dynamic=True)
    with torch.no_grad():
        for rows in (40, 56, 3):  # 3 rows: under LINEAR_MIN_MACS, aten's at that call
            x = data((rows, 256))
            want = copy.deepcopy(model).double()(x.double())
            torch.testing.assert_close(compiled(x).double(), want, rtol=1.3e-5, atol=1e-5)
    assert [(s.rows, s.in_features, s.out_features) for s in asked] == [(40, 256, 256)]
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == rewritten
    assert ember.metrics.symbolic_graphs == 1


def test_a_symbolic_linear_reads_its_operands_as_a_static_one_does(monkeypatch):
    """GPT-2's layer norm then Conv1D (an (in, out) weight), oneDNN's: under dynamic=True the
    linear is `linear_by_size`, an extern kernel like oneDNN's own, so the layer norm's affine
    stays in the norm's kernel and the weight goes in as a transposed view. Before, ember did not
    count it as an extern: a second kernel recomputed the affine and copied the weight every call."""
    timed(monkeypatch, 2.0, 1.0)
    norm = nn.LayerNorm(256).eval()
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    w, b = data((256, 768), seed=1), data((768,), seed=2)

    def block(x):  # as transformers' Conv1D: rows of every (batch, position)
        return torch.addmm(b, norm(x).view(-1, 256), w).view(*x.shape[:-1], 768)

    kernels = {}
    for dynamic, sizes in ((False, ((4, 16),)), (True, ((4, 16), (3, 32), (5, 20)))):
        torch._dynamo.reset()
        ember.metrics.reset()
        compiled = torch.compile(block, backend="ember", dynamic=dynamic)
        with torch.no_grad():
            for batch, length in sizes:
                x = data((batch, length, 256))
                want = copy.deepcopy(norm).double()(x.double()) @ w.double() + b.double()
                torch.testing.assert_close(compiled(x).double(), want, rtol=1e-4, atol=5e-4)
        assert ember.metrics.graphs_compiled == 1
        kernels[dynamic] = ember.metrics.kernels_generated
    assert kernels == {False: 1, True: 1}


def test_a_verdict_is_recorded_read_back_and_timed_again_when_damaged(monkeypatch, tmp_path):
    asked = timed(monkeypatch, 3.0, 1.0)
    shape = LinearShape(128, 768, 768, True, False)
    assert onednn_is_faster(shape, tmp_path)
    records = list((tmp_path / "matmul").rglob("*.json"))
    assert len(records) == 1 and len(asked) == 1
    payload = read_entry(records[0], records[0].stem)
    assert payload["onednn_faster"] is True and payload["aten_ms"] == 3.0 and payload["onednn_ms"] == 1.0

    matmul_timing.forget_verdicts()  # as a new process: the record answers
    assert onednn_is_faster(shape, tmp_path) and len(asked) == 1
    assert ember.metrics.matmul_timings_loaded == 1

    write_atomic(records[0], b'{"format": 2, "key": "')  # a damaged record is timed again
    matmul_timing.forget_verdicts()
    assert onednn_is_faster(shape, tmp_path) and len(asked) == 2
    assert read_entry(records[0], records[0].stem)["onednn_faster"] is True


def test_other_shapes_layouts_and_thread_counts_have_their_own_records(monkeypatch, tmp_path):
    asked = timed(monkeypatch, 3.0, 1.0)
    shapes = [LinearShape(128, 768, 768, True, False), LinearShape(128, 768, 768, False, False),
              LinearShape(128, 768, 768, True, True), LinearShape(64, 768, 768, True, False)]  # fmt: skip
    for shape in shapes:
        onednn_is_faster(shape, tmp_path)
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads + 1))  # OpenMP's threads (kernels)
    onednn_is_faster(shapes[0], tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(threads + 1)  # torch's own (MKL's and oneDNN's)
    try:
        onednn_is_faster(shapes[0], tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert len(asked) == 6 and len(list((tmp_path / "matmul").rglob("*.json"))) == 6


def test_threads_asking_at_once_time_once(monkeypatch, tmp_path):
    """Compiles on several threads ask about one shape together: one times (two timings at once
    would slow each other), the others wait for its verdict. Without the lock every thread would
    be inside the slow timing at once."""
    inside, most_inside, calls = [0], [0], []
    guard = threading.Lock()

    def slow(shape):
        with guard:
            inside[0] += 1
            most_inside[0] = max(most_inside[0], inside[0])
            calls.append(shape)
        threading.Event().wait(0.2)
        with guard:
            inside[0] -= 1
        return 3.0, 1.0

    monkeypatch.setattr(matmul_timing, "time_both", slow)
    start = threading.Barrier(8)
    answers = []

    def ask():
        start.wait()
        answers.append(onednn_is_faster(LinearShape(128, 768, 768, True, False), tmp_path))

    workers = [threading.Thread(target=ask) for _ in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert answers == [True] * 8 and len(calls) == 1 and most_inside[0] == 1


def test_a_real_timing_records_both_times(tmp_path):
    """Timed for real (whatever this machine's verdict): both times positive, the verdict theirs."""
    shape = LinearShape(64, 256, 256, True, True)
    faster = onednn_is_faster(shape, tmp_path)
    (record,) = (tmp_path / "matmul").rglob("*.json")
    payload = read_entry(record, record.stem)
    assert payload["aten_ms"] > 0 and payload["onednn_ms"] > 0
    threshold = (1 - matmul_timing.MARGIN) * payload["aten_ms"]
    assert faster is payload["onednn_faster"] is (payload["onednn_ms"] <= threshold)
    assert record == entry_path(tmp_path, "matmul", record.stem, ".json")


def test_timing_multiplies_float32_on_the_cpu_whatever_the_defaults_and_autocast(monkeypatch):
    seen = []
    real_mm = torch.addmm

    def addmm(b, x, w):
        out = real_mm(b, x, w)
        seen.append((x.dtype, x.device.type, w.dtype, b.dtype, out.dtype))
        return out

    monkeypatch.setattr(torch, "addmm", addmm)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # a compile inside the caller's autocast
            matmul_timing.time_both(LinearShape(32, 64, 48, True, False))
    finally:
        torch.set_default_dtype(previous)
    assert seen and set(seen) == {(torch.float32, "cpu", torch.float32, torch.float32, torch.float32)}
