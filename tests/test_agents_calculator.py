"""The calculator example learns to use its tool, by configuration only, as a user runs it (slow).

``examples/calculator_tool`` is copied to a temporary folder, its model is built there
(``build_model.py``: the tiny model with the tool-call tags and a chat template that renders
tools), then ``asyncflow train calculator.yaml`` runs with nothing but ``run_dir`` and
``progress`` added: the SFT warm-start on tool-use traces (to 30% held-out exact match, greedy
episodes), then RL on multi-turn episodes through the built-in ``ToolEnv``.

Issue 35 asks for +15 points of held-out exact match (200 problems, greedy episodes with the
tool) within 5 minutes of RL on this 2-core CPU (:data:`MIN_GAIN`, :data:`MAX_RL_S`). The
measured figures are in docs/benchmarks.md#agents.
"""

from __future__ import annotations

import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest

from asyncflow.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.acceptance]  # (python3 -m pytest -m acceptance)
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "calculator_tool"
MIN_GAIN = 0.15  # held-out exact match points gained by RL (issue 35)
MAX_RL_S = 300.0  # wall seconds of the RL part on a 2-core CPU


def test_the_calculator_example_raises_held_out_exact_match_with_its_tool(tmp_path):
    folder = tmp_path / "calculator_tool"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("model", "__pycache__"))
    runpy.run_path(str(folder / "build_model.py"))["main"](folder / "model")
    assert main(["train", str(folder / "calculator.yaml"), f"run_dir={tmp_path / 'runs'}", "progress=false"]) == 0
    run = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    s = json.loads((run / "summary.json").read_text())
    before, after = s["heldout_acc_before"], s["heldout_acc_after"]
    print(f"calculator_tool: held-out exact match {before:.1%} -> {after:.1%} in {s['wall_s']:.0f} s of RL "
          f"(init {s['init']}, episodes {s['episodes']})", file=sys.stderr)
    assert s["init"]["source"] == "warmstart" and s["env_errors"] == 0
    assert s["episodes"]["turns"] > s["episodes"]["episodes"]  # a second turn follows a tool call only
    assert after - before >= MIN_GAIN, (before, after)
    assert s["wall_s"] <= MAX_RL_S, s["wall_s"]
