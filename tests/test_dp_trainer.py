"""A data-parallel trainer (``train.dp``) inside jobs: same step as one rank, every row once.

* The actor role on 2 ranks (threads sharing a :class:`ThreadRendezvous`, each with its own
  engine, one data plane) ends two steps with the weights of one rank that trained every
  row, for the sequence- and token-normalised losses and a batch-level estimator. The
  micro-batch holds 2 GRPO groups and the token-balanced split cuts them, so advantages
  computed per rank's chunk instead of per micro-batch would fail this test; so would a
  token-mean normalised by a rank's own tokens, or a mean instead of a sum over ranks.
* A whole async job with ``train.dp=2`` (local launcher) trains every sample exactly once
  (checked by spies on the data plane and on the engine, independent of the actor's own
  counters), within the staleness bound, with both ranks working every step.
* The collective group itself: hand-computed sums, broadcasts and an abort.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
import torch

from asyncflow.algorithms.algorithm import Algorithm
from asyncflow.config import AlgorithmConfig, load_config
from asyncflow.engines.collective import ThreadGroup, ThreadRendezvous, all_reduce_buckets, buckets
from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
from asyncflow.engines.training import TrainEngine
from asyncflow.launch.local import LocalLauncher
from asyncflow.dataplane import DataPlane
from asyncflow.workflow.roles.actor import ActorRole
from asyncflow.api import train
from asyncflow.workflow.fields import SCHEMA

GROUP, PROMPTS, MICRO = 4, 4, 2  # 16 rows a step, micro-batches of 2 groups = 8 rows


def fill(plane: DataPlane, step: int) -> None:
    """Partition ``step``: 4 groups x 4 answers of random tokens, lengths 1..6, version = step."""
    rng = np.random.default_rng(step)
    n = PROMPTS * GROUP
    prompts = [np.array([1, *rng.integers(4, 20, size=3 + g % 3)]) for g in range(PROMPTS) for _ in range(GROUP)]
    responses = [rng.integers(4, 20, size=int(rng.integers(1, 7))) for _ in range(n)]
    group = np.repeat(np.arange(PROMPTS) + 100 * step, GROUP)
    plane.put({"prompt_ids": prompts, "response_ids": responses,
            "logprobs": [rng.normal(-2.0, 0.3, size=len(r)).astype(np.float32) for r in responses],
            "reward": rng.integers(0, 2, size=n).astype(np.float32), "group": group,
            "version": np.full(n, step)},
           partition=step, tags={"group": group.tolist(), "version": [step] * n,
                                 "tokens": [len(p) + len(r) for p, r in zip(prompts, responses)]})


def actor(plane: DataPlane, algorithm: Algorithm, group=None, fsdp: bool = False) -> ActorRole:
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=0, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    engine = TrainEngine(model, tok.pad_token_id, lr=1e-2, collective=group, fsdp=fsdp)
    return ActorRole(engine, plane, PROMPTS * GROUP, GROUP, MICRO, staleness=0, algorithm=algorithm, group=group,
                     wait_timeout_s=30)


def run(world: int, algorithm: Algorithm, steps: int = 2) -> list[dict[str, np.ndarray]]:
    """Every rank's weights after ``steps`` steps on the same rows."""
    torch.manual_seed(0)
    plane = DataPlane(SCHEMA)
    for v in range(steps):
        fill(plane, v)
    rdv = ThreadRendezvous(world, timeout_s=60)
    roles = [actor(plane, algorithm, ThreadGroup(rdv, r) if world > 1 else None) for r in range(world)]
    errors: list[BaseException] = []

    def rank(role: ActorRole) -> None:
        try:
            for v in range(steps):
                role.train_step(v, prefetch_next=v + 1 < steps)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
            rdv.abort()

    threads = [threading.Thread(target=rank, args=(role,)) for role in roles]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert plane.stats()["live_rows"] == 0  # rank 0 cleared both steps once everybody had read them
    return [role.engine.export_weights() for role in roles]


@pytest.mark.parametrize("name,loss_agg", [("grpo", "seq-mean-token-mean"), ("grpo", "token-mean"),
                                           ("reinforce_pp", "seq-mean-token-sum")])
