"""What a run reports: the held-out figure named for what it measures (exact match, accuracy,
mean reward, or ``eval.metric``), progress as plain lines without a terminal, and the
``log.backends`` trackers (each read back through its own library; skipped where it is not
installed)."""

from __future__ import annotations

import glob
import json
import struct
import time
from pathlib import Path

import pytest

from asyncflow.config import load_config
from asyncflow.observe.report import Progress

TINY = ["launcher=local", "mode=sync", "warmstart.enabled=false", "progress=false", "train.steps=2",
        "train.eval_every=1", "train.prompts_per_step=2", "train.micro_prompts=1", "rollout.group_size=2",
        "rollout.max_batch=4", "task.eval_n=4", "rollout.max_new_tokens=3"]


def _train(tmp_path: Path, *overrides: str) -> tuple[dict, list[dict]]:
    from asyncflow.api import train

    cfg = load_config(None, [*TINY, f"run_dir={tmp_path}", *overrides])
    summary = train(cfg, run_dir=tmp_path)
    metrics = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] \
        if (tmp_path / "metrics.jsonl").exists() else []
    return summary, metrics


@pytest.mark.parametrize("overrides, name", [
    (["task.name=addition"], "exact match"),
    (["task.name=countdown"], "accuracy"),
    (["task.name=addition", "reward.fn=asyncflow.tasks.rewards:exact_match"], "exact match"),
    (["task.name=countdown", "reward.fn=asyncflow.tasks.rewards:exact_match"], "mean reward"),
    (["task.name=dataset", "task.path=x.jsonl", "model.path=/m"], "mean reward"),
    (["eval.metric=asyncflow.tasks.rewards:format_reward"], "format_reward"),
])
def test_the_heldout_metric_is_named_for_what_it_measures(overrides, name, tmp_path):
    from asyncflow.tasks.registry import build_task, heldout_metric

    if "task.name=dataset" in overrides:
        (tmp_path / "x.jsonl").write_text("".join(json.dumps({"prompt": f"{i}=", "answer": "1"}) + "\n"
                                                  for i in range(5)))
        overrides = [o.replace("x.jsonl", str(tmp_path / "x.jsonl")) for o in overrides]
    cfg = load_config(None, overrides)
    assert heldout_metric(cfg, build_task(cfg))[0] == name


def test_a_user_metric_is_used_and_named_everywhere(tmp_path, capsys):
    (tmp_path / "metric.py").write_text("def quarter(prompt, response, answer):\n    return 0.25\n")
    summary, metrics = _train(tmp_path / "run", f"eval.metric={tmp_path}/metric.py:quarter", "progress=true")
    assert summary["heldout_metric"] == "quarter"
    assert summary["heldout_acc_before"] == summary["heldout_acc_after"] == 0.25
    assert metrics[0]["heldout_metric"] == "quarter" and metrics[0]["heldout_acc"] == 0.25
    from asyncflow.observe.report import format_summary

    assert "held-out quarter   0.250 -> 0.250 (+0.000)" in format_summary(summary)
    err = capsys.readouterr().err  # pytest's stderr is no terminal: plain lines, no carriage returns
    assert "\r" not in err and "RL step 2/2: reward" in err and "quarter 0.250" in err


def test_progress_without_a_terminal_is_a_line_every_few_seconds(capsys):
    p = Progress(100, metric="exact match", tty=False, every_s=3600)
    p.start(0.5)
    for step in range(1, 101):
        p.update({"step": step, "reward": 0.5, "samples_per_s": 10.0, "tokens_per_s": 80.0,
                  **({"heldout_acc": 0.75} if step == 50 else {})})
    p.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "RL: 100 steps, held-out exact match 50.0%"
    assert [ln.split(":")[0] for ln in lines[1:]] == ["RL step 1/100", "RL step 50/100", "RL step 100/100"]
    assert lines[2].endswith("exact match 75.0%") and "\r" not in "".join(lines)


# --------------------------------------------------------------------------- trackers


def test_tensorboard_gets_config_metrics_and_summary(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary, metrics = _train(tmp_path, "log.backends=[jsonl, tensorboard]")
    ea = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("reward")] == [1, 2]
    assert [e.value for e in ea.Scalars("reward")] == pytest.approx([m["reward"] for m in metrics])
    assert ea.Scalars("summary/samples")[0].value == summary["samples"] == 8
    assert ea.Scalars("heldout_acc")[0].value == pytest.approx(metrics[0]["heldout_acc"])
    texts = {tag: ea.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in ea.Tags()["tensors"]}
    assert any('"steps": 2' in t for tag, t in texts.items() if tag.startswith("config"))
    assert any('"heldout_metric": "exact match"' in t for tag, t in texts.items() if tag.startswith("summary"))


def test_mlflow_gets_config_metrics_and_summary(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    summary, metrics = _train(tmp_path, "log.backends=[mlflow]", "log.project=issue23")
    assert metrics == []  # no jsonl backend: no metrics.jsonl
    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("issue23").experiment_id])
    assert run.data.params["train.steps"] == "2" and run.data.params["log.backends"] == '["mlflow"]'
    history = client.get_metric_history(run.info.run_id, "reward")
    assert sorted(m.step for m in history) == [1, 2]
    assert run.data.metrics["summary/samples"] == summary["samples"] == 8
    path = client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(Path(path).read_text())["heldout_metric"] == "exact match"


def _wandb_records(path: str) -> list:
    """The records of an offline W&B run file (LevelDB-log framing: 7-byte header, then records of
    ``crc32 u32, length u16, type u8`` in 32 KiB blocks; type 1 = whole, 2/3/4 = first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, out = Path(path).read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if kind == 0:  # the rest of a block is padding
            pos += room
            continue
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_wandb_writes_an_offline_run_with_config_metrics_and_summary(tmp_path):
    pytest.importorskip("wandb")
    summary, metrics = _train(tmp_path, "log.backends=[jsonl, wandb]")
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    for _ in range(300):  # wandb's service process may still be writing the file when finish() returns
        records = _wandb_records(path)
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds:
            break
        time.sleep(0.1)
    history = [{i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json) for i in r.history.item}
               for r, k in zip(records, kinds) if k == "history"]
    assert [h["_step"] for h in history] == [1, 2], " ".join(map(str, kinds))
    assert [h["reward"] for h in history] == pytest.approx([m["reward"] for m in metrics])
    config = {u.key: json.loads(u.value_json) for r, k in zip(records, kinds) if k in ("config", "run")
              for u in (r.config.update if k == "config" else r.run.config.update)}
    assert config["train"]["steps"] == 2
    updates = {(u.nested_key[0] if u.nested_key else u.key): json.loads(u.value_json)
               for r, k in zip(records, kinds) if k == "summary" for u in r.summary.update}
    assert updates["summary/samples"] == summary["samples"] == 8
