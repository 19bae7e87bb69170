"""``plan=auto``: a cached profile of this machine is reused, the searched plan is applied
to the config (and printed), a profile of another machine or job is measured again."""

from __future__ import annotations

import json

import pytest
import yaml

from asyncflow.config import RunConfig, load_config
from asyncflow.planner.auto import apply_plan, cached_profile, fingerprint, resolve
from asyncflow.planner.sim import Allocation
from test_planner import PROFILE  # tests/ is on sys.path (rootdir-less test modules)

SMALL = ["train.prompts_per_step=4", "rollout.max_batch=16"]


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The plan limits thread teams by the load average: make it a quiet machine."""
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))


def _cached(tmp_path, cfg):
    (tmp_path / "profile.json").write_text(json.dumps({**PROFILE, "fingerprint": fingerprint(cfg, 2)}))


def test_plan_auto_resolves_to_the_best_simulated_plan_and_prints_it(tmp_path):
    from asyncflow.planner.costs import ProfiledCost
    from asyncflow.planner.search import search

    cfg = load_config(None, ["plan=auto", f"run_dir={tmp_path}", *SMALL])
    _cached(tmp_path, cfg)
    logs = []
    out, text = resolve(cfg, cpus=2, log=logs.append)
    best = search(cfg, ProfiledCost.from_dict(PROFILE), PROFILE, cpus=2)[0][0]
    assert out.plan == "off" and out.mode == best.mode and out.train.micro_prompts == best.micro_prompts
    if best.mode == "sync":
        assert out.resources.sync_threads == best.rollout_res
    else:
        assert out.resources.threads_per_role == best.rollout_res
    assert "reusing the profile" in logs[0]
    assert "plan:" in text and "predicted:" in text and "the config as given" in text
    RunConfig.model_validate(out.model_dump())  # a valid config; the rest is as given
    assert out.train.prompts_per_step == 4 and out.rollout.max_batch == 16


def test_plan_off_is_the_identity():
    cfg = load_config(None, SMALL)
    assert resolve(cfg) == (cfg, "")


def test_apply_plan_sets_the_fields_of_each_mode():
    cfg = load_config(None, SMALL)
    s = apply_plan(cfg, Allocation("sync", 2, 2, micro_prompts=2, staleness=0))
    assert (s.mode, s.resources.sync_threads, s.train.micro_prompts) == ("sync", 2, 2)
    a = apply_plan(cfg, Allocation("async", 1, 1, micro_prompts=1, staleness=3))
    assert (a.mode, a.staleness, a.resources.threads_per_role, a.train.micro_prompts) == ("async", 3, 1, 1)


def test_a_profile_of_another_machine_or_model_is_measured_again(tmp_path, monkeypatch):
    import asyncflow.planner.profile as profile

    cfg = load_config(None, ["plan=auto", f"run_dir={tmp_path}", *SMALL])
    other = load_config(None, ["model.hidden_size=64", *SMALL])
    (tmp_path / "profile.json").write_text(json.dumps({**PROFILE, "fingerprint": fingerprint(other, 2)}))
    assert cached_profile(cfg, tmp_path / "profile.json", 2) is None
    calls = []

    def fake(c, out=None, cpus=None, **kw):
        calls.append(out)
        prof = {**PROFILE, "fingerprint": fingerprint(c, cpus)}
        open(out, "w").write(json.dumps(prof))
        return prof

    monkeypatch.setattr(profile, "run_profile", fake)
    out, _ = resolve(cfg, cpus=2, log=lambda m: None)
    assert calls == [str(tmp_path / "profile.json")]
    assert cached_profile(cfg, tmp_path / "profile.json", 2) is not None  # the next run reuses it


def test_cli_dry_run_shows_the_resolved_plan(tmp_path, capsys, monkeypatch):
    from asyncflow.cli import main

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cfg = load_config(None, ["plan=auto", f"run_dir={tmp_path}", *SMALL])
    _cached(tmp_path, cfg)
    assert main(["train", "--dry-run", "plan=auto", f"run_dir={tmp_path}", *SMALL]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# plan=auto") and "# plan: " in out and "#       config: mode=" in out
    resolved = RunConfig.model_validate(yaml.safe_load(out))  # the comments keep it valid YAML
    assert resolved.plan == "off"
    planned_mode = out.split("config: mode=")[1].split()[0]
    assert resolved.mode == planned_mode
