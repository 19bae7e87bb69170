"""Over-provisioning and dynamic sampling resumed in ``mode=sync``: exact.

End to end (``launcher=local``, the tiny random-init model of tests/test_checkpoint.py): a run
of each feature checkpointed every step, then resumed from its step-3 checkpoint in a copy
of its folder, ends with the weights of the run never stopped (within 1e-6), the same prompt
groups trained in the same steps (the metrics' ``groups``), and the summary's counters of both
features (groups dropped and scored; stragglers restarted and answers thrown away; decode steps)
equal to the uninterrupted run's. The runs are set up so that the state crossing the step-3
boundary is not trivial (checked on the checkpoint itself): with over-provisioning, a stalled
straggler and a fetched group not started (``rollout.max_batch`` two groups) and a prompt cursor
past the steps' prompts, inside a partition; with dynamic sampling, dropped groups, so the
self-feeding feeder's cursor is past the steps' prompts, inside a partition (its first
partition fed on resume is short); and both features together (stalled, waiting and dropped).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
from safetensors.numpy import load_file
from test_checkpoint import REWARD, TINY

from asyncflow.cli import main
from asyncflow.workflow import checkpoint as C

# (answers of 2 or 8 tokens: groups finish at different decode steps)
LONGTAIL = ["rollout.gen_len=longtail", "rollout.longtail_short=2", "rollout.longtail_long=8",
            "rollout.longtail_frac=0.5"]


def _whole_and_resumed(tmp_path, extra: list[str]):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    assert main(["train", *TINY, "train.steps=4", "train.save_every=1", f"reward.fn={reward}:score", *extra,
                 f"run_dir={tmp_path / 'runs'}"]) == 0
    whole = next((tmp_path / "runs").iterdir())
    again = shutil.copytree(whole, tmp_path / "again")
    shutil.rmtree(again / "checkpoint")
    shutil.rmtree(again / "checkpoints" / "step-4")
    saved = C.read(C.latest(again))[1]
    assert saved["driver"]["step"] == 3  # (train.keep_checkpoints=2: steps 3 and 4)
    assert main(["train", "--resume", str(again)]) == 0
    a, b = (load_file(str(d / "checkpoint" / "model.safetensors")) for d in (whole, again))
    assert a.keys() == b.keys()
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) <= 1e-6
    lines = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (whole, again)]
    assert [m["step"] for m in lines[1]] == [1, 2, 3, 4]
    assert [sorted(m["groups"]) for m in lines[0]] == [sorted(m["groups"]) for m in lines[1]]
    assert any(m["grad_norm"] > 0 for m in lines[0])  # the weights did move
    summaries = [json.loads((d / "summary.json").read_text()) for d in (whole, again)]
    assert summaries[1]["resumed_from"] == 3
    return saved["rollout"], summaries


def test_an_overprovisioned_sync_run_resumed_is_exact(tmp_path):
    rollout, (whole, again) = _whole_and_resumed(tmp_path, [
        "train.prompts_per_step=3", "rollout.overprovision=2", "rollout.max_batch=4", *LONGTAIL])
    flags = {(r["group"], bool(r.get("stalled")), bool(r.get("waiting"))) for r in rollout["answers"]}
    assert any(s for _, s, _ in flags) and any(w for _, _, w in flags), flags  # (both cross the boundary)
    partition, taken = rollout["cursor"]
    assert taken > 0 and partition * 3 + taken > 3 * 3  # (prompts read past the steps' own: the extras)
    assert whole["overprovision"] == again["overprovision"], (whole["overprovision"], again["overprovision"])
    assert whole["overprovision"]["groups_restarted"] >= rollout["counters"]["stalls"] > 0


def test_a_dynamic_sampling_sync_run_resumed_is_exact(tmp_path):
    rollout, (whole, again) = _whole_and_resumed(tmp_path, ["algorithm.dynamic_sampling=true", *LONGTAIL])
    partition, taken = rollout["cursor"]
    assert rollout["counters"]["dropped"] > 0 and taken > 0 and partition * 2 + taken > 3 * 2
    assert whole["dynamic_sampling"] == again["dynamic_sampling"], (whole["dynamic_sampling"],
                                                                    again["dynamic_sampling"])
    assert whole["dynamic_sampling"]["groups_scored"] > rollout["counters"]["scored"]


def test_both_features_together_in_a_sync_run_resumed_are_exact(tmp_path):
    rollout, (whole, again) = _whole_and_resumed(tmp_path, [
        "algorithm.dynamic_sampling=true", "rollout.overprovision=2", "rollout.max_batch=6", *LONGTAIL])
    flags = {(r["group"], bool(r.get("stalled")), bool(r.get("waiting"))) for r in rollout["answers"]}
    assert any(s for _, s, _ in flags) and any(w for _, _, w in flags), flags
    assert rollout["counters"]["dropped"] > 0
    assert (whole["dynamic_sampling"], whole["overprovision"]) == (again["dynamic_sampling"], again["overprovision"])
