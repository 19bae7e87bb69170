"""LoRA in whole runs (``model.lora.r``; the engines alone: tests/test_lora.py).

* ``async`` with two trainer ranks (ddp), partial rollout and slow weight transfers: every
  weight set published is adapters only; every token of every trained answer has the version
  of the weights that sampled it within the bound (``v - k <= w <= v`` for a row trained at
  ``v``), answers do span adapter swaps, and every token's recorded log-prob is the one the
  adapters of its own version, merged into the base, give (so rollout merged each version
  right, and an answer in flight kept the versions it was sampled with);
* ``sync`` with two ranks, resumed from an earlier checkpoint, ends with the same adapters as
  the uninterrupted run; the run's adapter folder is the trainer's last adapters, loads with
  ``PeftModel.from_pretrained`` and gives the log-probs of the run's merged model folder
  (``checkpoint/merged``).
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import threading

import numpy as np
import torch
from peft import PeftModel
from safetensors.numpy import load_file
from test_staleness import DelayLauncher
from transformers import AutoModelForCausalLM

from asyncflow.api import train
from asyncflow.cli import main
from asyncflow.config import load_config
from asyncflow.engines.lora_merge import AdapterMerger
from asyncflow.engines.training import TrainEngine
from asyncflow.weights.store import CHECKSUMS, WeightStore
from asyncflow.workflow import checkpoint as C

torch.set_num_threads(1)
REWARD = "def score(prompt, response, sample):\n    return float(sum(map(ord, response)) % 3)\n"


class RecordingStore(WeightStore):
    """A weight store that keeps a copy of every version published and is slow to hand them out."""

    def __init__(self, rng: random.Random):
        super().__init__()
        self.rng, self.published, self.lock = rng, {}, threading.Lock()

    def publish(self, version, buffers):
        with self.lock:
            self.published[version] = {k: np.array(v, copy=True) for k, v in buffers.items() if k != CHECKSUMS}
        return super().publish(version, buffers)

    def wait_newer(self, version, timeout):
        got = super().wait_newer(version, timeout)
        if got is not None:
            threading.Event().wait(self.rng.uniform(0, 0.05))  # a slow transfer
        return got


class RecordingLauncher(DelayLauncher):
    """Slow data-plane calls and weight transfers; keeps every sample row rollout puts."""

    def __init__(self, seed: int):
        super().__init__(seed, max_delay_s=0.01)
        self.rows: list[tuple[int, dict]] = []  # (partition, one row's fields)

    def data_plane(self, schema, kind="ray", storage_units=2, **limits):
        plane = super().data_plane(schema, kind, storage_units, **limits)
        kept, put_nowait = self.rows, plane.put_nowait

        def recording(data, partition=0, rows=None, tags=None):
            if "token_versions" in data:
                n = len(data["token_versions"])
                kept.extend((int(partition), {k: data[k][i] for k in data}) for i in range(n))
            return put_nowait(data, partition, rows, tags)

        plane.put_nowait = recording
        return plane

    def weight_store(self):
        self.store = RecordingStore(random.Random(self.rng.random()))
        return self.store


def test_async_partial_rollout_across_adapter_swaps_keeps_every_token_in_the_bound(tmp_path):
    steps, k = 5, 1
    cfg = load_config(None, [
        "mode=async", f"staleness={k}", "launcher=local", "warmstart.enabled=false", "progress=false",
        f"train.steps={steps}", "train.prompts_per_step=4", "rollout.group_size=4", "train.micro_prompts=1",
        "train.dp=2", "rollout.max_batch=8", "rollout.max_new_tokens=16", "model.lora.r=8", "train.lr=0.02",
        "train.save_every=0", f"reward.fn={_reward(tmp_path)}:score", f"run_dir={tmp_path / 'runs'}"])
    launcher = RecordingLauncher(seed=3)
    train(cfg, launcher=launcher, evaluate=False)
    published = launcher.store.published
    assert sorted(published) == list(range(1, steps + 1))
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for w in published.values() for k in w)
    rows = [(v, row) for v, row in launcher.rows if v < steps]  # (not those generated ahead, never trained)
    assert len(rows) == steps * 16  # every row of every step, none dropped
    spans = 0
    for v, row in rows:
        tv = row["token_versions"].tolist()
        assert v - k <= min(tv) and max(tv) <= v and row["version"] == min(tv), (v, tv)
        spans += len(set(tv)) > 1
    assert spans > 0, "no answer was in flight across an adapter swap"
    run = next((tmp_path / "runs").iterdir())
    _check_logprobs_per_version(run / "initial_model", published, rows, cfg.model.lora.alpha / 8)


def _reward(tmp_path) -> str:
    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    return str(path)


def _check_logprobs_per_version(base_dir, published: dict, rows: list, scale: float) -> None:
    """Each token's recorded log-prob is its own version's: base + that version's adapters."""
    base = AutoModelForCausalLM.from_pretrained(base_dir)  # (loaded once: each version merges into a copy)
    prompts, responses = [r["prompt_ids"].tolist() for _, r in rows], [r["response_ids"].tolist() for _, r in rows]
    at_base = TrainEngine(base, pad_id=0).logprobs(prompts, responses)
    moved = 0.0
    for w in sorted({int(t) for _, r in rows for t in r["token_versions"]}):
        model = copy.deepcopy(base)
        if w > 0:
            AdapterMerger(model, scale).apply(published[w])
        mine = [i for i, (_, r) in enumerate(rows) if w in r["token_versions"]]
        got = TrainEngine(model, pad_id=0).logprobs([prompts[i] for i in mine], [responses[i] for i in mine])
        for i, lp in zip(mine, got):
            r = rows[i][1]
            at = r["token_versions"] == w
            np.testing.assert_allclose(r["logprobs"][at], lp[at], rtol=1e-5, atol=1e-4)  # (KV-cached decode)
            if w > 0:
                moved = max(moved, float(np.abs(lp[at] - at_base[i][at]).max()))
    assert moved > 1e-2  # the adapters did change the policy: the check above could tell versions apart


