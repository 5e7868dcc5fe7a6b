"""`ember report` (ember/report.py): the page's content, read through its HTML structure, and the
page in a real headless Chromium (skipped where /usr/bin/chromium is absent)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import ember
from ember.debug.record import is_recording, new_graph_record, recording
from tests.helpers import test_device


class ReportPage(HTMLParser):
    """The step rows (`tr.step`: their data- attributes and cells' text by class), section ids,
    and the text of each <summary>."""

    def __init__(self, text: str):
        super().__init__()
        self.steps: list[dict] = []
        self.sections: list[str] = []
        self.summaries: list[str] = []
        self.code_blocks = 0
        self._cell: str | None = None
        self._in_summary = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "tr" and a.get("class") == "step":
            data = {k[5:]: v for k, v in a.items() if k.startswith("data-")}
            self.steps.append({**data, "cells": {}, "section": self.sections[-1] if self.sections else ""})
        elif tag == "td" and self.steps:
            self._cell = (a.get("class") or "").split(" ")[0] or None
        elif tag == "section":
            self.sections.append(a.get("id", ""))
        elif tag == "summary":
            self._in_summary = True
            self.summaries.append("")
        elif tag == "details" and a.get("class") == "code":
            self.code_blocks += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._cell = None
        elif tag == "summary":
            self._in_summary = False

    def handle_data(self, data: str) -> None:
        if self._cell and self.steps:
            cells = self.steps[-1]["cells"]
            cells[self._cell] = cells.get(self._cell, "") + data
        if self._in_summary:
            self.summaries[-1] += data


def mlp_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    hidden = torch.nn.functional.gelu(x @ model.weight1 + model.bias1)
    loss = (hidden @ model.weight2).softmax(-1).square().sum()
    loss.backward()
    return loss.detach()


class TinyMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight1 = torch.nn.Parameter(torch.randn(32, 64))
        self.bias1 = torch.nn.Parameter(torch.randn(64))
        self.weight2 = torch.nn.Parameter(torch.randn(64, 16))


def sort_and_scale(x: torch.Tensor) -> torch.Tensor:
    values = torch.sort(x, dim=-1).values  # aten.sort has no lowering: a fallback
    return (values * 2).exp().sum(-1)


@pytest.fixture(scope="module")
def mlp_page(tmp_path_factory) -> tuple[Path, ReportPage]:
    path = tmp_path_factory.mktemp("report") / "mlp.html"
    torch._dynamo.reset()
    device = test_device()  # EMBER_TEST_DEVICE=cuda: Triton kernels, timed on the GPU's side
    ember.report(mlp_step, TinyMLP().to(device), torch.randn(8, 32, device=device), path=str(path), calls=2)
    return path, ReportPage(path.read_text())


def test_report_lists_every_step_with_ops_sources_and_times(mlp_page):
    _, page = mlp_page
    graphs = {row["graph"] for row in page.steps}
    assert any(g.endswith("_forward") for g in graphs) and any(g.endswith("_backward") for g in graphs)
    kernels = [row for row in page.steps if row["kind"] == "kernel" and row["section"].startswith("graph-")]
    assert kernels and any(row["kind"] == "extern" for row in page.steps)
    for row in page.steps:
        assert row["cells"]["ops"].strip(), row  # each step names the aten ops it computes
        assert row["time-us"] and float(row["time-us"]) > 0, row  # and each ran under the profiler
    forward_kernels = [row for row in kernels if row["graph"].endswith("_forward")]
    assert any("gelu" in row["cells"]["ops"] for row in forward_kernels)
    # forward steps point at this file's lines (backward nodes carry no stack trace in torch)
    assert any("test_report.py" in row["cells"]["sources"] for row in forward_kernels)
    assert page.code_blocks == len({(row["graph"], row["step"]) for row in kernels})


def test_report_sorts_each_graph_slowest_first_and_has_every_section(mlp_page):
    _, page = mlp_page
    for graph in {row["graph"] for row in page.steps}:
        rows = [r for r in page.steps if r["section"] == f"graph-{graph}"]
        times = [float(r["time-us"]) for r in rows]
        assert times == sorted(times, reverse=True)
    for section in ("summary", "slowest", "fallbacks", "graph-breaks", "compile-time"):
        assert section in page.sections
    assert any(s.startswith("aten graph") for s in page.summaries)
    assert any(s.startswith("refused fusions") for s in page.summaries)
    path, _ = mlp_page
    size = r"([\d.]+ [kMG]?B)"
    peaks = re.findall(rf"<p class='peak'>planned peak [^:]*: {size}; measured: {size}", path.read_text())
    graphs = sum(bool(re.match(r"graph-\d{3}_", s)) for s in page.sections)
    assert len(peaks) == graphs  # each graph: planned and measured


def test_report_names_fallbacks_and_graph_breaks(tmp_path):
    def program(x):
        y = sort_and_scale(x)
        torch._dynamo.graph_break()
        return y + 1

    path = tmp_path / "fallback.html"
    ember.report(program, torch.randn(4, 8), path=str(path), calls=2)
    page = ReportPage(path.read_text())
    fallbacks = [row for row in page.steps if row["kind"] == "fallback"]
    assert fallbacks and "sort" in fallbacks[0]["cells"]["ops"]
    assert float(fallbacks[0]["time-us"]) > 0
    assert "test_report.py" in fallbacks[0]["cells"]["sources"]
    text = path.read_text()
    assert "aten.sort.default" in text.split("id='fallbacks'")[1]
    assert "graph_break" in text.split("id='graph-breaks'")[1]


def test_nothing_is_recorded_without_a_report():
    assert not is_recording() and new_graph_record("forward", "key") is None
    compiled = torch.compile(sort_and_scale, backend="ember")
    compiled(torch.randn(4, 8))
    with torch.profiler.profile() as prof:
        compiled(torch.randn(4, 8))
    names = [e.name for e in prof.events() if e.name.startswith("ember ")]
    assert names and not any("step" in n for n in names)  # the plain labels, not the report's
    with recording():
        with pytest.raises(RuntimeError, match="one at a time"), recording():
            pass
    assert not is_recording()


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0",
]  # fmt: skip


def test_report_loads_in_headless_chromium(mlp_page, tmp_path):
    if not os.path.exists(CHROMIUM) or shutil.which(CHROMIUM) is None:
        pytest.skip(f"no browser: {CHROMIUM} is not installed (apt-get install chromium)")
    path, page = mlp_page
    command = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", path.as_uri()]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    # the page's script ran to its end: it adds this marker, counting the step rows it saw
    assert f'<div id="report-loaded">{len(page.steps)} steps</div>' in result.stdout
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    rows = ReportPage(result.stdout).steps
    assert len(rows) == len(page.steps) and all(float(r["time-us"]) > 0 for r in rows)


def test_ember_report_command_runs_a_script(tmp_path):
    from ember.cli import main

    script = tmp_path / "program.py"
    script.write_text(
        "import torch\n"
        "f = torch.compile(lambda x: (x * 2).relu().sum(0), backend='ember')\n"
        "for _ in range(3):\n"
        "    f(torch.randn(16, 8))\n"
    )
    main(["report", "-o", str(tmp_path / "page.html"), str(script)])
    rows = ReportPage((tmp_path / "page.html").read_text()).steps
    assert rows and all(float(r["time-us"]) > 0 for r in rows)
    assert any("program.py:2" in r["cells"]["sources"] for r in rows if r["kind"] == "kernel")


def test_measured_peak_counts_allocations_inside_the_call_only():
    from ember.debug.report_profile import median_after_first, window_peak

    events = [(5, 100), (10, 64), (12, 32), (14, -64), (16, 128), (20, -160), (30, 1000)]
    assert window_peak(events, 10, 20) == 160  # 64 + 32 - 64 + 128: the allocation before and after left out
    assert window_peak(events, 21, 29) == 0
    assert median_after_first([100.0, 3.0, 1.0, 2.0]) == 2.0  # the first (warm-up) call left out
    assert median_after_first([7.0]) == 7.0 and median_after_first([]) is None


def test_a_script_that_exits_non_zero_still_gets_its_page(tmp_path):
    from ember.report import report_script

    script = tmp_path / "failing.py"
    script.write_text(
        "import sys, torch\n"
        "f = torch.compile(lambda x: (x + 1).sin(), backend='ember')\n"
        "f(torch.randn(4)); f(torch.randn(4))\n"
        "sys.exit(3)\n"
    )
    with pytest.raises(SystemExit, match="exited with 3"):
        report_script(str(script), [], str(tmp_path / "page.html"))
    rows = ReportPage((tmp_path / "page.html").read_text()).steps
    assert any(r["kind"] == "kernel" and float(r["time-us"]) > 0 for r in rows)
