"""The simulator's terms, read the same way from a real run's trace and from a simulated one.

A real ``trace.json`` has one track per role: every ``Role.work`` section as a span, the
actor's named ``train`` (one per fetch) and ``step`` (optimizer step, weight export and
publish); ``SimResult.spans`` has the same tracks and names (the simulator names more:
rollout's ``swap`` / ``prefill`` / ``decode``). :func:`step_terms` cuts either into training
steps at the actor's ``step`` spans and measures, per steady step (1 .. N-1), the median of:

* ``step_s``: from one ``step`` span's end to the next (what the driver's samples/s divides by);
* ``rollout_s``: rollout's busy seconds in the step; ``train_s``: the actor's ``train`` spans';
  ``optimizer_s``: its ``step`` span;
* ``boundary_s``: the actor's idle time from a ``step`` span's end to its next ``train`` span
  (the driver's round trip plus any wait for rows);
* stream only (rollout waits for every version, so each step is one chain): ``transfer_s``,
  a ``step`` span's end to rollout's next span (publish -> staged -> swap); ``fetch_s``,
  rollout's first span's end to its second (the swap, then the prompt fetch's round trip
  before the prefill); ``data_s``, rollout's last span before the actor's first ``train`` of
  the step to that span (the rows' put -> get hop, the outbox's wait).

:func:`structure` counts the dataflow's events (decode rounds, swaps, steps, fetches,
evaluations beside training, checkpoints) from a real run's summary and trace, and
:func:`sim_structure` the same from a simulation, for the structural test
(``tests/test_planner_terms.py``): a workflow change that changes the dataflow without
the simulator fails it. Nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from asyncflow.observe.trace import named_tracks
from asyncflow.planner.workload import SimResult

Named = dict[str, list[tuple[float, float, str]]]  # role -> [(start s, seconds, name)]
TERMS = ("step_s", "rollout_s", "train_s", "optimizer_s", "boundary_s", "transfer_s", "fetch_s", "data_s")


def _ends(actor: list[tuple[float, float, str]]) -> list[float]:
    return [s + d for s, d, n in actor if n == "step"]


def _busy(spans: list[tuple[float, float, str]], t0: float, t1: float, name: str | None = None) -> float:
    return sum(max(0.0, min(s + d, t1) - max(s, t0)) for s, d, n in spans if name is None or n == name)


def _stream(roll: list, actor: list, t0: float, t1: float) -> dict[str, float]:
    """The chain of one stream step that starts at the ``step`` span ending at ``t0``."""
    out: dict[str, float] = {}
    mine = [(s, d) for s, d, _ in roll if t0 <= s < t1]
    if mine:
        out["transfer_s"] = mine[0][0] - t0
    if len(mine) > 1:
        out["fetch_s"] = mine[1][0] - (mine[0][0] + mine[0][1])
    first = next((s for s, _, n in actor if n == "train" and s >= t0), None)
    before = [s + d for s, d in mine if first is not None and s + d <= first]
    if first is not None and before and first < t1:
        out["data_s"] = first - max(before)
    return out


def step_terms(trace: Any, mode: str) -> dict[str, float]:
    """Per-step medians of :data:`TERMS` (stream-only ones in ``stream``) of a trace path, a trace
    dict or simulated spans; empty when the trace has fewer than 3 ``step`` spans."""
    tracks: Named = named_tracks(trace.spans if isinstance(trace, SimResult) else trace)
    actor, roll = tracks.get("actor", []), tracks.get("rollout", [])
    ends = _ends(actor)
    rows: list[dict[str, float]] = []
    for t0, t1 in zip(ends, ends[1:]):
        r = {"step_s": t1 - t0, "rollout_s": _busy(roll, t0, t1), "train_s": _busy(actor, t0, t1, "train"),
             "optimizer_s": _busy(actor, t0, t1, "step")}
        nxt = next((s for s, _, n in actor if n == "train" and s >= t0), None)
        if nxt is not None and nxt < t1 and mode != "sync":  # (sync: its rollout comes between)
            r["boundary_s"] = nxt - t0
        if mode == "stream":
            r.update(_stream(roll, actor, t0, t1))
        rows.append(r)
    if len(rows) < 2:
        return {}
    return {k: float(np.median([r[k] for r in rows if k in r])) for k in TERMS if any(k in r for r in rows)}


def format_terms(real: dict[str, float], sim: dict[str, float]) -> str:
    """One line per term present in either: real vs simulated milliseconds per step."""
    lines = []
    for k in TERMS:
        if k in real or k in sim:
            a, b = real.get(k), sim.get(k)
            err = f"{b / a - 1:+.0%}" if a and b is not None else ""
            lines.append(f"  {k:<12}{'' if a is None else f'{a * 1e3:8.1f}':>9}"
                         f"{'' if b is None else f'{b * 1e3:8.1f}':>9} ms  {err}")
    return "\n".join(["  term          real      sim"] + lines)


# ---------------------------------------------------------------------------- structure
def structure(run_dir: str | Path, summary: dict, lines: list[dict]) -> dict[str, Any]:
    """The dataflow's events of a finished real run (``summary``: its summary dict, ``lines``: its
    metrics lines): the roles' tracks (the evaluator's aside), the trainer's (rank 0's) ``step``
    spans and fetches (``train`` spans), rollout's (rank 0's) decode rounds and swaps, the
    evaluations due and whether they ran beside training, the checkpoints written."""
    tracks = named_tracks(Path(run_dir) / "trace.json")
    actor = tracks.get("actor", [])
    beside = summary.get("heldout_evals")
    return {
        "tracks": sorted(t for t in tracks if t != "evaluator"),
        "steps": sum(1 for *_, n in actor if n == "step"),
        "fetches": sum(1 for *_, n in actor if n == "train"),
        "decode": summary.get("rollout_decode_steps", 0),
        "swaps": summary.get("rollout_swaps", 0),
        "eval_due": beside["due"] if beside else sum(1 for m in lines if "heldout_acc" in m),
        "eval_beside": bool(beside),
        "checkpoints": len(summary.get("checkpoint_pause_s") or []),
    }


def sim_structure(r: SimResult) -> dict[str, Any]:
    """:func:`structure` of a simulated run."""
    c = r.counts
    count = lambda role, what: sum(1 for ro, w, *_ in r.spans if ro == role and w == what)  # noqa: E731
    return {"tracks": sorted({role for role, *_ in r.spans} - {"evaluator", "checkpoint"}),
            "steps": count("actor", "step"), "fetches": count("actor", "train"),
            "decode": count("rollout", "decode"), "swaps": count("rollout", "swap"),
            "eval_due": c.get("eval_beside", 0) + c.get("eval_skipped", 0) + c.get("eval_pause", 0),
            "eval_beside": bool(c.get("eval_beside", 0) + c.get("eval_skipped", 0)),
            "checkpoints": c.get("checkpoint", 0)}
