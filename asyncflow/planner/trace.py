"""Chrome trace JSON (opens in Perfetto / chrome://tracing): one track per role.

``write_sim_trace`` turns a simulated run's spans into complete events (``ph: "X"``,
microseconds); :func:`write_trace` does the same for spans recorded by real roles.
"""

from __future__ import annotations

import json
from pathlib import Path

ROLES = ["rollout", "reward", "reference", "actor"]


def chrome_trace(spans, process: str = "asyncflow") -> dict:
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


def write_trace(spans, path: str | Path, process: str = "asyncflow") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(spans, process)))
    return path


def write_sim_trace(result, path: str | Path) -> Path:
    return write_trace(result.spans, path, "asyncflow (simulated)")
