"""`ember report`'s page: graph records (debug/record.py) and measurements (debug/report_profile.py)
-> one self-contained HTML file (inline style and a small script; no network, no server).

The page's structure is what tests read: each step is a `<tr class="step">` with data-graph,
data-step, data-kind, data-time-us and data-bytes attributes and cells of class ops, sources;
the script, once it has run, adds `<div id="report-loaded">`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

from ember.debug.record import GraphRecord, StepRecord
from ember.debug.report_profile import Measured, median_after_first


@dataclass
class PageFacts:
    """What the page shows besides the graphs."""

    title: str
    copy_bytes_per_s: float
    device: str
    profiled_calls: str  # how the times were taken, in words
    fallback_ops: dict[str, int] = field(default_factory=dict)
    graph_breaks: list[tuple[str, int]] = field(default_factory=list)  # dynamo's reason, how often
    compile_seconds: dict[str, float] = field(default_factory=dict)  # the whole run's, ember.metrics


def render_page(graphs: list[GraphRecord], measured: Measured, facts: PageFacts) -> str:
    rows = [(g, s) for g in graphs for s in g.steps]
    timed = sorted(((g, s) for g, s in rows if measured.median_us(s.label) is not None),
                   key=lambda gs: -(measured.median_us(gs[1].label) or 0.0))  # fmt: skip
    total_us = sum(measured.median_us(s.label) or 0.0 for _, s in timed)
    body = [
        f"<h1>{escape(facts.title)}</h1>",
        _summary(graphs, measured, facts, total_us),
        "<section id='slowest'><h2>Slowest steps, all graphs</h2>",
        "<p>Median time of one call of each step (kernel, extern or fallback; its first call left out), "
        "slowest first, and its fastest call (times are wall times: on a busy machine the fastest is the "
        "closest to the step's own cost); click a column's header to sort by it. A kernel's bytes are those "
        "of the buffers it reads and writes, each once; its bandwidth is bytes / time, and % of copy compares "
        "that with a large Tensor.copy_ on this machine (buffers that fit in a cache can go past 100%).</p>",
        _steps_table(timed[:TOP_STEPS], measured, facts, total_us, with_graph=True),
        "</section>",
    ]
    body += [_graph_section(g, measured, facts, total_us) for g in graphs]
    body += [_fallbacks(facts), _graph_breaks(facts), _compile_time(facts)]
    return PAGE.format(title=escape(facts.title), style=STYLE, body="\n".join(body), script=SCRIPT)


TOP_STEPS = 20


def _summary(graphs: list[GraphRecord], measured: Measured, facts: PageFacts, total_us: float) -> str:
    kernels = sum(1 for g in graphs for s in g.steps if s.kind == "kernel")
    externs = sum(1 for g in graphs for s in g.steps if s.kind != "kernel")
    where = "GPU side of each range" if measured.on_device else "CPU time of each range (the call is synchronous)"
    items = [
        ("graphs compiled", str(len(graphs))),
        ("kernels / extern and fallback calls", f"{kernels} / {externs}"),
        ("device", facts.device),
        ("time of one call of every step (sum of medians)", _us(total_us)),
        ("times", f"{facts.profiled_calls}; {where}"),
        ("copy bandwidth (a large Tensor.copy_, read + write)", f"{facts.copy_bytes_per_s / 1e9:.2f} GB/s"),
    ]
    cells = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in items)
    return f"<section id='summary'><h2>Summary</h2><table class='facts'>{cells}</table></section>"


def _steps_table(rows: list[tuple[GraphRecord, StepRecord]], measured: Measured, facts: PageFacts,
                 total_us: float, with_graph: bool = False) -> str:  # fmt: skip
    head = ["graph"] if with_graph else []
    head += [
        "step",
        "kind",
        "name",
        "time",
        "fastest",
        "% of all",
        "bytes",
        "bandwidth",
        "% of copy",
        "aten ops",
        "source lines",
    ]
    numeric = {"step", "time", "fastest", "% of all", "bytes", "bandwidth", "% of copy"}
    header = "".join(f"<th class='{'num' if h in numeric else 'text'}'>{escape(h)}</th>" for h in head)
    lines = [f"<table class='steps sortable'><thead><tr>{header}</tr></thead><tbody>"]
    lines += [_step_row(g, s, measured, facts, total_us, with_graph) for g, s in rows]
    lines.append("</tbody></table>")
    return "\n".join(lines)


def _step_row(graph: GraphRecord, step: StepRecord, measured: Measured, facts: PageFacts, total_us: float,
              with_graph: bool) -> str:  # fmt: skip
    time_us = measured.median_us(step.label)
    share = 100 * time_us / total_us if time_us and total_us else None
    bandwidth = step.bytes_moved / (time_us * 1e-6) if time_us and step.kind == "kernel" else None
    of_copy = 100 * bandwidth / facts.copy_bytes_per_s if bandwidth and facts.copy_bytes_per_s else None
    sources = "".join(f"<div>{escape(s)}</div>" for s in step.sources)
    sources += f"<div class='more'>... and {step.more_sources} more</div>" if step.more_sources else ""
    name = f"<a href='#code-{graph.name}-{step.index}'>{escape(step.name)}</a>" if step.code else escape(step.name)
    cells = [_cell(graph.name, graph.name)] if with_graph else []
    cells += [
        _cell(str(step.index), step.index),
        f"<td class='kind {step.kind}'>{step.kind}</td>",
        f"<td class='name'>{name}</td>",
        _cell(_us(time_us) if time_us is not None else "not run", time_us or 0),
        _cell(_us(fastest := measured.fastest_us(step.label)), fastest or 0),
        _cell(f"{share:.1f}%" if share is not None else "", share or 0),
        _cell(_bytes(step.bytes_moved), step.bytes_moved),
        _cell(f"{bandwidth / 1e9:.2f} GB/s" if bandwidth else "", bandwidth or 0),
        _cell(f"{of_copy:.0f}%" if of_copy is not None else "", of_copy or 0),
        f"<td class='ops'>{escape(', '.join(step.aten_ops))}</td>",
        f"<td class='sources'>{sources}</td>",
    ]
    time_attribute = time_us if time_us is not None else ""
    attributes = (f"class='step' data-graph='{graph.name}' data-step='{step.index}' data-kind='{step.kind}' "
                  f"data-time-us='{time_attribute}' data-bytes='{step.bytes_moved}'")  # fmt: skip
    return f"<tr {attributes}>{''.join(cells)}</tr>"


def _cell(text: str, sort_key: object) -> str:
    return f"<td data-sort='{escape(str(sort_key))}'>{escape(text)}</td>"


def _graph_section(graph: GraphRecord, measured: Measured, facts: PageFacts, total_us: float) -> str:
    by_time = sorted(graph.steps, key=lambda s: -(measured.median_us(s.label) or 0.0))
    calls = measured.graph_us.get(graph.name, [])
    timing = (f"{len(calls)} profiled call(s); one call (median, its first left out): "
              f"{_us(median_after_first(calls))}" if calls else "not called while profiled")  # fmt: skip
    parts = [
        f"<section class='graph' id='graph-{graph.name}'><h2>Graph {graph.name} <small>{graph.key[:8]}</small></h2>",
        f"<p class='calls'>{escape(timing)}</p><p class='peak'>{escape(_peak(graph, measured))}</p>",
        _steps_table([(graph, s) for s in by_time], measured, facts, total_us),
        _collapsible(f"aten graph ({graph.aten_graph.count(chr(10))} lines)", f"<pre>{escape(graph.aten_graph)}</pre>"),
        _collapsible(f"refused fusions ({len(graph.refusals)}; {graph.fusions} fusions made)",
                     "<ul class='refusals'>" + "".join(f"<li>{escape(r)}</li>" for r in graph.refusals) + "</ul>"),
        _collapsible("compile time per stage", _seconds_table(graph.timings)),
    ]  # fmt: skip
    for step in graph.steps:
        if step.code:
            parts.append(f"<details class='code' id='code-{graph.name}-{step.index}'><summary>step {step.index}: "
                         f"{escape(step.name)} code</summary><pre>{escape(step.code)}</pre></details>")  # fmt: skip
    if graph.fallback_ops:
        parts.append(f"<p>fallbacks in this graph: {escape(', '.join(graph.fallback_ops))}</p>")
    parts.append("</section>")
    return "\n".join(parts)


def _peak(graph: GraphRecord, measured: Measured) -> str:
    """Planned against measured peak (Note: measured peak, debug/report_profile.py)."""
    planned = f"planned peak of the buffers the wrapper allocates: {_bytes(graph.planned_peak_bytes)}; measured: "
    peak = measured.peak_bytes.get(graph.name)
    if peak is None:
        return planned + "not measured (not run)"
    return planned + (
        f"{_bytes(peak)} (the most bytes torch allocated at once during one call of the graph, above the level "
        "at its start, from the profiler's memory events: the wrapper's buffers and the externs' outputs and "
        "workspaces, less the inputs it lets go of; large buffers the wrapper takes again from its pool are not "
        "new allocations and do not count)"
    )


def _collapsible(summary: str, content: str) -> str:
    return f"<details><summary>{escape(summary)}</summary>{content}</details>"


def _seconds_table(seconds: dict[str, float]) -> str:
    rows = "".join(f"<tr><td>{escape(k)}</td><td data-sort='{v}'>{v:.3f} s</td></tr>" for k, v in seconds.items())
    return f"<table class='stages sortable'><thead><tr><th class='text'>stage</th><th class='num'>seconds</th>" \
           f"</tr></thead><tbody>{rows}</tbody></table>"  # fmt: skip


def _fallbacks(facts: PageFacts) -> str:
    if not facts.fallback_ops:
        return "<section id='fallbacks'><h2>Fallbacks</h2><p>none: every op was lowered</p></section>"
    rows = "".join(f"<li>{escape(op)}: {n} use(s) in the compiled graphs</li>" for op, n in facts.fallback_ops.items())
    return f"<section id='fallbacks'><h2>Fallbacks (aten ops ember has no lowering for)</h2><ul>{rows}</ul></section>"


def _graph_breaks(facts: PageFacts) -> str:
    if not facts.graph_breaks:
        return "<section id='graph-breaks'><h2>Graph breaks</h2><p>none</p></section>"
    rows = "".join(f"<li><pre>{escape(reason)}</pre>({n} time(s))</li>" for reason, n in facts.graph_breaks)
    return f"<section id='graph-breaks'><h2>Graph breaks (dynamo's reasons)</h2><ul>{rows}</ul></section>"


def _compile_time(facts: PageFacts) -> str:
    table = _seconds_table(facts.compile_seconds)
    return f"<section id='compile-time'><h2>Compile time, all graphs</h2>{table}</section>"


def _us(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value / 1e3:.2f} ms" if value >= 1e3 else f"{value:.1f} us"


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>{style}</style></head>
<body>
{body}
<script>{script}</script>
</body></html>
"""

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.5em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: .5em 0; } td, th { border: 1px solid #ddd; padding: 2px 6px; }
th { background: #f3f3f3; text-align: left; } table.sortable th { cursor: pointer; }
td[data-sort] { text-align: right; white-space: nowrap; } td.ops, td.sources { font-size: 12px; }
td.sources div { font-family: monospace; } td.kind.fallback { color: #b00; } td.kind.extern { color: #05a; }
pre { background: #f8f8f8; padding: .5em; overflow-x: auto; font-size: 12px; max-height: 40em; }
details { margin: .3em 0; } summary { cursor: pointer; } small { color: #888; }
"""

# Sorting by a clicked header (numbers by each cell's data-sort), and the marker a test looks for.
SCRIPT = """
(function () {
  function key(row, i, numeric) {
    var cell = row.children[i];
    if (!cell) return numeric ? 0 : "";
    var v = cell.getAttribute("data-sort");
    return numeric ? parseFloat(v || "0") : (v || cell.textContent);
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    table.querySelectorAll("th").forEach(function (th, i) {
      th.addEventListener("click", function () {
        var numeric = th.classList.contains("num"), body = table.tBodies[0];
        var down = th.getAttribute("data-down") !== "1";
        th.setAttribute("data-down", down ? "1" : "0");
        Array.from(body.rows).sort(function (a, b) {
          var x = key(a, i, numeric), y = key(b, i, numeric);
          return (x < y ? -1 : x > y ? 1 : 0) * (down ? -1 : 1);
        }).forEach(function (row) { body.appendChild(row); });
      });
    });
  });
  var marker = document.createElement("div");
  marker.id = "report-loaded";
  marker.textContent = document.querySelectorAll("tr.step").length + " steps";
  document.body.appendChild(marker);
})();
"""