def test_two_ranks_take_the_same_step_as_one(name, loss_agg):
    algorithm = Algorithm.from_config(AlgorithmConfig(name=name, loss_agg=loss_agg), 8)
    single = run(1, algorithm)[0]
    ranks = run(2, algorithm)
    for r, got in enumerate(ranks):
        for n, w in single.items():
            # Adam moves each weight by ~lr = 1e-2 a step; summation order leaves < 1e-5
            np.testing.assert_allclose(got[n], w, atol=1e-5, rtol=1e-5, err_msg=f"rank {r} {n}")
    # Not vacuous: one step fewer is far away.
    assert max(np.abs(run(1, algorithm, steps=1)[0][n] - single[n]).max() for n in single) > 1e-3


def test_thread_group_sums_broadcasts_and_aborts():
    rdv = ThreadRendezvous(3, timeout_s=10)
    got: dict[int, tuple] = {}

    def rank(r: int) -> None:
        g = ThreadGroup(rdv, r)
        t = [torch.tensor([1.0, 10.0]) * (r + 1), torch.tensor([float(r)])]
        g.all_reduce_sum(t)
        got[r] = (t[0].tolist(), t[1].tolist(), g.broadcast(f"from {r}"))
        g.barrier()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    # (1 + 2 + 3) x [1, 10], 0 + 1 + 2, and rank 0's object everywhere
    assert got == {r: ([6.0, 60.0], [3.0], "from 0") for r in range(3)}
    lonely = ThreadRendezvous(2, timeout_s=10)
    threading.Timer(0.1, lonely.abort).start()
    with pytest.raises(threading.BrokenBarrierError):  # the other rank never came
        ThreadGroup(lonely, 0).barrier()


class SpyPlane(DataPlane):
    """Records what the data plane hands the trainer: (partition, row, sample version, behaviour log-probs)."""

    def __init__(self, schema):
        super().__init__(schema)
        self.handed: list[tuple[int, int, int, bytes]] = []

    def get_meta(self, task, fields, n, **kw):
        meta = super().get_meta(task, fields, n, **kw)
        if task == "actor" and meta.rows:
            versions = self.tags(meta.rows)["version"]
            logprobs = super().get_data(meta, ["logprobs"])["logprobs"]
            self.handed += [(meta.partition, r, v, lp.tobytes()) for r, v, lp in zip(meta.rows, versions, logprobs)]
        return meta


class SpyLauncher(LocalLauncher):
    def data_plane(self, schema, kind="ray", storage_units=2, **limits):
        self.plane = SpyPlane(schema)
        return self.plane


@pytest.mark.filterwarnings("ignore:train.dp=2.*oversubscribe")  # expected on 2 CPUs
def test_async_job_with_two_trainer_ranks_trains_every_sample_once(tmp_path, monkeypatch):
    steps, k, batch = 4, 1, PROMPTS * GROUP
    trained: list[tuple[int, int, bytes]] = []  # (rank, trainer version, behaviour log-probs of the row)
    lock, forward_backward = threading.Lock(), TrainEngine.forward_backward

    def spy(self, prompts, responses, extras, loss_fn):
        with lock:
            trained.extend((self.collective.rank, self.version, lp.tobytes()) for lp in extras["logprobs"])
        return forward_backward(self, prompts, responses, extras, loss_fn)

    monkeypatch.setattr(TrainEngine, "forward_backward", spy)
    cfg = load_config(None, ["launcher=local", "warmstart.enabled=false", "progress=false", "mode=async",
                             f"staleness={k}", f"train.steps={steps}", f"train.prompts_per_step={PROMPTS}",
                             f"rollout.group_size={GROUP}", f"train.micro_prompts={MICRO}", "train.dp=2",
                             f"run_dir={tmp_path}"])
    launcher = SpyLauncher()
    summary = train(cfg, launcher=launcher, evaluate=False)
    handed = launcher.plane.handed
    assert len(handed) == len({(p, r) for p, r, _, _ in handed}) == steps * batch  # each row handed out once
    lags = [p - v for p, _, v, _ in handed]
    assert 0 <= min(lags) and max(lags) <= k and summary["max_staleness"] == max(lags)
    assert summary["samples"] == steps * batch and summary["dropped_stale"] == 0
    for v in range(steps):
        # the rows trained at version v, over both ranks, are exactly partition v's rows, once each
        assert Counter(lp for _, ver, lp in trained if ver == v) == Counter(lp for p, _, _, lp in handed if p == v)
        per_rank = Counter(r for r, ver, _ in trained if ver == v)
        assert per_rank[0] == per_rank[1] == batch // 2, per_rank  # micro-batches of 8 rows split 4 + 4
    assert len(trained) == steps * batch
    assert set(summary["busy"]) >= {"actor", "actor.1", "rollout"}