def test_a_lora_run_resumed_from_an_earlier_checkpoint_is_exact_and_leaves_a_peft_folder(tmp_path):
    common = ["mode=sync", "launcher=local", "warmstart.enabled=false", "progress=false", "train.steps=4",
              "train.prompts_per_step=2", "rollout.group_size=2", "train.micro_prompts=1", "task.eval_n=2",
              "train.eval_every=0", "rollout.max_new_tokens=8", "train.save_every=2", "train.dp=2",
              "model.lora.r=8", "model.lora.merged=true", "train.lr=0.02", f"reward.fn={_reward(tmp_path)}:score"]
    assert main(["train", *common, f"run_dir={tmp_path / 'runs'}"]) == 0
    whole = next((tmp_path / "runs").iterdir())
    again = shutil.copytree(whole, tmp_path / "again")
    for gone in (again / "checkpoint", again / "checkpoints" / "step-4"):
        shutil.rmtree(gone)
    assert main(["train", "--resume", str(again)]) == 0
    a, b = (load_file(str(d / "checkpoint" / "adapter_model.safetensors")) for d in (whole, again))
    assert a.keys() == b.keys() and all(".lora_" in name for name in a)
    assert all(np.array_equal(a[n], b[n]) for n in a)  # sync resumes exactly
    assert any(np.abs(v).max() > 0 for n, v in a.items() if ".lora_B." in n)  # the adapters did train
    last = C.read(C.latest(whole))[0]  # the trainer's state after the last step
    for n, v in a.items():
        module = n.removeprefix("base_model.model.").replace(".weight", ".default.weight")
        assert np.array_equal(last[f"model/{module}"], v), n
    grads = [json.loads(line)["grad_norm"] for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert any(g > 0 for g in grads)

    base = AutoModelForCausalLM.from_pretrained(whole / "initial_model")
    peft = TrainEngine(PeftModel.from_pretrained(base, whole / "checkpoint"), pad_id=0)
    merged = TrainEngine(AutoModelForCausalLM.from_pretrained(whole / "checkpoint" / "merged"), pad_id=0)
    prompts, responses = [[1, 5, 14, 6, 18], [1, 7, 18]], [[8, 2], [9, 10, 11, 2]]
    for x, y in zip(peft.logprobs(prompts, responses), merged.logprobs(prompts, responses)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
