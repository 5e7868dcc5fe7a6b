"""The test suite's own layout: each test module is imported once, under one name. A module
imported twice runs its definitions twice; for a custom op (torch.library.custom_op) torch then
destroys the first definition's library, and the first module's op holds a freed dispatcher
entry: dynamo's fake-tensor run of it failed at random (ValueError('vector::reserve'), an empty
schema name) in about one whole-suite run in three."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_each_test_module_is_imported_once():
    files = Counter()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and Path(path).resolve().is_relative_to(TESTS):
            files[Path(path).resolve()] += 1
    twice = sorted(str(path.relative_to(TESTS)) for path, n in files.items() if n > 1)
    assert not twice, f"imported under two names (is tests/ still a package?): {twice}"
