"""``task.name=dataset``: train on prompts and answers from a local file with any HF model."""

from __future__ import annotations

import json

import pytest

from asyncflow.config import ConfigError, load_config


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dataset_task_needs_a_path_but_not_a_model():
    with pytest.raises(ConfigError, match="task.path"):
        load_config(None, ["task.name=dataset", "model.path=/x"])
    cfg = load_config(None, ["task.name=dataset", "task.path=/x.jsonl"])  # the built-in tiny model covers any text
    assert cfg.model.path is None


def test_a_job_trains_on_a_local_jsonl(model_dir, tmp_path):
    from asyncflow.api import train

    rows = [{"q": f"{a}+{b}=", "a": str(a + b)} for a in range(6) for b in range(6)]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = load_config(None, [
        "task.name=dataset", f"task.path={data}", "task.fields={prompt: q, answer: a}", f"model.path={model_dir}",
        "mode=sync", "launcher=local", "train.steps=2", "train.prompts_per_step=2", "rollout.group_size=2",
        "train.micro_prompts=1", "rollout.max_new_tokens=4", f"run_dir={tmp_path}/runs", "progress=false"])
    summary = train(cfg)
    assert summary["samples"] == 8 and summary["init"] == {"source": "path"}
    assert 0.0 <= summary["heldout_acc_after"] <= 1.0


def test_a_bad_row_names_file_line_and_field(model_dir, tmp_path):
    from asyncflow.tasks.registry import build_task

    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n'
                    '{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+1=", "answer": "3"}\n')
    cfg = load_config(None, ["task.name=dataset", f"task.path={data}", f"model.path={model_dir}"])
    with pytest.raises(ConfigError, match=r"bad.jsonl.*2.*answer"):
        build_task(cfg)
    cfg = load_config(None, ["task.name=dataset", f"task.path={data}", f"model.path={model_dir}",
                             "task.on_bad_row=skip"])
    task = build_task(cfg)
    assert task.skipped == 1 and len(task.train) + len(task.heldout) == 3 and task.heldout
