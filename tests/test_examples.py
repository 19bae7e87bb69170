"""The shipped examples train by configuration only, as a user runs them.

Each example folder is copied to a temporary folder, its generators run there
(``make_data.py``, and ``build_model.py`` for the Hugging Face one), then
``asyncflow train <its yaml>`` runs with nothing but ``run_dir`` and ``progress`` added.
The tiny-model example has no model folder of its own.

Issue 23 asks for +10 points of held-out metric within 5 minutes of wall time
(:data:`MIN_GAIN`, :data:`MAX_RL_S`; :data:`MAX_RUN_S` bounds the whole run). Held-out
noise: one standard error of a paired difference on 500 rows is ~3 points.

Both warm-started models are right when greedy but unsure: sampled at temperature 1.0,
~2% of uppercase's answers and 0.3% of word_order_hf's are exact, so GRPO groups scored all
0 and RL drifted (lr 3e-4: uppercase +7 to +23 in 600 steps and -12 to -33 in 60 sync steps;
word_order_hf 48.6% -> 27.4% in 200 steps). Both examples now sample at 0.5 with lr 1e-4.
Measured 2026-11-25 on 2 CPU cores under load (load average 8-30 from other sessions),
async as this test runs them: uppercase 300 steps, seed 0 51.4% -> 75.0% (+23.6, 147 s of
RL), seed 1 50.8% -> 85.4% (+34.6, 111 s), seed 2 53.4% -> 98.0% (+44.6, 109 s); at 200
steps +14.2 to +17.6 on seeds 0-1 (four runs), +45.0 on seed 2, hence 300. word_order_hf
(100 steps) 48.6% -> 100.0% (+51.4, 21 s of RL, 46 s with the cached warm-start, in this
test; 92.4% at step 50). This test, warm-starts cached, load ~15: uppercase 51.4% -> 74.4%
(+23.0) in 73 s of RL (run 121 s), word_order_hf 48.6% -> 100.0% in 19 s (run 57 s); 189 s in
all (600 steps each before: ~2 min each).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncflow.cli import main

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MIN_GAIN = 0.10  # held-out metric points gained by RL (issue 23)
MAX_RL_S = 300.0  # wall seconds of the RL part on a 2-core CPU
MAX_RUN_S = 300.0  # the whole run too: launcher start, warm-start (42 s / 33 s as the cache records), RL, evaluations


def _prepare(name: str, tmp_path: Path, scripts: tuple[str, ...]) -> Path:
    folder = tmp_path / name
    shutil.copytree(EXAMPLES / name, folder, ignore=shutil.ignore_patterns("*.jsonl", "model", "__pycache__"))
    for script in scripts:
        subprocess.run([sys.executable, script], cwd=folder, check=True, timeout=300)
    return folder


EXAMPLE_RUNS = [
    ("uppercase", "uppercase.yaml", ("make_data.py",)),
    ("word_order_hf", "word_order.yaml", ("make_data.py", "build_model.py")),
]


@pytest.mark.parametrize("name, yaml, scripts", EXAMPLE_RUNS)
def test_example_config_data_and_reward_train_two_steps(tmp_path, name, yaml, scripts):
    """The default run's check of each example (the learning target below is in the acceptance
    tier): its generators, its YAML, data, reward and model folder load and train two RL steps
    with a held-out evaluation before and after (no warm-start: that is the slow part)."""
    folder = _prepare(name, tmp_path, scripts)
    assert main(["train", str(folder / yaml), f"run_dir={tmp_path}/runs", "progress=false", "train.steps=2",
                 "warmstart.enabled=false", "train.eval_every=0", "task.eval_n=16"]) == 0
    run = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    s = json.loads((run / "summary.json").read_text())
    assert s["heldout_metric"] == "exact" and s["heldout_acc_after"] is not None
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.acceptance  # (python3 -m pytest -m acceptance: minutes each, the warm-start included)
@pytest.mark.parametrize("name, yaml, scripts", EXAMPLE_RUNS)
def test_example_trains_by_configuration_only(tmp_path, capsys, name, yaml, scripts):
    folder = _prepare(name, tmp_path, scripts)
    t0 = time.perf_counter()
    assert main(["train", str(folder / yaml), f"run_dir={tmp_path}/runs", "progress=false"]) == 0
    total = time.perf_counter() - t0  # with the warm-start (cached after the first run) and the launcher's start
    out = capsys.readouterr().out
    run = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    s = json.loads((run / "summary.json").read_text())
    before, after = s["heldout_acc_before"], s["heldout_acc_after"]
    rl_s = s["wall_s"]  # the RL run: first step to the last
    print(f"{name}: held-out {s['heldout_metric']} {before:.1%} -> {after:.1%} in {rl_s:.0f} s of RL "
          f"(run {total:.0f} s; init {s['init']})", file=sys.stderr)
    assert s["heldout_metric"] == "exact" and "exact" in out
    assert s["init"]["source"] == "warmstart" and s["init"]["accuracy"] >= 0.4  # both targets: 0.5 and 0.4
    assert after - before >= MIN_GAIN, (before, after)
    assert rl_s <= MAX_RL_S, rl_s
    assert total <= MAX_RUN_S, total