def _torch_rank(rank: int, address: str, out: str) -> None:
    from asyncflow.engines.collective import TorchGroup

    torch.set_num_threads(1)
    g = TorchGroup(address, rank, 2, timeout_s=60)
    t = [torch.tensor([1.0, 10.0]) * (rank + 1), torch.tensor([[rank, 2.0 * rank], [3.0, 4.0]]),
         torch.tensor([rank + 5])]  # one float bucket of two tensors, then an int64 one
    g.all_reduce_sum(t)
    got = g.broadcast({"rows": [rank, 7]})
    g.barrier()
    np.save(f"{out}.{rank}.npy", np.array([*t[0].tolist(), *t[1].reshape(-1).tolist(), *t[2].tolist(), *got["rows"]]))
    g.abort()


def _forked(target, *args) -> None:
    """Run ``target(rank, address, *args)`` in 2 forked processes (spawn would re-import
    torch in each child: ~20 s on a loaded machine) joined at a fresh tcp:// address.
    With CUDA, autograd's device threads refuse to run in a forked child: spawn there."""
    import multiprocessing as mp

    from asyncflow.engines.collective import free_address

    address, ctx = free_address(), mp.get_context("spawn" if torch.cuda.is_available() else "fork")
    procs = [ctx.Process(target=target, args=(r, address, *args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]


def test_torch_group_of_two_processes(tmp_path):
    """The Ray launcher's group: gloo at a tcp:// rendezvous with a free port."""
    out = str(tmp_path / "got")
    _forked(_torch_rank, out)
    for rank in range(2):  # (1 + 2) x [1, 10], [[0 + 1, 0 + 2], [6, 8]], 5 + 6, then rank 0's object
        assert np.load(f"{out}.{rank}.npy").tolist() == [3.0, 30.0, 1.0, 2.0, 6.0, 8.0, 11.0, 0.0, 7.0]


def test_gradient_buckets_hand_computed():
    f32 = [torch.full((n,), float(n)) for n in (2, 2, 4)]  # 8, 8 and 16 bytes
    tensors = [*f32, torch.tensor([3]), torch.ones(2, 2)]
    assert buckets(tensors, bucket_bytes=16) == [[0, 1], [2], [3], [4]]  # dtype changes: a new bucket
    assert buckets(tensors, bucket_bytes=1 << 20) == [[0, 1, 2], [3], [4]]
    calls = []

    def double(t):  # a stand-in all-reduce: every element x 2, in place
        calls.append(t.numel())
        t.mul_(2)

    all_reduce_buckets(tensors, double, bucket_bytes=16)
    assert calls == [4, 4, 1, 4]  # one call a bucket (the first two flattened together)
    assert [t.tolist() for t in tensors] == [[4.0, 4.0], [4.0, 4.0], [8.0] * 4, [6], [[2.0, 2.0], [2.0, 2.0]]]


ALGO = Algorithm.from_config(AlgorithmConfig(name="grpo", loss_agg="token-mean"), 8)


def _actor_rank(rank: int, address: str, out: str, fsdp: bool) -> None:
    """One trainer rank in its own process, with its own data plane holding the same rows
    (same puts, same row ids), so rank 0's broadcast metas name the same rows everywhere."""
    from asyncflow.engines.collective import TorchGroup

    torch.set_num_threads(1)
    torch.manual_seed(0)
    group = TorchGroup(address, rank, 2, timeout_s=60)
    plane = DataPlane(SCHEMA)
    for v in range(2):
        fill(plane, v)
    role = actor(plane, ALGO, group, fsdp=fsdp)
    if fsdp:  # really sharded: each rank holds only part of the parameters
        assert all(p.to_local().numel() < p.numel() for p in role.engine.model.parameters() if p.numel() > 1)
    for v in range(2):
        role.train_step(v, prefetch_next=v == 0)
    np.savez(f"{out}.{rank}.npz", **role.engine.export_weights())  # (FSDP: an all-gather, every rank)
    group.abort()


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_process_ranks_take_the_same_step_as_one(tmp_path, fsdp):
    """The Ray launcher's trainer (ranks as processes, torch.distributed), DDP and FSDP2."""
    out = str(tmp_path / "w")
    _forked(_actor_rank, out, fsdp)
    single = run(1, ALGO)[0]
    for rank in range(2):
        got = np.load(f"{out}.{rank}.npz")
        assert set(got.files) == set(single)
        for n, w in single.items():
            np.testing.assert_allclose(got[n], w, atol=1e-5, rtol=1e-5, err_msg=f"rank {rank} {n}")
