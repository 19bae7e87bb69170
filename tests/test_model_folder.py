"""``model.path``: any local Hugging Face causal LM + tokenizer; wrong folders fail in one line."""

from __future__ import annotations

import os

import pytest

from asyncflow.config import ConfigError
from asyncflow.tasks.models import check_model_folder, load_model


def test_a_saved_model_loads_back_through_model_path(model_dir):
    assert check_model_folder(str(model_dir)) == str(model_dir)
    model, tok = load_model(model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert tok.decode(tok("12+34=").input_ids) == "12+34="


def test_missing_folder(tmp_path):
    with pytest.raises(ConfigError, match="no such folder"):
        check_model_folder(str(tmp_path / "nope"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        check_model_folder(str(tmp_path))


def test_folder_without_tokenizer(model_dir):
    for name in os.listdir(model_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(model_dir / name)
    with pytest.raises(ConfigError, match="no tokenizer") as e:
        check_model_folder(str(model_dir))
    assert "\n" not in str(e.value)


def test_not_a_causal_lm(tmp_path):
    from transformers import DistilBertConfig  # an encoder: no causal-LM head class exists for it

    DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="not a causal LM"):
        check_model_folder(str(tmp_path))


def test_cli_reports_a_bad_model_path_in_one_line(tmp_path, capsys):
    from asyncflow.cli import main

    assert main(["train", f"model.path={tmp_path}/none", f"run_dir={tmp_path}", "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("asyncflow: error: model.path")


def test_a_job_trains_a_model_from_a_folder(model_dir, tmp_path):
    from asyncflow.config import load_config
    from asyncflow.api import train

    cfg = load_config(None, [f"model.path={model_dir}", "mode=sync", "launcher=local", "train.steps=2",
                             "train.prompts_per_step=2", "rollout.group_size=2", "train.micro_prompts=1",
                             f"run_dir={tmp_path}/runs", "progress=false", "task.eval_n=8"])
    summary = train(cfg)
    assert summary["init"] == {"source": "path"}
    assert summary["samples"] == 8
    assert (tmp_path / "runs").is_dir() and summary["heldout_acc_after"] is not None
