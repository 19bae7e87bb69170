"""benchmarks/minimal_grpo.py and benchmarks/vs_trl.py run end to end (``--smoke``: 1 round of
2 steps of 8 prompts, on the untrained tiny model so that no warm-start runs). vs_trl needs the
``bench`` extra (trl): skipped without it. No timing is checked: only that every side trains
(gpu_scale's ``--small``, sampling's one round: that every side runs), the floors'
arithmetic, and that a gpu_scale phase past its budget is killed and recorded."""

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
    for name in ("minimal_grpo", "vs_trl", "gpu_scale", "gpu_phases", "gpu_floors", "engine", "logprob_memory"):
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


def test_gpu_scale_small_runs_every_phase_and_writes_each_result_as_a_json_line(benchmarks, tmp_path):
    """The GPU command's whole path on a CPU: a model folder built in code, every engine side
    (the eager one skipped, with its reason, until the engine has a ``cuda_graphs`` switch),
    training with and without chunked log-probs, sync and async runs; the floors of an H200."""
    import gpu_scale

    rows = gpu_scale.main(["--small", "--card", "H200", "--out", str(tmp_path)])
    assert rows == [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    eng = [r for r in rows if r["phase"] == "engines"]
    assert {r["engine"] for r in eng} >= {"hf_paged", "generate"} and all("error" not in r for r in eng)
    measured = [r for r in eng if "tokens_per_s" in r]
    assert len(measured) >= 3 and all(r["useful_tokens"] > 0 and 0 < r["of_floor"] < 1 for r in measured)
    assert all("skipped" in r for r in eng if "tokens_per_s" not in r)
    floors = [r for r in rows if r["phase"] == "floors"]
    assert {r["what"] for r in floors} == {"decode_step", "sync_step"}
    train = {r["logprob_chunk_mib"]: r for r in rows if r["phase"] == "train_memory"}
    assert set(train) == {0.02, 0.0} and all(r["trained_tokens_per_s"] > 0 and r["mfu"] > 0 for r in train.values())
    e2e = {r["mode"]: r for r in rows if r["phase"] == "e2e"}
    assert set(e2e) == {"sync", "async"} and all(r["samples_per_s"] > 0 for r in e2e.values())
    short, long = 4, 16
    for mode in ("sync", "async"):  # every answer has one of the forced lengths
        (run,) = (tmp_path / f"runs-{mode}").iterdir()
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(lines) == 2 and all(short <= m["response_len"] <= long for m in lines)


def test_gpu_scale_kills_a_phase_past_its_budget_and_goes_on(benchmarks, tmp_path):
    """A phase runs in a process of its own; past its budget it is killed (its process group), the
    timeout is recorded, and the next phase still starts (here: none left, the report still prints)."""
    import gpu_scale

    rows = gpu_scale.main(["--out", str(tmp_path), "--phases", "setup", "--budget", "setup=1"])
    status = [r for r in rows if r.get("status")]
    assert len(status) == 1 and status[0]["status"] == "timeout" and status[0]["wall_s"] < 30


def test_logprob_memory_script_shows_the_chunked_peak_below_the_plain_one(benchmarks):
    import logprob_memory

    rows = logprob_memory.main(["--tokens", "64", "--chunk-mib", "0", "0.05", "--vocab", "20000", "--hidden", "16"])
    plain, chunked = (r["peak_bytes"] for r in rows)
    assert chunked < plain / 2 and plain > rows[0]["logits_bytes"]


def test_gpu_floors_hand_computed(benchmarks):
    """The 0.5B-shaped model at 256 answers of mean context 335 on an H200: 0.99 GB of weights and
    1.05 GB of KV a step over 4.8 TB/s (the bytes bound; 0.26 ms of FLOPs) = 0.42 ms."""
    import gpu_floors as fl

    shape = fl.Shape(494_032_768, 24, 896, 14, 2)
    ctx = fl.mean_context(32, 128, 1024, 0.125)
    step = fl.decode_step(shape, 256, ctx, 4.8e12, 989e12)
    assert step["weight_bytes"] == 2 * 494_032_768
    assert step["kv_bytes"] == pytest.approx(256 * ctx * 24 * 2 * 2 * 64 * 2, rel=1e-12)
    assert step["floor_s"] == pytest.approx((988_065_536 + step["kv_bytes"]) / 4.8e12, rel=1e-12)
    assert step["floor_s"] == pytest.approx(4.25e-4, rel=0.01)
    assert fl.train_flops(shape, [1056]) == pytest.approx(6 * 494_032_768 * 1056 + 12 * 24 * 896 * 1056**2)
    assert fl.card("NVIDIA H200") == (4.8e12, 989e12) and fl.card("cpu") is None


def test_sampling_benchmark_times_both_samplers_at_every_vocabulary():
    import subprocess

    out = subprocess.run([sys.executable, str(BENCH / "sampling.py"), "--rows", "4", "--rounds", "1"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    rows = [ln.split() for ln in out[2:]]
    assert [r[0] for r in rows] == ["308", "32000", "151936"] and all(r[-1].endswith("x") for r in rows), out
