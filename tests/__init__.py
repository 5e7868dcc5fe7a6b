"""ember's test suite: a package, so that each test module is imported once, under one name
(tests.test_x). Without it pytest imported test_symbolic_shapes.py as `test_symbolic_shapes` and
test_symbolic_triton.py imported it again as `tests.test_symbolic_shapes`: its custom op was
defined twice, and torch destroys the first definition's library, so the first module's op
kept a handle to a freed dispatcher entry (an intermittent crash in dynamo's fake-tensor run)."""
