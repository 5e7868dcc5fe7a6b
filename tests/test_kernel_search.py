"""The kernel search (config.kernel_search; Note: kernel search, runtime/search.py): off by
default; when on, results equal an unsearched run's bit for bit, every candidate compiles
and computes the default's result, and winners are recorded on disk and loaded after."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ember
from ember import compile_search
from ember.config import Config
from ember.renderer.choices import DEFAULT_CHOICES, KernelChoices, runs_parallel
from ember.runtime.cache import read_entry, write_entry
from ember.runtime.search import wide_default_vectors


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A cache of this test's own, so no earlier test's winner is found."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def run(fn, *inputs, **options):
    torch._dynamo.reset()
    with torch.no_grad():
        return ember.compile(fn, dynamic=False, **options)(*inputs)


def assert_identical(got, want):
    got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def records(cache_dir: Path) -> list[dict]:
    """The payloads of the winner records (each records its key: the file's name)."""
    return [read_entry(p, p.stem) for p in sorted((cache_dir / "search").rglob("*.json"))]


def pointwise_chain(x, y):
    return torch.where(x > 0, x * y + 1, (x - y).abs() * 0.5).sqrt() + y


def layer_norm_softmax(x, w):
    return torch.softmax(torch.nn.functional.layer_norm(x, (x.shape[-1],), w), dim=-1)


def column_sums(x):  # lane accumulators inside a parallel outer loop (a split reduce loop would
    return x.sum(1), x.amax(1)  # combine threads' partial sums in an order that varies)


def batched_outer(x, y):  # three loops: collapse(2) applies to the two outer ones
    return (x[:, :, None] * y[:, None, :]).relu()


def gather_rows(x, i):  # indirect loads with a bounds check (the kernel's error flag)
    return x[i] * 2


def matmul_epilogue(x, w, b):  # the mm result dies in the pointwise kernel: written in place
    return torch.nn.functional.gelu(x @ w + b)


CASES = {
    "pointwise": (pointwise_chain, lambda: (torch.randn(256, 512), torch.rand(512))),
    "row reductions": (layer_norm_softmax, lambda: (torch.randn(128, 1024), torch.randn(1024))),
    "column reductions": (column_sums, lambda: (torch.randn(8, 256, 128),)),
    "three loops": (batched_outer, lambda: (torch.randn(3, 96), torch.randn(3, 256))),
    "indirect loads": (gather_rows, lambda: (torch.randn(64, 1024), torch.randint(0, 64, (128,)))),
    "in place": (matmul_epilogue, lambda: (torch.randn(128, 256), torch.randn(256, 256), torch.randn(256))),
}


def test_off_by_default(cache_dir):
    assert Config().kernel_search is False
    fn, make = CASES["pointwise"]
    run(fn, *make())
    assert ember.metrics.kernels_generated >= 1
    assert (ember.metrics.kernel_searches, ember.metrics.search_candidates_timed) == (0, 0)
    assert ember.metrics.search_winners_loaded == 0
    assert not (cache_dir / "search").exists()


def test_the_flag_is_in_the_cache_key():
    assert Config(kernel_search=True).cache_key() != Config().cache_key()


@pytest.mark.parametrize("case", list(CASES))
def test_searched_results_equal_unsearched(case, cache_dir):
    fn, make = CASES[case]
    torch.manual_seed(0)
    inputs = make()
    inputs[0].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    want = run(fn, *inputs)
    ember.metrics.reset()
    got = run(fn, *inputs, kernel_search=True)
    assert ember.metrics.kernel_searches >= 1
    assert ember.metrics.search_candidates_timed > ember.metrics.kernel_searches  # more than the default
    assert_identical(got, want)
    # every candidate compiled, ran on the real arguments, and gave the default's bits
    for record in records(cache_dir):
        assert record["candidates"] and all(c["verified"] for c in record["candidates"]), record
    again = run(fn, *inputs, kernel_search=True)  # the wrapper's name now calls the winner
    assert_identical(again, want)


def test_in_place_kernel_is_searched_on_copies(cache_dir, monkeypatch):
    """The kernel overwrites the mm result it reads; timing it on the real buffer would apply
    the epilogue once per run."""
    seen = []
    original = compile_search.compile_candidates

    def spy(binaries, *args):
        result = original(binaries, *args)
        seen.extend(b for b in result.values() if b.search is not None)
        return result

    monkeypatch.setattr("ember.compile_cpp.compile_candidates", spy)
    monkeypatch.setenv("EMBER_GRAPH_CACHE", "0")
    fn, make = CASES["in place"]
    inputs = make()
    want = run(fn, *inputs)
    got = run(fn, *inputs, kernel_search=True)
    assert [b for b in seen if b.inplace and b.search["rereads"]], "no in-place kernel was searched"
    assert_identical(got, want)


def test_three_loop_kernel_tries_collapse(cache_dir):
    fn, make = CASES["three loops"]
    run(fn, *make(), kernel_search=True)
    tried = [c["choices"] for r in records(cache_dir) for c in r["candidates"]]
    assert any(c["collapse"] for c in tried), tried


def test_tiled_kernel_tries_other_tile_sizes(cache_dir):
    """A transpose's 2-D tiles (codegen/tiling.py) come in a smaller and a larger size too;
    each computes the same elements."""
    x = torch.randn(200, 300)
    want = run(lambda x: x.t().contiguous() + 1, x)
    got = run(lambda x: x.t().contiguous() + 1, x, kernel_search=True)
    tried = {c["choices"]["tile"] for r in records(cache_dir) for c in r["candidates"]}
    assert tried == {0, 16, 64}, tried
    assert_identical(got, want)


def test_threads_of_a_reduction_loop_are_never_varied(cache_dir):
    """A full reduction's loop splits over threads with an OpenMP reduction: a different split
    (one thread, collapse) would add in another order, so no candidate changes it."""
    run(lambda x: x.sum(), torch.randn(3, 64, 256), kernel_search=True)
    tried = [c["choices"] for r in records(cache_dir) for c in r["candidates"]]
    assert tried and all(c["parallel"] == "auto" and not c["collapse"] and not c["dynamic_chunks"] for c in tried)


@pytest.mark.parametrize("graph_cache", [True, False])
def test_winner_is_recorded_and_loaded(cache_dir, graph_cache):
    fn, make = CASES["row reductions"]
    inputs = make()
    first = run(fn, *inputs, kernel_search=True, graph_cache=graph_cache)
    searched = ember.metrics.kernel_searches
    assert searched >= 1 and len(records(cache_dir)) == searched
    ember.metrics.reset()
    second = run(fn, *inputs, kernel_search=True, graph_cache=graph_cache)
    assert ember.metrics.kernel_searches == 0
    assert ember.metrics.search_winners_loaded == searched
    assert ember.metrics.graph_cache_hits == int(graph_cache)
    assert_identical(second, first)


def test_corrupt_winner_is_ignored_and_rewritten(cache_dir):
    fn, make = CASES["pointwise"]
    inputs = make()
    want = run(fn, *inputs, kernel_search=True)
    searched = ember.metrics.kernel_searches
    paths = sorted((cache_dir / "search").rglob("*.json"))
    assert searched >= 1 and len(paths) == searched
    paths[0].write_text('{"winner": {"parallel": "sideways"')  # torn JSON
    for p in paths[1:]:
        write_entry(p, p.stem, {"winner": {"parallel": "sideways"}})  # names no candidate
    ember.metrics.reset()
    got = run(fn, *inputs, kernel_search=True)
    assert (ember.metrics.kernel_searches, ember.metrics.search_winners_loaded) == (searched, 0)
    assert_identical(got, want)
    assert all("winner" in r for r in records(cache_dir))


def test_a_new_process_loads_the_winner(cache_dir):
    fn, make = CASES["pointwise"]
    inputs = make()
    run(fn, *inputs, kernel_search=True)
    assert ember.metrics.kernel_searches >= 1
    script = (
        "import torch, ember\n"
        "from tests.test_kernel_search import CASES, run\n"
        "fn, make = CASES['pointwise']\n"
        "run(fn, *make(), kernel_search=True, graph_cache=False)\n"
        "print(ember.metrics.kernel_searches, ember.metrics.search_winners_loaded)\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root, check=True)
    searches, loaded = map(int, out.stdout.split()[-2:])
    assert (searches, loaded) == (0, ember.metrics.kernel_searches)


def test_debug_dumps_candidates_and_times(cache_dir, tmp_path):
    fn, make = CASES["pointwise"]
    run(fn, *make(), kernel_search=True, debug=True, debug_dir=str(tmp_path / "debug"))
    dumps = list((tmp_path / "debug").rglob("search/*.txt"))
    assert len(dumps) == ember.metrics.kernel_searches >= 1
    text = dumps[0].read_text()
    assert "winner candidate" in text and "us median" in text
    assert list((tmp_path / "debug").rglob("kernels/*.candidate1.cpp"))


def test_parallel_choice_never_changes_a_reduction_clause_loop():
    """A loop with a reduction clause keeps the default rule whatever the choice (its
    combining order depends on the split); others follow the choice."""
    for choice in (KernelChoices(parallel="never"), KernelChoices(parallel="more")):
        assert runs_parallel(choice, True, 10**6, 1000, carries=True) is True
        assert runs_parallel(choice, True, 100, 1000, carries=True) is False
    assert runs_parallel(KernelChoices(parallel="never"), True, 10**6, 1000, carries=False) is False
    assert runs_parallel(KernelChoices(parallel="more"), True, 100, 1000, carries=False) is True
    assert runs_parallel(DEFAULT_CHOICES, True, 100, 1000, carries=False) is False
    assert runs_parallel(DEFAULT_CHOICES, False, 10**6, 1000, carries=False) is False


@pytest.mark.skipif(not wide_default_vectors(), reason="the narrower width is tried only on AVX-512 hosts")
def test_vector_width_is_varied_with_inline_erf_but_not_libmvec_exp(cache_dir):
    """ember's inline erf (Note: vector math) rounds alike at every width; libmvec's exp may not."""
    x = torch.randn(256, 1024)
    run(torch.nn.functional.gelu, x, kernel_search=True)
    erf_widths = {c["choices"]["vector_bits"] for r in records(cache_dir) for c in r["candidates"]}
    for path in (cache_dir / "search").rglob("*.json"):
        path.unlink()
    run(torch.exp, x, kernel_search=True)
    exp_widths = {c["choices"]["vector_bits"] for r in records(cache_dir) for c in r["candidates"]}
    assert len(erf_widths) > 1 and exp_widths == {0}, (erf_widths, exp_widths)
