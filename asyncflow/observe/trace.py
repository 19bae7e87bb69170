"""Timelines of real and simulated runs: Chrome trace JSON and a PNG Gantt chart.

``write_sim_trace`` turns a simulated run's spans into complete events (``ph: "X"``,
microseconds; opens in Perfetto / chrome://tracing), one track per role;
:func:`write_trace` does the same for spans recorded by real roles. :func:`write_gantt`
draws any of these (a trace file, a trace dict, or spans) as a PNG, one row per track,
so a real run and its simulation are drawn by the same function.

matplotlib is optional (``pip install -c constraints.txt "asyncflow[plot]"``): it is
imported only inside :func:`write_gantt`, which raises :class:`PlotUnavailable` (one
line, with the fix) when it is missing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from asyncflow.config import ConfigError

ROLES = ["rollout", "reward", "reference", "actor"]
COLORS = {"rollout": "#4c72b0", "reward": "#55a868", "reference": "#8172b2", "actor": "#c44e52"}


# (role, name, start seconds, duration seconds)
Span = tuple[str, str, float, float]


class PlotUnavailable(ConfigError):
    """matplotlib is not installed."""


def chrome_trace(spans: Iterable[Span], process: str = "asyncflow") -> dict:
    """``spans``: iterable of (role, name, start seconds, duration seconds)."""
    tids: dict[str, int] = {}
    events = []
    for role, name, start, dur in spans:
        tid = tids.setdefault(role, ROLES.index(role) if role in ROLES else len(ROLES) + len(tids))
        events.append({"name": name, "cat": role, "ph": "X", "pid": 1, "tid": tid,
                       "ts": round(start * 1e6, 3), "dur": round(dur * 1e6, 3)})
    meta = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": process}}]
    meta += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": r}} for r, t in tids.items()]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def write_trace(spans: Iterable[Span], path: str | Path, process: str = "asyncflow") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(spans, process)))
    return path


def write_sim_trace(result: Any, path: str | Path) -> Path:
    """``result``: a :class:`asyncflow.planner.sim.SimResult` (its ``spans``)."""
    return write_trace(result.spans, path, "asyncflow (simulated)")


def tracks(trace: str | Path | dict | Iterable[Span]) -> tuple[str, dict[str, list[tuple[float, float]]]]:
    """(title, {track: [(start s, seconds), ...]}) of a trace path, trace dict or spans."""
    data = json.loads(Path(trace).read_text()) if isinstance(trace, (str, Path)) else trace
    if isinstance(data, dict):
        names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
        title = next((e["args"]["name"] for e in data["traceEvents"]
                      if e.get("ph") == "M" and e.get("name") == "process_name"), "asyncflow")
        spans = [(names.get(e["tid"], str(e["tid"])), e["ts"] / 1e6, e["dur"] / 1e6)
                 for e in data["traceEvents"] if e.get("ph") == "X"]
    else:
        title, spans = "asyncflow", [(role, start, dur) for role, _, start, dur in data]
    out: dict[str, list[tuple[float, float]]] = {}
    for role, start, dur in sorted(spans, key=lambda s: s[1]):
        out.setdefault(role, []).append((start, dur))
    return title, out


def named_tracks(trace: str | Path | dict | Iterable[Span]) -> dict[str, list[tuple[float, float, str]]]:
    """{track: [(start s, seconds, event name), ...]} sorted by start: :func:`tracks` with what each
    span is (a real run names the actor's ``train`` / ``step`` spans, the others by their role)."""
    data = json.loads(Path(trace).read_text()) if isinstance(trace, (str, Path)) else trace
    if isinstance(data, dict):
        names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
        spans = [(names.get(e["tid"], str(e["tid"])), e["ts"] / 1e6, e["dur"] / 1e6, e.get("name", ""))
                 for e in data["traceEvents"] if e.get("ph") == "X"]
    else:
        spans = [(role, start, dur, name) for role, name, start, dur in data]
    out: dict[str, list[tuple[float, float, str]]] = {}
    for role, start, dur, name in sorted(spans, key=lambda s: s[1]):
        out.setdefault(role, []).append((start, dur, name))
    return out


def _merge(spans: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """Join spans closer than ``gap`` (below the image's resolution: a real run has 100k)."""
    out: list[list[float]] = []
    for s, d in spans:
        if out and s - (out[-1][0] + out[-1][1]) <= gap:
            out[-1][1] = max(out[-1][1], s + d - out[-1][0])
        else:
            out.append([s, d])
    return [(s, d) for s, d in out]


def write_gantt(trace: str | Path | dict | Iterable[Span], path: str | Path, title: str | None = None,
                width_px: int = 1600) -> Path:
    """PNG Gantt chart of ``trace`` (a trace.json path, a Chrome trace dict, or spans):
    one row per track, busy spans as bars, busy fraction of the whole run in the label."""
    try:
        import matplotlib  # lazy: matplotlib, the optional [plot] extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib
    except ImportError:
        raise PlotUnavailable('a Gantt chart needs matplotlib: '
                              'pip install -c constraints.txt "asyncflow[plot]"') from None
    name, rows = tracks(trace)
    order = sorted(rows, key=lambda r: (ROLES.index(r) if r in ROLES else len(ROLES), r))
    t0 = min((s for r in rows.values() for s, _ in r), default=0.0)
    t1 = max((s + d for r in rows.values() for s, d in r), default=1.0)
    total = max(t1 - t0, 1e-9)
    fig, ax = plt.subplots(figsize=(width_px / 100, 0.6 * len(order) + 1.2), dpi=100)
    for i, role in enumerate(reversed(order)):
        busy = sum(d for _, d in rows[role])
        bars = _merge([(s - t0, d) for s, d in rows[role]], total / width_px)
        ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=COLORS.get(role, "#937860"))
        ax.text(total, i, f" {busy / total:.0%}", va="center", fontsize=8)
    ax.set_yticks(range(len(order)), list(reversed(order)))
    ax.set_xlim(0, total)
    ax.set_xlabel("seconds")
    ax.set_title(title or name)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
