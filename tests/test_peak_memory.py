"""Peak memory at or below eager's (benchmarks/memory.py, Note: how peak memory is measured):
torch.profiler's memory events over one warm call, ember's buffer pool emptied first.

- inference: a oneDNN linear's scratchpad is taken only where it fits under the peak the graph
  reaches anyway (Note: oneDNN's scratchpad, passes/mkldnn.py), and its bound holds, tightly
  enough that the linears of an encoder layer and of a classifier MLP's forward all fit: their
  inputs are held by the caller (passes/eager_memory.py INPUTS_HELD);
- training: the backward drops each saved activation after its last use (Note: inputs die at
  their last use, wrapper/python.py), as eager's autograd frees them node by node, and writes a
  gradient over a donated saved tensor (Note: donated inputs, ember/donation.py): the language
  model loss's gradient over the logits."""

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ember.metrics import metrics
from ember.passes import matmul_timing, mkldnn
from ember.runtime.memory import release_pooled_buffers
from tests.helpers import compile_fn, cpu_kernels_only

pytestmark = cpu_kernels_only


def _events(fn) -> list[int]:
    release_pooled_buffers()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return [nbytes for _, nbytes in events]


def peak_bytes(fn) -> int:
    live = peak = 0
    for nbytes in _events(fn):
        live += nbytes
        peak = max(peak, live)
    return peak


def _mlp(width: int, depth: int, norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), *([nn.LayerNorm(width)] if norm else []), nn.GELU())
              for _ in range(depth)]  # fmt: skip
    return nn.Sequential(*layers).eval()


def test_inference_peak_at_most_eager():
    model, x = _mlp(1024, 6), torch.randn(32, 1024)
    compiled = compile_fn(model)
    with torch.no_grad():
        for _ in range(2):
            compiled(x)
        eager, ours = peak_bytes(lambda: model(x)), peak_bytes(lambda: compiled(x))
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert ours <= eager, f"ember's peak {ours} bytes, eager's {eager}"


@pytest.mark.parametrize("norm", [False, True])
def test_training_peak_at_most_eager(norm):
    model, x = _mlp(256, 3, norm).train(), torch.randn(64, 256)
    compiled = compile_fn(model)
    step = _training_step(lambda m: m(x).square().mean())
    for _ in range(2):
        step(compiled)()
    _assert_training_peak_at_most_eager(model, compiled, step)


def _training_step(loss: Callable[[nn.Module], torch.Tensor]) -> Callable:
    """step(m): a callable running one backward of `loss(m)`."""
    return lambda m: lambda: loss(m).backward()


def _assert_training_peak_at_most_eager(model: nn.Module, compiled: Callable, step: Callable,
                                       below_by: int = 0) -> None:  # fmt: skip
    """One measured step of `compiled` and of `model`: the gradients agree and ember's peak is at
    most eager's, less `below_by` bytes."""

    def measured(m) -> tuple[int, list[torch.Tensor]]:
        for p in model.parameters():
            p.grad = None  # freed before the measured step, not inside it
        return peak_bytes(step(m)), [p.grad.clone() for p in model.parameters()]

    ours, grads = measured(compiled)
    eager, _ = measured(model)
    for got, want in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert ours <= eager - below_by, f"ember's peak {ours} bytes, eager's {eager}"


# (rows 1: a decode step's vector, which takes no weight panels)
SCRATCHPAD_SHAPES = [(64, 512, 512), (256, 1024, 1024), (4, 2048, 64), (1000, 100, 1000), (2048, 16, 16),
                     (8, 768, 4096), (128, 1025, 256), (64, 3072, 768), (32, 40, 8),
                     (1, 768, 2304), (1, 3072, 768), (1, 40, 8)]  # fmt: skip


