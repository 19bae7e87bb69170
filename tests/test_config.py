"""Typed config loading (YAML + key=value overrides) and the CLI's error contract."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import asyncflow
from asyncflow.cli import main
from asyncflow.config import ConfigError, RunConfig, dump_config, load_config

CONFIG_DIR = Path(asyncflow.__file__).parent / "configs"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []


def _one_line(msg: str) -> None:
    assert msg and "\n" not in msg, repr(msg)


# --------------------------------------------------------------------------- load_config


def test_defaults_load():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.mode == "async" and cfg.train.steps == 120 and cfg.rollout.group_size == 8
    assert cfg.batch_size == cfg.train.prompts_per_step * cfg.rollout.group_size == 128
    assert cfg.effective_staleness == cfg.staleness == 1
    assert load_config(None, []) == cfg


def test_overrides_apply():
    cfg = load_config(None, ["train.steps=5", "mode=sync"])
    assert cfg.train.steps == 5 and cfg.mode == "sync"
    assert cfg.effective_staleness == 0  # on-policy outside async mode
    # Untouched neighbours keep their defaults.
    assert cfg.train.prompts_per_step == 16


def test_override_value_types():
    cfg = load_config(None, ["train.lr=1e-4", "reward.latency_ms=[10, 20]", "model.path=null",
                             "warmstart.enabled=false", "run_dir=a=b"])
    assert cfg.train.lr == pytest.approx(1e-4) and isinstance(cfg.train.lr, float)
    assert cfg.reward.latency_ms == (10.0, 20.0)
    assert cfg.model.path is None
    assert cfg.warmstart.enabled is False
    assert cfg.run_dir == "a=b"  # only the first '=' splits


def test_unknown_override_key_suggests_the_right_one():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.stpes=5"])
    msg = str(e.value)
    _one_line(msg)
    assert "train.stpes" in msg and "steps" in msg


def test_unknown_top_level_key_suggests_section():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trian.steps=5"])
    _one_line(str(e.value))
    assert "trian" in str(e.value) and "'train'" in str(e.value)


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.steps"])


def test_override_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match="mode"):
        load_config(None, ["mode.x=1"])


@pytest.mark.parametrize(
    "override, key",
    [("train.steps=-1", "train.steps"), ("train.steps=abc", "train.steps"), ("mode=fast", "mode"),
     ("rollout.top_p=1.5", "rollout.top_p"), ("task.digits=9", "task.digits")],
)
def test_bad_value_is_one_line_naming_the_field(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    _one_line(msg)
    assert key in msg
    assert override.split("=", 1)[1] in msg  # the bad value is shown


def test_cross_field_validation_model_heads():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.num_heads=3"])  # 128 % 3 != 0
    _one_line(str(e.value))
    assert "divisible" in str(e.value)


@pytest.mark.parametrize(
    "overrides, names",
    [(["rollout.max_batch=4"], ["rollout.max_batch", "rollout.group_size"]),
     (["train.micro_prompts=5", "train.prompts_per_step=4"], ["train.micro_prompts", "train.prompts_per_step"]),
     # data-parallel trainer: each error names the field and the fix
     (["train.dp=2", "train.strategy=fsdp", "launcher=local"], ["train.strategy=fsdp", "set launcher=ray"]),
     (["train.dp=2", "train.strategy=fsdp", "train.max_tokens_per_micro=64"], ["unset train.max_tokens_per_micro"]),
     (["train.dp=2", "mode=sync", "train.strategy=fsdp", "launcher=ray"], ["mode=sync", "train.strategy=ddp"]),
     (["train.dp=4", "mode=sync", "train.prompts_per_step=2", "train.micro_prompts=2"],
      ["train.prompts_per_step (2)", ">= train.dp"]),
     (["train.dp=2", "mode=sync", "algorithm.dynamic_sampling=true"], ["dynamic_sampling", "train.dp=1"]),
     (["train.dp=9", "train.micro_prompts=1", "rollout.group_size=8"], ["train.dp (9)", "= 8", "lower train.dp"])],
)
def test_cross_field_validation_run(overrides, names):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    _one_line(str(e.value))
    assert all(n in str(e.value) for n in names)
    assert "Value error" not in str(e.value)


def test_data_parallel_trainer_fields_and_cpu_shares():
    from asyncflow.workflow.plan import plan_workers

    cfg = load_config(None, ["train.dp=2"])
    assert (cfg.train.dp, cfg.train.strategy) == (2, "ddp")
    assert load_config(None, ["train.dp=2", "train.strategy=fsdp"]).train.strategy == "fsdp"  # (launcher=ray)
    with pytest.warns(UserWarning, match="oversubscribe"):  # rollout + 2 ranks on 2 CPUs
        specs = plan_workers(cfg, ncpu=2)
    ranks = [(s.name, s.rank) for s in specs if s.roles == ["actor"]]
    assert ranks == [("actor", 0), ("actor.1", 1)]
    # 3 compute workers share 2 CPUs: 2/3 each, 2 in all (rewards are computed inside rollout)
    assert [round(s.cpus, 4) for s in specs] == [0.6667, 0.6667, 0.6667]
    specs = plan_workers(cfg, ncpu=4)  # enough CPUs: a whole one each, no warning
    assert [s.cpus for s in specs] == [1.0, 1.0, 1.0]
    with pytest.warns(UserWarning, match="oversubscribe"):  # a reward worker of its own asks for no CPU
        specs = plan_workers(load_config(None, ["train.dp=2", "reward.placement=separate"]), ncpu=2)
    assert [(s.name, round(s.cpus, 4)) for s in specs] == [("rollout", 0.6667), ("reward", 0.0),
                                                          ("actor", 0.6667), ("actor.1", 0.6667)]


def test_core_pinning_gives_each_compute_worker_cores_of_its_own_trainer_first():
    from asyncflow.workflow.plan import plan_workers

    def cores(overrides, ncpu, ids):
        return {s.name: s.cores for s in plan_workers(load_config(None, overrides), ncpu, ids)}

    assert cores([], 2, [0, 1]) == {"rollout": (1,), "actor": (0,)}
    assert cores(["algorithm.kl_coef=0.01"], 4, [0, 1, 2, 3]) == {"rollout": (2,), "reference": (1,), "actor": (0,)}
    assert cores(["train.dp=2", "reward.placement=separate"], 4, [0, 1, 2, 3]) == {
        "rollout": (2,), "reward": (), "actor": (0,), "actor.1": (1,)}  # a reward worker computes no model
    assert cores(["resources.threads_per_role=2"], 4, [4, 5, 6, 7]) == {"rollout": (6, 7), "actor": (4, 5)}
    assert cores(["mode=sync"], 2, [0, 1]) == {"colocated": ()}  # its one worker uses every core
    assert cores([], 2, None) == {"rollout": (), "actor": ()}  # pin_cores off (or auto, not pinnable)
    with pytest.warns(UserWarning, match="oversubscribe"):  # 3 compute workers do not fit 2 cores: none pinned
        assert cores(["train.dp=2"], 2, [0, 1]) == {"rollout": (), "actor": (), "actor.1": ()}


def test_pin_cores_auto_pins_only_a_machine_the_launcher_owns():
    import os

    from asyncflow.workflow.cores import physical_first, pinnable_cores

    owner, guest = type("L", (), {"owns_host": True})(), type("L", (), {"owns_host": False})()
    here = physical_first(sorted(os.sched_getaffinity(0)))
    assert pinnable_cores(load_config(None, []), owner) == here
    assert pinnable_cores(load_config(None, []), guest) is None  # RAY_ADDRESS, local threads
    assert pinnable_cores(load_config(None, ["resources.pin_cores=on"]), guest) == here
    assert pinnable_cores(load_config(None, ["resources.pin_cores=off"]), owner) is None
    assert pinnable_cores(load_config(None, ["mode=sync", "resources.pin_cores=on"]), owner) is None
    with pytest.raises(ConfigError, match="resources.pin_cores"):
        load_config(None, ["resources.pin_cores=sometimes"])


def test_physical_first_puts_one_thread_of_each_physical_core_before_any_sibling():
    from asyncflow.workflow.cores import physical_first

    # siblings numbered next to each other (0,1 one core; 2,3 another) and split (0,2; 1,3)
    assert physical_first([0, 1, 2, 3], {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}) == [0, 2, 1, 3]
    assert physical_first([0, 1, 2, 3], {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}) == [0, 1, 2, 3]
    # a sibling outside the allowed cores does not count; no topology: the order stays
    assert physical_first([1, 2, 3], {1: (0, 1), 2: (2, 3), 3: (2, 3)}) == [1, 2, 3]
    assert physical_first([3, 5], {}) == [3, 5]


def test_pin_thread_pins_the_calling_thread_only():
    import os
    import threading

    from asyncflow.workflow.cores import pin_thread, pinned

    here = os.sched_getaffinity(0)
    one = min(here)
    seen = {}

    def body():
        pin_thread((one,))
        seen["thread"] = os.sched_getaffinity(0)
        child = threading.Thread(target=lambda: seen.setdefault("child", os.sched_getaffinity(0)))
        child.start()
        child.join()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"thread": {one}, "child": {one}}  # threads it starts inherit its cores
    assert os.sched_getaffinity(0) == here  # the caller's other threads are untouched
    pin_thread(())  # no cores: a no-op
    assert os.sched_getaffinity(0) == here
    with pinned((one,)):  # the bench's solo runs: pinned inside the block, restored after
        assert os.sched_getaffinity(0) == {one}
    assert os.sched_getaffinity(0) == here


def test_yaml_file_and_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("mode: stream\ntrain:\n  steps: 7\n  lr: 0.01\n")
    cfg = load_config(f, ["train.steps=9"])
    assert cfg.mode == "stream" and cfg.train.lr == 0.01
    assert cfg.train.steps == 9  # override wins over the file
    assert load_config(str(f)).train.steps == 7


def test_empty_yaml_file_is_defaults(tmp_path):
    f = tmp_path / "empty.yaml"
    f.write_text("")
    assert load_config(f) == load_config()


def test_bad_yaml_file_names_the_file(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    _one_line(str(e.value))
    assert "broken.yaml" in str(e.value) and "YAML" in str(e.value)


def test_non_mapping_yaml_file(tmp_path):
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="list.yaml"):
        load_config(f)


def test_missing_file_names_the_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(missing)
    _one_line(str(e.value))
    assert "nope.yaml" in str(e.value) and "not found" in str(e.value)


def test_unknown_key_in_file_names_file_and_suggests(tmp_path):
    f = tmp_path / "typo.yaml"
    f.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    _one_line(msg)
    assert "typo.yaml" in msg and "train.stepz" in msg and "steps" in msg


def test_bad_value_in_file_names_file_and_field(tmp_path):
    f = tmp_path / "neg.yaml"
    f.write_text("rollout:\n  group_size: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    _one_line(msg)
    assert "neg.yaml" in msg and "rollout.group_size" in msg


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=3", "reward.latency_ms=[5, 9]", "mode=stream"])
    f = tmp_path / "dumped.yaml"
    f.write_text(dump_config(cfg))
    assert load_config(f) == cfg


def test_config_folder_not_empty_if_present():
    if not CONFIG_DIR.is_dir():
        pytest.skip("asyncflow/configs does not exist (yet)")
    assert CONFIG_FILES, f"{CONFIG_DIR} exists but holds no *.yaml"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_shipped_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    # Round trip through the dump as well.
    assert RunConfig.model_validate(yaml.safe_load(dump_config(cfg))) == cfg


# --------------------------------------------------------------------------- CLI


def test_cli_dry_run_prints_resolved_yaml(capsys):
    assert main(["train", "--dry-run", "train.steps=3"]) == 0
    out, err = capsys.readouterr()
    assert "steps: 3" in out
    data = yaml.safe_load(out)
    assert data["train"]["steps"] == 3 and data["mode"] == "async"
    assert err == ""


def test_cli_dry_run_with_file_and_overrides(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("mode: sync\n")
    assert main(["train", str(f), "train.steps=4", "--dry-run"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["mode"] == "sync" and data["train"]["steps"] == 4


def test_cli_bad_override_exits_2_with_one_line(capsys):
    assert main(["train", "train.bogus=1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert lines[0].startswith("asyncflow: error:")
    assert "train.bogus" in lines[0]
    assert "Traceback" not in err


def test_cli_missing_config_file(tmp_path, capsys):
    assert main(["train", str(tmp_path / "absent.yaml"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncflow: error:") and "absent.yaml" in err and err.count("\n") == 1


def test_cli_bad_value_exits_2(capsys):
    assert main(["train", "--dry-run", "train.steps=-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncflow: error:") and "train.steps" in err and err.count("\n") == 1


def test_bench_mode_specs_name_the_staleness_or_fail_with_one_line():
    from asyncflow.bench.run import parse_mode

    assert parse_mode("sync") == ("sync", None)
    assert parse_mode("async:2") == ("async", 2)
    for bad in ("async:x", "sync:1", "fast", "stream:0"):
        with pytest.raises(ConfigError, match="async:K"):
            parse_mode(bad)


@pytest.mark.parametrize("field", ["handout_ttl_s", "unit_deadline_s"])
def test_the_data_plane_limits_are_validated_and_reach_the_data_plane(field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"resources.{field}=0"])
    assert f"resources.{field}" in str(e.value) and "\n" not in str(e.value).strip()
    from asyncflow.launch.local import LocalLauncher  # (the launcher layer: only this test needs it)
    from asyncflow.workflow.fields import SCHEMA  # (same)
    cfg = load_config(None, ["resources.handout_ttl_s=7.5"])
    plane = LocalLauncher().data_plane(SCHEMA, handout_ttl=cfg.resources.handout_ttl_s)
    assert plane._handouts.ttl == 7.5 and cfg.resources.unit_deadline_s == 120.0
