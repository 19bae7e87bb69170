"""The shipped examples train by configuration only, as a user runs them.

Each example folder is copied to a temporary folder, its generators run there
(``make_data.py``, and ``build_model.py`` for the Hugging Face one), then
``asyncflow train <its yaml>`` runs with nothing but ``run_dir`` and ``progress`` added.
The tiny-model example has no model folder of its own.

Issue 23 asks for +10 points of held-out metric within 5 minutes of wall time. Measured
2026-11-24 on 2 CPU cores: uppercase, warm-started to 58.6% (300 SFT steps), then its 600
GRPO steps: 58.6% -> 70.0% (+11.4) in 107 s of RL, and in this test 58.6% -> 66.8% (+8.2)
in 149 s and 58.6% -> 71.0% (+12.4) in 129 s. So +10 is reached in two runs of three and is
not asserted: :data:`MIN_GAIN` is what held in every run measured (150 steps gave +5.0). Held-out noise: one standard error of a
paired difference on 500 rows is ~3 points. While 4 sessions shared the machine a step
took ~18x longer (60 steps: 198 s), so under such load :data:`MAX_RL_S` fails.
word_order_hf (by the CLI, same config): SFT 1,600 steps to 52.0% (target 40%; a plateau at
3-5% for steps 300-1,200) in 460 s, then 600 GRPO steps: 52.0% -> 82.8% in 146 s of RL; in this test 52.0% -> 87.4% in 104 s.
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
