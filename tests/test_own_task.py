"""Your own task by configuration: a dataset on the tiny model or a model folder, a prompt
template, the shared token layout, and the warm-start on your data (cache keyed by data,
model and recipe; skipped in one line without reference answers)."""

from __future__ import annotations

import json

import pytest
import torch

from asyncflow.config import load_config
from asyncflow.tasks import warmstart
from asyncflow.tasks.datasets import DatasetError, load_dataset
from asyncflow.tasks.layout import sft_tensors
from asyncflow.tasks.models import prepare_model
from asyncflow.tasks.registry import build_task

torch.set_num_threads(1)
SMALL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def words(n=40, answer=True):
    letters = "abcdefghij"
    ws = [letters[i % 10] + letters[(i // 10) % 10] + "X" for i in range(n)]  # 'X': a byte-fallback character
    return [{"word": w, "reversed": w[::-1] if answer else ""} for w in ws]


def cfg_for(tmp_path, data, *extra):
    return load_config(None, ["task.name=dataset", f"task.path={data}", "task.prompt_template=rev {word}=",
                              "task.fields={answer: reversed}", f"warmstart.cache_dir={tmp_path}/ws", "seed=0",
                              "rollout.max_new_tokens=4", *SMALL, *extra])


def test_prompt_template_fills_in_row_fields(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"word": "abc", "reversed": "cba"}])
    ds = load_dataset(data, {"answer": "reversed"}, template="rev {word}=")
    assert [(s.prompt, s.answer) for s in ds.samples] == [("rev abc=", "cba")]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"w": "abc", "reversed": "cba"}])
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: field 'word' named by task.prompt_template is missing"):
        load_dataset(bad, {"answer": "reversed"}, template="rev {word}=")


def test_sft_layout_is_bos_prompt_answer_eos_and_chat_uses_the_template(tmp_path):
    from asyncflow.engines.tiny import build_char_tokenizer
    from asyncflow.tasks.datasets import Sample

    tok = build_char_tokenizer()
    ids, labels = sft_tensors(tok, [Sample("1+2=", "3")])
    # hand-computed: <bos>=1, '1'=5, '+'=14, '2'=6, '='=18, '3'=7, <eos>=2
    assert ids.tolist() == [[1, 5, 14, 6, 18, 7, 2]]
    assert labels.tolist() == [[-100, -100, -100, -100, -100, 7, 2]]
    tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    ids, labels = sft_tensors(tok, [Sample("1", "2")], chat=True)
    # '[' and ']' are byte tokens: 52 + 0x5B = 143, 52 + 0x5D = 145; no <bos> with a chat template
    assert ids.tolist() == [[143, 5, 145, 6, 2]] and labels.tolist() == [[-100, -100, -100, 6, 2]]


def test_tiny_model_warm_starts_on_a_dataset_and_caches_by_data(tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", words())
    calls = []
    real_sft = warmstart.sft
    monkeypatch.setattr(warmstart, "sft", lambda *a, **k: calls.append(k) or real_sft(*a, **{**k, "max_steps": 2}))
    cfg = cfg_for(tmp_path, data)
    path, init = prepare_model(cfg, tmp_path)
    assert init["source"] == "warmstart" and not init["cached"] and len(calls) == 1
    spec = calls[0]["spec"]
    assert spec.max_new_tokens == 4 and spec.key == "mean reward:dataset"  # RL's held-out metric, named in the key
    again, init2 = prepare_model(cfg, tmp_path)
    assert (again, init2["cached"], len(calls)) == (path, True, 1)
    write_jsonl(data, words(41))  # other data: another entry
    other, _ = prepare_model(cfg_for(tmp_path, data), tmp_path)
    assert other != path and len(calls) == 2
    info = json.loads((tmp_path / "ws" / other.rsplit("/", 1)[1] / "info.json").read_text())
    assert set(info["recipe"]["task"]) == {"dataset"}


def test_without_reference_answers_one_line_and_rl_starts_from_the_model(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", words(answer=False))
    path, init = prepare_model(cfg_for(tmp_path, data), tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warm-start skipped" in err[0] and "no reference answers" in err[0]
    assert init == {"source": "random"}


def test_a_model_folder_warm_starts_only_when_asked_and_its_contents_key_the_cache(tmp_path, model_dir,
                                                                                   monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", words())
    real_sft = warmstart.sft
    monkeypatch.setattr(warmstart, "sft", lambda *a, **k: real_sft(*a, **{**k, "max_steps": 1}))
    plain, init = prepare_model(cfg_for(tmp_path, data, f"model.path={model_dir}"), tmp_path)
    assert (plain, init) == (str(model_dir), {"source": "path"})
    cfg = cfg_for(tmp_path, data, f"model.path={model_dir}", "warmstart.model_folder=true")
    first, init = prepare_model(cfg, tmp_path)
    assert init["source"] == "warmstart" and first != str(model_dir)
    recipe = json.loads((tmp_path / "ws" / first.rsplit("/", 1)[1] / "info.json").read_text())["recipe"]
    assert recipe["model_dims"] is None and set(recipe["model"]) == {"digest"}
    assert prepare_model(cfg, tmp_path)[1]["cached"]
    (model_dir / "config.json").write_text((model_dir / "config.json").read_text() + "\n")  # the folder changed
    assert prepare_model(cfg, tmp_path)[0] != first


def test_dataset_task_trains_on_the_tiny_model_by_config(tmp_path):
    from asyncflow.api import train

    data = write_jsonl(tmp_path / "d.jsonl", words())
    cfg = cfg_for(tmp_path, data, "warmstart.enabled=false", "mode=sync", "launcher=local", "train.steps=1",
                  "train.prompts_per_step=2", "rollout.group_size=2", "train.micro_prompts=1",
                  f"run_dir={tmp_path}/runs", "progress=false")
    assert build_task(cfg).train[0].prompt.startswith("rev ")
    summary = train(cfg)
    assert summary["samples"] == 4 and summary["init"] == {"source": "random"}


def test_the_addition_recipe_keeps_its_fields_so_its_cache_entry_stays_valid():
    from asyncflow.engines.tiny import CHARSET
    from asyncflow.tasks.addition import AdditionTask

    sft_keys = {"target_acc": 0.65, "seed": 0, "lr": 3e-3, "batch_size": 256, "eval_every": 50, "eval_n": 500,
                "max_steps": 5000}
    recipe = warmstart._recipe(AdditionTask(digits=2), {}, sft_keys, warmstart.EvalSpec(), None)
    assert recipe == {
        "format": 2, "charset": CHARSET, "task": {"digits": 2, "holdout_frac": 0.2, "seed": 0}, "sft": sft_keys,
        "model_dims": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                       "intermediate_size": 512, "max_position_embeddings": 128}}


def test_a_metric_file_keys_the_cache_by_its_contents_not_its_folder(tmp_path):
    from asyncflow.tasks.models import eval_spec

    keys = []
    for d in ("a", "b", "c"):
        (tmp_path / d).mkdir()
        body = "def exact(p, r, a):\n    return float(r == a)\n" + ("# edited\n" if d == "c" else "")
        (tmp_path / d / "m.py").write_text(body)
        data = write_jsonl(tmp_path / d / "d.jsonl", words())
        cfg = cfg_for(tmp_path, data, f"eval.metric={tmp_path / d / 'm.py'}:exact")
        keys.append(eval_spec(cfg, build_task(cfg)).key)
    assert keys[0] == keys[1] != keys[2] and keys[0].startswith("exact:") and keys[0].endswith(":exact")