@pytest.mark.skipif(not mkldnn.applicable(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows, in_features, out_features", SCRATCHPAD_SHAPES)
@pytest.mark.parametrize("transposed_input", [False, True])
def test_onednn_scratchpad_bound(rows, in_features, out_features, transposed_input):
    """The bound the oneDNN rewrite relies on holds, and is tight: oneDNN works in K blocks of 512
    up to K = 1024 (`panel_depth`), so a bound with panels 1024 deep is twice the need there and
    leaves room for a linear only where it needs none."""
    x = torch.randn(in_features, rows).t() if transposed_input else torch.randn(rows, in_features)
    w = torch.randn(out_features, in_features)
    events = _events(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    output = rows * out_features * 4
    live = scratchpad = 0
    for nbytes in events:
        live += nbytes
        scratchpad = max(scratchpad, live - (output if live >= output else 0))
    bound = mkldnn.linear_scratchpad_bytes(x, in_features, torch.get_num_threads())
    assert scratchpad <= bound <= 1.02 * scratchpad + 8192, (scratchpad, bound)


@pytest.fixture
def two_threads():
    """The rewrites depend on the thread count (the scratchpad is per thread): fixed for the counts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _rewrites_while(fn) -> int:
    before = metrics.pass_rewrites["mkldnn_linear"]
    fn()
    return metrics.pass_rewrites["mkldnn_linear"] - before


@pytest.mark.skipif(not mkldnn.applicable(), reason="torch built without oneDNN")
def test_encoder_layer_linears_use_onednn_within_eager_peak(two_threads):
    """An inference encoder layer's linears stay aten's: the input projection, which attention
    reads, is an addmm (a bias alone is not worth oneDNN's linear), and the other three are read
    by ember's kernels (the residual adds, relu), which add their biases: mm (Note: which library
    multiplies, passes/mkldnn.py). The layer's peak stays at most eager's."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True, norm_first=True).eval()
    x = torch.randn(8, 64, 256)
    compiled = compile_fn(layer)
    with torch.no_grad():
        assert _rewrites_while(lambda: compiled(x)) == 0
        assert metrics.pass_rewrites["matmul_bias"] == 3
        compiled(x)
        eager, ours = peak_bytes(lambda: layer(x)), peak_bytes(lambda: compiled(x))
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-4, atol=1e-4)
    assert ours <= eager, f"ember's peak {ours} bytes, eager's {eager}"


@pytest.mark.skipif(not mkldnn.applicable(), reason="torch built without oneDNN")
@pytest.mark.parametrize("slack_kb, rewritten", [(0, 0), (1024, 1)])
def test_a_head_at_the_peak_takes_onednn_only_within_the_slack(two_threads, monkeypatch, tmp_path, slack_kb, rewritten):
    """A language model's head: its logits are the graph's peak, so no scratchpad fits under
    eager's peak there; EMBER_ONEDNN_SLACK_KB lets it take oneDNN's (timed faster here), and the
    peak then passes eager's by at most the slack."""
    monkeypatch.setenv("EMBER_ONEDNN_SLACK_KB", str(slack_kb))
    monkeypatch.setenv("EMBER_MATMUL_TIMING", "1")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))  # no verdict or graph from another test
    monkeypatch.setattr(matmul_timing, "time_both", lambda shape: (2.0, 1.0))
    matmul_timing.forget_verdicts()
    torch.manual_seed(0)
    head = nn.Sequential(nn.LayerNorm(512), nn.Linear(512, 8192, bias=False)).eval()
    x = torch.randn(64, 512)
    compiled = compile_fn(head)
    with torch.no_grad():
        assert _rewrites_while(lambda: compiled(x)) == rewritten
        compiled(x)
        eager, ours = peak_bytes(lambda: head(x)), peak_bytes(lambda: compiled(x))
        torch.testing.assert_close(compiled(x), head(x), rtol=1e-4, atol=1e-4)
    assert ours <= eager + slack_kb * 1024, f"ember's peak {ours} bytes, eager's {eager}, slack {slack_kb} KiB"
    if rewritten:
        assert ours > eager, "the scratchpad is the only extra memory: a head without one is no test of the slack"
    matmul_timing.forget_verdicts()


@pytest.mark.skipif(not mkldnn.applicable(), reason="torch built without oneDNN")
def test_classifier_training_linears_use_onednn_within_eager_peak(two_threads):
    """A classifier MLP's training step: the first two forward linears (K = 512 and 1024, whose
    panel is 512 deep) become oneDNN linears with tanh as a post-op (the forward saves its
    result); the third, whose bias alone oneDNN would fuse, stays aten's addmm, and the backward's
    matmuls aten's mm: they have no activation for oneDNN to fuse (Note: which library
    multiplies), or read a transposed input. The step's peak stays at most eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 100))
    x, target = torch.randn(128, 512), torch.randint(0, 100, (128,))
    compiled = compile_fn(model)
    step = _training_step(lambda m: torch.nn.functional.cross_entropy(m(x), target))
    assert _rewrites_while(step(compiled)) == 4  # two linears, two post-ops
    step(compiled)()
    _assert_training_peak_at_most_eager(model, compiled, step)


def test_language_model_loss_gradient_takes_the_place_of_the_saved_logits():
    """Cross-entropy's backward writes the logits' gradient over the saved logits (AOTAutograd
    donates them: Note: donated inputs, ember/donation.py), where eager's autograd holds both
    until the node has run."""
    torch.manual_seed(0)
    rows, width, vocab = 256, 64, 4096
    model = _LanguageModelHead(width, vocab)
    x, target = torch.randn(rows, width), torch.randint(0, vocab, (rows,))
    compiled = compile_fn(model)
    step = _training_step(lambda m: m(x, target))
    for _ in range(2):
        step(compiled)()
    # eager holds the logits, their log-softmax and its gradient at once (12 MiB); ember without
    # donations the logits and their gradient (8 MiB); with them the logits, then the weight's
    # gradient (5 MiB)
    _assert_training_peak_at_most_eager(model, compiled, step, below_by=rows * vocab * 4 * 3 // 2)


class _LanguageModelHead(nn.Module):
    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(x), target)
