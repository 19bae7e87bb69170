"""benchmarks/minimal_grpo.py and benchmarks/vs_trl.py run end to end (``--smoke``: 1 round of
2 steps of 8 prompts, on the untrained tiny model so that no warm-start runs). vs_trl needs the
``bench`` extra (trl): skipped without it. No timing is checked: only that every side trains
(gpu_scale's ``--small``, sampling's one round: that every side runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"
TINY = ["warmstart.enabled=false"]


@pytest.fixture
def benchmarks(monkeypatch):
    # importable by name: the scripts' spawned processes (plain loop --procs, TRL) import them again
    monkeypatch.syspath_prepend(str(BENCH))
    yield
    for name in ("minimal_grpo", "vs_trl", "gpu_scale", "engine", "ttrl"):
        sys.modules.pop(name, None)


def test_minimal_grpo_smoke_runs_the_plain_loop_and_asyncflow_sync(benchmarks, tmp_path):
    import minimal_grpo

    speeds = minimal_grpo.main(["--smoke", "--procs", "1", "--sides", "plain", "sync", "--run-dir", str(tmp_path),
                                *TINY])
    assert set(speeds) == {"plain-1p", "sync"} and all(len(v) == 1 and v[0] > 0 for v in speeds.values())


@pytest.mark.slow
def test_minimal_grpo_smoke_with_two_processes_and_sync_dp2(benchmarks, tmp_path):
    import minimal_grpo

    speeds = minimal_grpo.main(["--smoke", "--procs", "2", "--sides", "plain", "sync-dp2",
                                "--run-dir", str(tmp_path), *TINY])
    assert all(v[0] > 0 for v in speeds.values())


def test_vs_trl_smoke_runs_trl_and_asyncflow_sync(benchmarks, tmp_path):
    pytest.importorskip("trl")
    import vs_trl

    speeds = vs_trl.main(["--smoke", "--sides", "trl-1t", "sync", "--run-dir", str(tmp_path), *TINY])
    assert set(speeds) == {"trl-1t", "sync"} and all(v[0] > 0 for v in speeds.values())


def test_gpu_scale_small_runs_both_engines_and_modes_on_a_model_folder_built_in_code(benchmarks, tmp_path):
    import gpu_scale

    res = gpu_scale.main(["--small", "--rounds", "1", "--steps", "2", "--out", str(tmp_path)])
    e = res["engines"]
    assert e["useful_tokens"] > 0 and e["ours_tokens_per_s"] > 0 and e["hf_tokens_per_s"] > 0
    assert e["hf_idle"] > e["ours_idle"]  # static batches wait on their longest answer; continuous ones refill
    assert sorted(r["mode"] for r in res["train"]) == ["async", "sync"]
    assert all(r["samples_per_s"] > 0 for r in res["train"])
    short, long = res["args"]["short"], res["args"]["long"]
    for run in (tmp_path / "runs").iterdir():  # every answer has one of the forced lengths
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(lines) == 2 and all(short <= m["response_len"] <= long for m in lines)
        assert all(m["tokens"] % m["samples"] == 0 or short < m["tokens"] / m["samples"] < long for m in lines)


def test_sampling_benchmark_times_both_samplers_at_every_vocabulary():
    import subprocess

    out = subprocess.run([sys.executable, str(BENCH / "sampling.py"), "--rows", "4", "--rounds", "1"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    rows = [ln.split() for ln in out[2:]]
    assert [r[0] for r in rows] == ["308", "32000", "151936"] and all(r[-1].endswith("x") for r in rows), out


def test_ttrl_smoke_runs_label_free_with_trees_and_ear_and_reports_a_table(benchmarks, tmp_path, capsys):
    import ttrl

    res = ttrl.main(["--smoke", "--tasks", "addition", "--seeds", "0", "--variants", "ttrl_etmr_ear",
                     "--run-dir", str(tmp_path)])
    (r,) = res
    assert r["steps"] == 2 and r["pseudo_label_first"] is not None and r["etmr"]["groups"] == 8
    assert 0 < r["generated_per_step"] <= r["tokens_per_step"]  # a shared prefix is generated once
    ttrl.main(["--report", str(tmp_path / "results.json")])
    assert "addition   ttrl_etmr_ear" in capsys.readouterr().out
