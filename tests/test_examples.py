"""The shipped examples train by configuration only, as a user runs them.

Each example folder is copied to a temporary folder, its generators run there
(``make_data.py``, and ``build_model.py`` for the Hugging Face one), then
``asyncflow train <its yaml>`` runs with nothing but ``run_dir`` and ``progress`` added.
The tiny-model example has no model folder of its own.

Issue 23 asks for +10 points of held-out metric within 5 minutes of wall time
(:data:`MIN_GAIN`, :data:`MAX_RL_S`). Held-out noise: one standard error of a paired
difference on 500 rows is ~3 points.

uppercase: the warm-start lands near its 50% target (51.4%, 80 SFT steps, seed 0), a model
that is right when greedy but unsure: sampled at temperature 1.0 only ~2% of its answers
are exact, so GRPO groups were mostly all-zero and 600 steps at lr 3e-4 gained +7 to +23
(sync, seed 0: 3e-4 lost 12-33 points in 60 steps). The example now samples at 0.5 (~37%
exact) with lr 1e-4 for 200 steps; measured 2026-11-25 on 2 CPU cores under heavy load
(load average 15-20), async as this test runs it: RESULTS. word_order_hf: 48.6% (55 SFT
steps) -> 100.0% (+51.4) in 600 steps. A quiet machine runs a default-example RL step in
~0.13 s: 200 steps are under a minute of RL; under the load above :data:`MAX_RL_S` can fail.
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


def _prepare(name: str, tmp_path: Path, scripts: tuple[str, ...]) -> Path:
    folder = tmp_path / name
    shutil.copytree(EXAMPLES / name, folder, ignore=shutil.ignore_patterns("*.jsonl", "model", "__pycache__"))
    for script in scripts:
        subprocess.run([sys.executable, script], cwd=folder, check=True, timeout=300)
    return folder


@pytest.mark.parametrize("name, yaml, scripts", [
    ("uppercase", "uppercase.yaml", ("make_data.py",)),
    ("word_order_hf", "word_order.yaml", ("make_data.py", "build_model.py")),
])
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
