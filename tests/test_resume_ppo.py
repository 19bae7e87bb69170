"""PPO outside ``sync`` resumes: the critic's worker is checkpointed with the actor.

The critic's update of step ``v`` runs beside the actor's step ``v`` (its own worker), so the
checkpoint after ``done`` steps must hold the critic right after its update of step ``done - 1``:
version ``done * critic_epochs``. Checked against the live critic itself (a spy clones its value
model and AdamW tensors right after each update, on its own thread, before anything else can
change them): the checkpoint's ``critic/...`` tensors are bitwise those, and a resumed run's
critic is bitwise that checkpoint before it values anything. A resumed run (an earlier
checkpoint of a finished run, the driver killed with ``kill -9`` then ``--resume``d, and the
automatic restart after the critic's worker is lost) must train every prompt group of steps
``0..N-1`` exactly once within the staleness bound
(:func:`test_resume_async.check_every_group_once`). The critic asserts at every step that it
values step ``v`` with version ``v * critic_epochs``; one not put back waits for rows of step 0
that never come, so its run fails too (a stalled step: ``train.step_timeout_s``).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_resume_async import TINY, N, _start, check_every_group_once, kill_after_checkpoint

from asyncflow.cli import main
from asyncflow.workflow import checkpoint as C
from asyncflow.workflow import role_state
from asyncflow.workflow.failure import WorkerLost
from asyncflow.workflow.roles.critic import CriticRole
from asyncflow.workflow.worker import Worker

EPOCHS = 2  # critic updates a step: its version after k steps is 2 k
PPO = [*TINY, "algorithm.name=ppo", f"algorithm.critic_epochs={EPOCHS}", "train.keep_checkpoints=5",
       "train.step_timeout_s=30"]  # (a critic not put back stalls its step: a failure in 30 s, not 600)
# (by content: the tiny model's answers vary, so the critic's targets, gradients and AdamW moments do)
REWARD = "def score(prompt, response, sample):\n    return float(sum(map(ord, response)) % 3)\n"


def _reward(tmp_path: Path) -> str:
    (tmp_path / "reward.py").write_text(REWARD)
    return f"reward.fn={tmp_path / 'reward.py'}:score"


def _state(engine) -> dict[str, np.ndarray]:
    """The critic's value model and AdamW's per-parameter tensors, copied, named as in a checkpoint
    (under ``critic/``), read from the live engine (not through the snapshot code)."""
    out = {f"critic/model/{k}": v.detach().to("cpu", copy=True).numpy() for k, v in engine.model.state_dict().items()}
    for idx, st in engine.opt.state_dict()["state"].items():
        out.update({f"critic/optim/{idx}/{k}": v.detach().to("cpu", copy=True).numpy()
                    for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def _critic_of(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    tensors, meta = C.read(path)
    return {k: v for k, v in tensors.items() if k.startswith(("critic/model/", "critic/optim/"))}, meta


@pytest.fixture
def spies(monkeypatch):
    """``updated[k]``: the live critic right after its update of step ``k - 1`` (version, state);
    ``restored``: the critic right after a restore (version, step, state)."""
    updated: dict[int, tuple[int, dict]] = {}
    restored: list[tuple[int, int, dict]] = []
    update, restore = CriticRole._update, role_state._restore_critic

    def spy_update(self, v):
        update(self, v)  # (then nothing changes the critic until this thread's next optimizer step)
        updated[v + 1] = (self.engine.version, _state(self.engine))

    def spy_restore(critic, snap, step):
        restore(critic, snap, step)
        restored.append((critic.engine.version, critic.step, _state(critic.engine)))

    monkeypatch.setattr(CriticRole, "_update", spy_update)
    monkeypatch.setattr(role_state, "_restore_critic", spy_restore)
    return updated, restored


@pytest.mark.parametrize("mode", ["async", "stream"])
def test_a_ppo_run_resumed_from_a_checkpoint_restores_the_critic_exactly(tmp_path, spies, mode):
    updated, restored = spies
    assert main(["train", *PPO, f"mode={mode}", _reward(tmp_path), f"run_dir={tmp_path / 'runs'}"]) == 0
    whole = next((tmp_path / "runs").iterdir())
    assert [p.name for p in C.complete(whole / C.CKPT_DIR)] == [f"step-{k}" for k in (2, 4, 6, 8, 10)]
    for k in (2, 4, 6, 8, 10):  # each checkpoint: the critic after its update of step k - 1, bitwise
        critic, meta = _critic_of(whole / C.CKPT_DIR / f"step-{k}")
        assert meta["critic"]["version"] == updated[k][0] == EPOCHS * k and meta["version"] == k
        _same(critic, updated[k][1])
    assert any(np.abs(v).max() > 0 for k, v in updated[4][1].items() if k.endswith("/exp_avg"))  # it trained
    assert not restored

    at = dict(updated)
    again = shutil.copytree(whole, tmp_path / "again")  # stopped at step-4: what came after is gone
    shutil.rmtree(again / "checkpoint")
    for k in (6, 8, 10):
        shutil.rmtree(again / C.CKPT_DIR / f"step-{k}")
    assert main(["train", "--resume", str(again)]) == 0
    assert len(restored) == 1
    version, step, state = restored[0]
    assert (version, step) == (EPOCHS * 4, 4)
    _same(state, at[4][1])  # the critic resumed is the critic at the checkpoint, bitwise
    _same(state, _critic_of(again / C.CKPT_DIR / "step-4")[0])
    check_every_group_once(again)
    last = C.read(C.latest(again))[1]
    assert last["critic"]["version"] == EPOCHS * N and last["version"] == last["driver"]["step"] == N


@pytest.mark.slow
def test_an_async_ppo_run_killed_with_kill_9_and_resumed_trains_every_group_once(tmp_path, spies):
    _, restored = spies
    seed = random.randrange(10**6)
    runs = tmp_path / "runs"
    proc = _start([*PPO, _reward(tmp_path), f"run_dir={runs}"])
    t = time.time()
    while not runs.exists() or not any(runs.iterdir()):
        assert proc.poll() is None and time.time() - t < 120, f"seed {seed}"
        time.sleep(0.01)
    run = next(runs.iterdir())
    assert kill_after_checkpoint(proc, run, 0, random.Random(seed).uniform(0, 0.3)), f"seed {seed}: it ended first"
    assert proc.returncode == -9 and not (run / "summary.json").exists()
    saved = C.latest(run)
    critic, meta = _critic_of(saved)
    done = meta["driver"]["step"]
    assert meta["critic"]["version"] == EPOCHS * done and meta["version"] == done, f"seed {seed}"
    assert main(["train", "--resume", str(run)]) == 0, f"seed {seed}"
    assert [(v, s) for v, s, _ in restored] == [(EPOCHS * done, done)], f"seed {seed}"
    _same(restored[0][2], critic)
    check_every_group_once(run)
    last = C.read(C.latest(run))[1]
    assert last["critic"]["version"] == EPOCHS * N and last["version"] == N, f"seed {seed}"
    print(f"seed {seed}: killed after the checkpoint of step {done}")


def test_a_lost_critic_worker_restarts_the_ppo_run_from_its_checkpoint_with_the_critic_put_back(
        tmp_path, capsys, monkeypatch, spies):
    """(The local launcher's workers are threads: the loss is raised by the critic's metrics call, as
    the launcher reports a dead process.) ``train.max_restarts``: the run goes on from its latest
    checkpoint with the critic of that checkpoint, and trains every group once."""
    updated, restored = spies
    metrics, die_at, died = Worker.critic_metrics, random.randrange(3, N - 1), []

    def lost_once(self, v, timeout=2.0):
        out = metrics(self, v, timeout)
        if out is not None and v == die_at and not died:
            died.append(v)
            raise WorkerLost("the process died (test)")
        return out

    monkeypatch.setattr(Worker, "critic_metrics", lost_once)
    assert main(["train", *PPO, _reward(tmp_path), f"run_dir={tmp_path / 'runs'}"]) == 0, f"die_at {die_at}"
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("asyncflow: restart 1/2 from checkpoint step-"), err
    assert "worker 'critic' was lost" in err[0], err
    run = next((tmp_path / "runs").iterdir())
    check_every_group_once(run)
    summary = json.loads((run / "summary.json").read_text())
    start = summary["resumed_from"]
    assert summary["restarts"] == 1 and start % 2 == 0 and 2 <= start <= die_at, (start, die_at)
    assert [(v, s) for v, s, _ in restored] == [(EPOCHS * start, start)]
    _same(restored[0][2], updated[start][1])  # (the first run's critic after its update of step start - 1)
    last = C.read(C.latest(run))[1]
    assert last["critic"]["version"] == EPOCHS * N and last["version"] == N
