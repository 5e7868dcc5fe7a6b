"""`print(ember.metrics)`: one line per counter that moved, Counters broken out."""

import torch

import ember
from tests.helpers import compile_fn


def test_printed_metrics_list_the_counters_that_moved():
    ember.metrics.reset()
    assert str(ember.metrics) == "ember.metrics: nothing compiled or run yet"
    compile_fn(lambda x: (x.sin() + 1).sum(0))(torch.randn(8, 4))
    lines = str(ember.metrics).splitlines()
    assert lines[0] == "ember.metrics:"
    assert f"  graphs_compiled: {ember.metrics.graphs_compiled}" in lines
    assert f"  kernels_generated: {ember.metrics.kernels_generated}" in lines
    assert "  compile_seconds:" in lines and not any("graphs_failed" in line for line in lines)
    assert all(len(line) < 100 for line in lines)
