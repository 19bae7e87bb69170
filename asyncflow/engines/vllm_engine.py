"""vLLM adapter (``rollout.engine=vllm``; ``pip install asyncflow[vllm]`` on a CUDA machine).

vLLM is imported only inside this module, when an engine is built. The engine is driven
step by step through ``LLM.llm_engine`` (``add_request`` / ``step`` / ``abort_request``),
so the rollout role keeps its continuous batching, streaming and partial-rollout logic
(:class:`~asyncflow.engines.adapters.StepBatch`); vLLM schedules the requests.

* **Log-probs**: each request asks for ``logprobs=0`` (the sampled token's only) and the
  LLM is built with ``logprobs_mode="processed_logprobs"``: the log-prob after temperature,
  i.e. ``log_softmax(logits / T)``, the quantity our trainer recomputes. (With
  ``top_p < 1`` vLLM's processed log-probs are those of the truncated distribution, unlike
  the built-in engine's; keep ``top_p = 1`` for exact importance ratios.)
* **Weights**: the weight store's numpy buffers, renamed to Hugging Face names
  (:func:`~asyncflow.engines.adapters.named_tensors`), go to the model's own
  ``load_weights`` (which fuses q/k/v and gate/up itself): through
  ``LLM.collective_rpc`` on every worker (vLLM >= 0.8, the V1 engine's workers live in
  other processes), else, on old in-process engines, through
  ``llm_engine.model_executor.driver_worker.model_runner.model``. Then the prefix cache is
  reset: cached KV blocks were computed by the old weights.
* **Abort**: ``llm_engine.abort_request``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncflow.engines.adapters import StepEngine, Update, import_engine, sampled_logprobs
from asyncflow.engines.types import SamplingParams


def _load_on_worker(worker: Any, weights: list) -> int:
    """Runs inside each vLLM worker (sent by ``collective_rpc``): load HF-named tensors."""
    model = worker.model_runner.model
    device = next(model.parameters()).device
    model.load_weights((name, t.to(device, non_blocking=True)) for name, t in weights)
    return len(weights)


def update_from_output(out: Any) -> Update:
    """A vLLM ``RequestOutput`` (cumulative) -> :class:`Update` of its first completion."""
    o = out.outputs[0]
    tokens = list(o.token_ids)
    reason = getattr(o, "finish_reason", None)
    return Update(out.request_id, tokens, sampled_logprobs(tokens, o.logprobs), bool(out.finished),
                  "length" if reason == "length" else ("stop" if reason else None))


class VLLMBackend:
    def __init__(self, llm: Any, vllm_module: Any, seed: int = 0):
        self.llm, self.vllm, self.seed = llm, vllm_module, seed
        self.engine = llm.llm_engine

    def submit(self, rid: str, prompt_ids: list[int], max_tokens: int, min_tokens: int,
               sampling: SamplingParams) -> None:
        params = self.vllm.SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=max_tokens,
            min_tokens=min_tokens, logprobs=0, detokenize=False)
        self.engine.add_request(rid, {"prompt_token_ids": list(prompt_ids)}, params)

    def poll(self) -> list[Update]:
        return [update_from_output(o) for o in self.engine.step()]

    def abort(self, rids: Sequence[str]) -> None:
        self.engine.abort_request(list(rids))

    def load(self, weights: list) -> str:
        """Load ``(name, tensor)`` pairs into every worker; returns the path used."""
        if hasattr(self.llm, "collective_rpc"):
            self.llm.collective_rpc(_load_on_worker, args=(weights,))
            path = "collective_rpc"
        else:  # old engines: the model lives in this process
            self.engine.model_executor.driver_worker.model_runner.model.load_weights(iter(weights))
            path = "driver_worker"
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()
        return path


class VLLMEngine(StepEngine):
    """The engine protocol over vLLM (see module doc)."""

    def __init__(self, model_path: str, eos_id: int, max_batch: int = 64, dtype: str = "bfloat16",
                 seed: int = 0, gpu_memory_utilization: float = 0.5, **llm_kwargs: Any):
        vllm = import_engine("vllm", "vLLM")
        llm = vllm.LLM(model=model_path, dtype=dtype, seed=seed, max_num_seqs=max_batch,
                       gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs",
                       **llm_kwargs)
        super().__init__(VLLMBackend(llm, vllm, seed), eos_id, max_batch)
