"""benchmarks/ab.py: a side's items split into config overrides and environment variables,
and each run's environment set and restored."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("ab", Path(__file__).parents[1] / "benchmarks" / "ab.py")
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def test_a_name_with_a_capital_is_an_environment_variable_and_the_rest_are_overrides():
    overrides, env = ab.split_side(["RAY_worker_niceness=0", "resources.pin_cores=on", "seed=3",
                                    "ASYNCFLOW_ARENA_MAX=0", "run_dir=A=B"])
    assert overrides == ["resources.pin_cores=on", "seed=3", "run_dir=A=B"]
    assert env == {"RAY_worker_niceness": "0", "ASYNCFLOW_ARENA_MAX": "0"}


def test_environment_sets_a_side_unsets_the_other_sides_names_and_restores(monkeypatch):
    monkeypatch.setenv("AB_TEST_KEPT", "before")
    monkeypatch.delenv("AB_TEST_NEW", raising=False)
    with ab.environment({"AB_TEST_NEW": "1"}, {"AB_TEST_NEW", "AB_TEST_KEPT"}):
        assert os.environ["AB_TEST_NEW"] == "1"
        assert "AB_TEST_KEPT" not in os.environ  # the other side's variable: not this side's
    assert os.environ["AB_TEST_KEPT"] == "before" and "AB_TEST_NEW" not in os.environ
    with pytest.raises(RuntimeError), ab.environment({"AB_TEST_KEPT": "x"}, {"AB_TEST_KEPT"}):
        raise RuntimeError
    assert os.environ["AB_TEST_KEPT"] == "before"
