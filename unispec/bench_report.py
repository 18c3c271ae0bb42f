"""`unispec bench`'s outputs: a rich table per run, the JSON file, the matplotlib PNG.

The PNG (Agg backend, no display needed) has two panels:

  left   tokens/s (median) bars: one group per (batch size, temperature), one bar per engine that ran
  right  acceptance per draft position (median) of the artifact: one line per (batch size, temperature)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.errors import UnispecError
from unispec.bench import BenchReport, Row

__all__ = ["headline", "report_tables", "write_json", "write_plot"]


def _f(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def report_tables(report: BenchReport) -> list[Any]:
    """The figures of every row that ran, then one line per engine and reason for the rows that did not."""
    from rich.markup import escape
    from rich.table import Table

    table = Table("engine", "batch", "temp", "tokens/s", "speedup", "cpu speedup", "expected", "target-only %",
                  "accepted len", "acceptance / position", "graph ms", "host ms", "host %", "graph cpu ms",
                  "host cpu ms", title=escape(f"unispec bench {report.config.artifact_dir}"),
                  title_justify="left", caption=escape(" · ".join(report.notes)), caption_justify="left")
    for row in (r for r in report.rows if r.passes):
        m = row.median
        per_position = " ".join(f"{a:.2f}" for a in m.get("acceptance_per_position", []))
        mix = m.get("target_only_share") if row.engine == report.artifact_engine else None   # `none`: all
        table.add_row(escape(row.engine), str(row.batch_size), f"{row.temperature:g}", _f(m.get("tokens_per_s")),
                      _f(row.speedup, ".2f", "×"), _f(row.cpu_speedup, ".2f", "×"),
                      _f(row.expected_speedup, ".2f", "×"), _f(None if mix is None else 100 * mix, ".0f"),
                      _f(m.get("mean_accepted_length"), ".2f"), per_position,
                      _f(m.get("graph_ms_per_step"), ".2f"), _f(m.get("host_ms_per_step"), ".2f"),
                      _f(100 * m["host_share"] if "host_share" in m else None, ".0f"),
                      _f(m.get("graph_cpu_ms_per_step"), ".3f"), _f(m.get("host_cpu_ms_per_step"), ".3f"))
    skipped: dict[tuple[str, str], list[Row]] = {}
    for row in (r for r in report.rows if r.why):
        skipped.setdefault((row.engine, row.why), []).append(row)
    if not skipped:
        return [table, escape(f"speedup = {report.artifact_engine} tokens/s ÷ the row's, same batch and temperature")]
    not_run = Table("engine", "cells", "why not", title="not run", title_justify="left")
    for (engine, why), rows in skipped.items():
        cells = ", ".join(f"{r.batch_size}/{r.temperature:g}" for r in rows)
        not_run.add_row(escape(engine), escape(f"batch/temp {cells}"), escape(why))
    return [table, escape(f"speedup = {report.artifact_engine} tokens/s ÷ the row's, same batch and temperature"),
            not_run]


def headline(report: BenchReport) -> list[str]:
    """Per cell, one line: the artifact's speedup over each engine that ran, and its host share."""
    lines = []
    for cell in _cells(report.rows):
        ours, others = cell[0], [r for r in cell[1:] if r.speedup]
        host = ours.median.get("host_share")
        parts = [f"{r.speedup:.2f}× {r.engine}" for r in others]
        if ours.expected_speedup is not None:
            parts.append(f"expected {ours.expected_speedup:.2f}× when speculating every step")
        if ours.median.get("target_only_share") is not None:
            parts.append(f"{100 * ours.median['target_only_share']:.0f}% of steps target-only")
        if host is not None:
            parts.append(f"host {100 * host:.0f}% of step time")
        lines.append(f"batch {ours.batch_size}, temperature {ours.temperature:g}: {ours.engine} "
                     f"{_f(ours.median.get('tokens_per_s'))} tokens/s" + (": " + ", ".join(parts) if parts else ""))
    return lines


def _cells(rows: list[Row]) -> list[list[Row]]:
    cells: dict[tuple[int, float], list[Row]] = {}
    for row in rows:
        cells.setdefault((row.batch_size, row.temperature), []).append(row)
    return list(cells.values())


def write_json(report: BenchReport, path: Path) -> Path:
    """The report as compact JSON (one line): a run's per-pass figures are most of it, and indented they
    took ~1.5x the bytes (the committed runs under docs/bench are read with tools; the .txt beside is for eyes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), separators=(",", ":")) + "\n")
    return path


def write_plot(report: BenchReport, path: Path) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise UnispecError("--plot needs matplotlib: pip install 'unispec[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = _cells(report.rows)
    engines = list(dict.fromkeys(r.engine for r in report.rows if r.passes))
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / max(len(engines), 1)
    for j, engine in enumerate(engines):
        values = [next((r.median["tokens_per_s"] for r in cell if r.engine == engine and r.passes), 0.0)
                  for cell in cells]
        bars.bar([i + (j - (len(engines) - 1) / 2) * width for i in range(len(cells))], values, width, label=engine)
    bars.set_xticks(range(len(cells)), [f"batch {c[0].batch_size}\nT={c[0].temperature:g}" for c in cells])
    bars.set_ylabel("tokens/s (median)")
    bars.set_title("throughput")
    bars.legend(fontsize="small")
    for cell in cells:
        acceptance = cell[0].median.get("acceptance_per_position") or []
        if acceptance:
            lines.plot(range(1, len(acceptance) + 1), acceptance, marker="o",
                       label=f"batch {cell[0].batch_size}, T={cell[0].temperature:g}")
    lines.set_xlabel("draft position")
    lines.xaxis.get_major_locator().set_params(integer=True)
    lines.set_ylabel("acceptance rate")
    lines.set_ylim(0, 1.05)
    lines.set_title(f"{report.artifact_engine}: acceptance per position")
    if lines.get_legend_handles_labels()[0]:
        lines.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
