"""Note: a view's base lives as long as the view (schedule/__init__.py `graph_last_uses`).

An aten op run as an extern may return a view of its argument (`as_strided` where ember's own
view cannot express it: Longformer's sliding-window chunks). The memory planner must not hand the
argument's storage to a later buffer while the view is still read or returned: a reused storage
gives wrong values, silently. Each case here fails on a planner that frees the argument at its own
last read."""

from __future__ import annotations

import ember
from tests.helpers import check, data


def chunks(t):
    """Longformer's `_chunk`: overlapping windows over the sequence, an as_strided of a reshaped
    (so copied) tensor, which ember's lowering sends to aten."""
    t = t.view(16, 2, 4, 16).permute(1, 2, 0, 3).reshape(8, 16, 16).view(8, 4, 4, 16)
    return t.as_strided((8, 7, 4, 16), (16, 256, 128, 1))


def test_a_view_is_read_after_its_base_would_have_died():
    def windows(x, bk, bq):
        k = chunks(x + bk)  # k's base dies at the as_strided call; q's buffer is the same size
        q = chunks(x * 2.0 + bq)
        return k * q

    check(windows, data((16, 2, 64)), data((64,), seed=1), data((64,), seed=2))
    assert ember.metrics.fallback_calls >= 2  # the as_strided externs this test is about


def test_a_returned_view_keeps_its_base():
    def windows(x, b):
        k = chunks(x + b)
        later = (x * 3.0 - b).relu()  # a buffer of the base's size, allocated after its last read
        return k, later

    check(windows, data((16, 2, 64)), data((64,), seed=1))
    assert ember.metrics.fallback_calls >= 1
