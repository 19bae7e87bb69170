"""PNG Gantt chart of a trace: the same function for a simulated run and a trace file."""

from __future__ import annotations

import json

import pytest

from asyncflow.observe.trace import _merge, tracks, write_trace

SPANS = [("rollout", "decode", 0.0, 1.0), ("actor", "train", 0.5, 0.25), ("rollout", "decode", 1.0, 0.5),
         ("reward", "reward", 1.2, 0.1)]


def test_tracks_read_spans_and_trace_files_alike(tmp_path):
    path = write_trace(SPANS, tmp_path / "trace.json", "run")
    for src in (SPANS, path, json.loads(path.read_text())):
        _, rows = tracks(src)
        assert rows["rollout"] == [(0.0, 1.0), (1.0, 0.5)] and rows["actor"] == [(0.5, 0.25)]
    assert tracks(path)[0] == "run"
    assert _merge([(0.0, 1.0), (1.0, 0.5), (2.0, 0.1)], gap=0.01) == [(0.0, 1.5), (2.0, 0.1)]


def test_gantt_png_of_a_simulated_run_and_of_a_trace_file(tmp_path):
    pytest.importorskip("matplotlib")
    from asyncflow.planner.costs import ConstantCost
    from asyncflow.planner.sim import Allocation, Workload, simulate
    from asyncflow.observe.trace import write_gantt, write_sim_trace

    r = simulate(Workload(prompts_per_step=2, group_size=2, lengths={4: 1.0}, steps=4),
                 Allocation("async", micro_prompts=1, slots=4), ConstantCost(decode=1.0, train_per_row=0.5, reward=0.1))
    for src in (r.spans, write_sim_trace(r, tmp_path / "trace.json")):
        png = write_gantt(src, tmp_path / "gantt.png")
        head = png.read_bytes()
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and len(head) > 1000
        png.unlink()


def test_gantt_without_matplotlib_is_one_line_with_the_fix(tmp_path, monkeypatch):
    import builtins

    from asyncflow.observe.trace import PlotUnavailable, write_gantt

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name.startswith("matplotlib") else real(name, *a, **k))
    with pytest.raises(PlotUnavailable, match=r'needs matplotlib: pip install .*asyncflow\[plot\]'):
        write_gantt(SPANS, tmp_path / "g.png")
