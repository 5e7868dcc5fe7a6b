"""The garbage collector paused while ember compiles (Note: no garbage collection while compiling,
ember/collector.py): nested and concurrent compiles resume it once, at the last one's end, and a
collector the user turned off stays off."""

import gc
import threading

import torch

from ember.collector import collection_paused
from tests.helpers import compile_fn


def test_nested_pauses_resume_at_the_outermost_end():
    assert gc.isenabled()
    with collection_paused():
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_overlapping_pauses_in_threads_resume_once_both_end():
    first_in, second_done = threading.Event(), threading.Event()
    seen = []

    def second():
        first_in.wait()
        with collection_paused():
            pass
        seen.append(gc.isenabled())  # the first thread still compiles
        second_done.set()

    thread = threading.Thread(target=second)
    thread.start()
    with collection_paused():
        first_in.set()
        second_done.wait()
    thread.join()
    assert seen == [False] and gc.isenabled()


def test_a_collector_turned_off_stays_off_and_a_compile_leaves_it_on():
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    compile_fn(lambda x: x.sin() + 1)(torch.randn(8))
    assert gc.isenabled()
