"""``resources.device``: where the built-in engines compute.

Everywhere: the config's checks, each compute role's share of the GPUs on Ray, and the
one-line error when the named device is not there. With a CUDA GPU (``gpu`` marker,
skipped otherwise): the trainer takes the same step as on the CPU, and whole jobs
(in-process and on Ray) learn. (Sampling on the GPU records the log-probs a full
recompute gives, across a weight swap: ``test_inference_engine.py``, device ``cuda``.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncflow.cli import main
from asyncflow.config import ConfigError, load_config
from asyncflow.workflow.plan import plan_workers

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpus(overrides: list[str], ngpu: int) -> dict[str, float]:
    return {s.name: s.gpus for s in plan_workers(load_config(None, overrides), ncpu=2, ngpu=ngpu)}


def test_compute_roles_share_the_gpus_as_they_share_the_cpus():
    assert _gpus(["resources.device=cuda"], 1) == {"rollout": 0.5, "actor": 0.5}
    assert _gpus(["resources.device=cuda"], 4) == {"rollout": 1.0, "actor": 1.0}  # one whole GPU at most
    # the reward worker computes nothing on a GPU; reference and actor and rollout share one
    assert _gpus(["resources.device=cuda", "reward.placement=separate", "algorithm.kl_coef=0.01"], 1) == \
        {"rollout": 0.3333, "reward": 0.0, "reference": 0.3333, "actor": 0.3333}
    assert _gpus(["resources.device=cuda", "mode=sync"], 1) == {"colocated": 1.0}
    assert _gpus([], 1) == {"rollout": 0.0, "actor": 0.0}  # device=cpu asks for none
    assert _gpus(["resources.device=cuda"], 0) == {"rollout": 0.0, "actor": 0.0}  # none to share


def test_a_vllm_rollout_gets_a_gpu_share_whatever_the_device(monkeypatch):
    import asyncflow.config.rollout

    monkeypatch.setattr(asyncflow.config.rollout, "engine_installed", lambda name: True)  # (not installed here)
    assert _gpus(["rollout.engine=vllm"], 1) == {"rollout": 1.0, "actor": 0.0}
    assert _gpus(["rollout.engine=vllm", "resources.device=cuda"], 1) == {"rollout": 0.5, "actor": 0.5}


@pytest.mark.parametrize("overrides,field", [
    (["resources.device=gpu"], "resources.device"),
    (["resources.device=cuda", "train.dp=2"], "resources.device"),
    (["resources.device=cuda:1"], "resources.device"),  # Ray picks each role's GPU
])
def test_bad_device_settings_are_config_errors(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, overrides)
    assert load_config(None, ["resources.device=cuda:1", "launcher=local"]).resources.device == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_a_gpu_is_a_one_line_error_before_any_work(tmp_path, capsys):
    assert main(["train", "resources.device=cuda", "launcher=local", f"run_dir={tmp_path}",
                 f"warmstart.cache_dir={tmp_path}/ws"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("asyncflow: error: resources.device=cuda") and "resources.device=cpu" in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "ws").exists()  # refused before the warm-start


# ----------------------------------------------------------------------------- on a GPU
def _tiny(seed=0):
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    return tok, build_tiny_model(tok, seed=seed)


@pytest.mark.gpu
@cuda
def test_gpu_training_step_equals_the_cpu_step():
    from asyncflow.algorithms.algorithm import Algorithm
    from asyncflow.engines.training import TrainEngine

    rng = np.random.default_rng(0)
    prompts = [[1, *rng.integers(4, 20, size=5).tolist()] for _ in range(8)]
    responses = [rng.integers(4, 20, size=int(rng.integers(1, 7))).tolist() for _ in range(8)]
    extras = {"logprobs": [rng.normal(-2.0, 0.3, size=len(r)).astype(np.float32) for r in responses],
              "advantages": rng.normal(size=8).astype(np.float32)}
    out = {}
    for dev in ("cpu", "cuda"):
        tok, model = _tiny()
        eng = TrainEngine(model.to(dev), tok.pad_token_id, lr=1e-3)
        assert eng.device.type == dev
        logp = eng.logprobs(prompts, responses)
        m = eng.forward_backward(prompts, responses, extras, Algorithm().loss(8))
        step = eng.optimizer_step()
        out[dev] = (logp, m["loss"], step["grad_norm"])
    for a, b in zip(out["cpu"][0], out["cuda"][0]):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)
    assert out["cuda"][1] == pytest.approx(out["cpu"][1], rel=1e-4, abs=1e-6)
    assert out["cuda"][2] == pytest.approx(out["cpu"][2], rel=1e-3)


@pytest.fixture(scope="module")
def gpu_warmstart(tmp_path_factory):
    return tmp_path_factory.mktemp("warmstart")


@pytest.mark.gpu
@pytest.mark.slow
@cuda
@pytest.mark.parametrize("launcher", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_async_job_on_the_gpu_learns(tmp_path, launcher, gpu_warmstart):
    """The first (in-process) job warm-starts on the GPU, into a cache of this module's;
    to a lower target than the default, so that 16 steps have room to show learning
    (a GPU warm-start evaluated every 50 steps landed at 80.6% for a 65% target)."""
    from asyncflow.api import train

    cfg = load_config(None, [f"launcher={launcher}", "resources.device=cuda", "train.steps=16",
                             "train.eval_every=0", f"run_dir={tmp_path}", "progress=false",
                             f"warmstart.cache_dir={gpu_warmstart}", "warmstart.target_acc=0.5"])
    summary = train(cfg)
    assert summary["device"] == "cuda"
    assert summary["init"]["cached"] == (launcher == "ray")
    assert summary["init"]["accuracy"] >= cfg.warmstart.target_acc
    assert summary["heldout_acc_after"] - summary["heldout_acc_before"] >= 0.05, summary
    assert 0 <= summary["max_staleness"] <= 1
