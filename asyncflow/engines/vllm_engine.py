"""vLLM adapter (``rollout.engine=vllm``; ``pip install asyncflow[vllm]`` on a CUDA machine).

Checked against vLLM 0.33.0's source (the wheel, read, never installed here; see
docs/guide.md). vLLM is imported only inside this module, when an engine is built. The
engine is driven step by step through ``LLM.llm_engine`` (``add_request`` / ``step`` /
``abort_request``), always from the thread that steps it (its sockets are not
thread-safe), so the rollout role keeps its continuous batching, streaming and
partial-rollout logic (:class:`~asyncflow.engines.adapters.StepBatch`).

* **Log-probs**: each request asks for ``logprobs=0`` (the sampled token's only) and the
  LLM is built with ``logprobs_mode="processed_logprobs"``: ``log_softmax(logits / T)``,
  the quantity our trainer recomputes (with ``top_p < 1`` vLLM's are those of the
  truncated distribution: keep ``top_p = 1`` for exact importance ratios).
* **Weights**: the engine core is another process and its messages are msgpack
  (``vllm/v1/serial_utils.py``): no function crosses without
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` and tensors arrive as ``(dtype, shape, buffer)``
  lists. So only control messages cross: the weights are written as one safetensors file
  into a private folder (mode 0700; ``/dev/shm`` where it exists, so host memory), then
  ``sleep(level=0, mode="keep")`` (scheduling paused, requests kept) ->
  ``collective_rpc("reload_weights", kwargs={"weights_path": folder})`` (every worker
  loads the folder through the model's ``load_weights``; ``Worker.reload_weights``) ->
  ``reset_prefix_cache(reset_running_requests=True)`` (running requests are preempted and
  recompute their KV from their tokens, cached blocks are forgotten; must return ``True``)
  -> ``wake_up(tags=["scheduling"])`` (must return ``True``). The file is removed after.
  The IPC and NCCL weight-transfer engines (``vllm/distributed/weight_transfer``) were not
  taken: IPC's handles carry Python types that msgpack refuses without the insecure flag,
  and NCCL needs a sender on another GPU in a process group, while our weights arrive as
  host buffers from the weight store.
* **Errors**: a step that raises, or a reset / wake-up that answers ``False``, is an
  :class:`~asyncflow.engines.adapters.EngineStepError` naming the step; the backend then
  refuses further use (the engine may be paused with half-loaded weights).
* **Abort**: ``llm_engine.abort_request`` (the caller's ids; vLLM maps them to its own).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from safetensors.torch import save_file

from asyncflow.engines.adapters import EngineStepError, Loaded, StepEngine, Update, import_engine, sampled_logprobs
from asyncflow.engines.types import SamplingParams

WEIGHTS_FILE = "model.safetensors"  # the loader globs *.safetensors in the folder
RELOAD_TIMEOUT_S = 600.0  # collective_rpc's deadline for every worker's reload (sleep/reset/wake_up have none in vLLM)


def update_from_output(out: Any) -> Update:
    """A vLLM ``RequestOutput`` (cumulative) -> :class:`Update` of its first completion."""
    o = out.outputs[0]
    tokens = list(o.token_ids)
    reason = getattr(o, "finish_reason", None)
    return Update(out.request_id, tokens, sampled_logprobs(tokens, o.logprobs), bool(out.finished),
                  "length" if reason == "length" else ("stop" if reason else None))


def weights_folder(parent: str | None = None) -> str:
    """A new private folder (0700) for the weight file: under ``parent``, else ``/dev/shm``
    (host memory) where it is writable, else the system's temporary folder."""
    if parent is None and os.access("/dev/shm", os.W_OK):
        parent = "/dev/shm"
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix="asyncflow-vllm-weights-", dir=parent)


class VLLMBackend:
    def __init__(self, llm: Any, vllm_module: Any, dtype: torch.dtype | None, folder: str):
        self.llm, self.vllm, self.dtype, self.folder = llm, vllm_module, dtype, folder
        self.engine = llm.llm_engine
        self.live: set[str] = set()
        self.broken: EngineStepError | None = None
        self._cleanup = weakref.finalize(self, shutil.rmtree, folder, True)  # the folder goes, closed or not

    def _usable(self) -> None:
        if self.broken is not None:
            raise EngineStepError("vllm", "use after a failed weight update", str(self.broken))

    def submit(self, rid: str, prompt_ids: list[int], max_tokens: int, min_tokens: int,
               sampling: SamplingParams) -> None:
        self._usable()
        params = self.vllm.SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=max_tokens,
            min_tokens=min_tokens, logprobs=0, detokenize=False)
        self.engine.add_request(rid, {"prompt_token_ids": list(prompt_ids)}, params)
        self.live.add(rid)

    def poll(self) -> list[Update]:
        self._usable()
        if not self.live:
            return []
        if not self.engine.has_unfinished_requests():  # step() would block for an output that never comes
            raise EngineStepError("vllm", "step", f"{len(self.live)} live requests are unknown to the engine")
        out = [update_from_output(o) for o in self.engine.step()]
        self.live.difference_update(u.rid for u in out if u.finished)
        return out

    def abort(self, rids: Sequence[str]) -> None:
        self.live.difference_update(rids)
        self.engine.abort_request(list(rids))

    def _write(self, weights: list[tuple[str, Any]]) -> str:
        """The weights as one safetensors file in the private folder (written, then renamed)."""
        tensors = {}
        for name, t in weights:
            t = torch.as_tensor(t)
            cast = self.dtype is not None and t.is_floating_point()  # half the file for a bf16 engine
            tensors[name] = (t.to(self.dtype) if cast else t).contiguous()
        tmp, path = os.path.join(self.folder, ".incoming"), os.path.join(self.folder, WEIGHTS_FILE)
        save_file(tensors, tmp)
        os.replace(tmp, path)
        return path

    def _step(self, name: str, call: Callable[[], Any], expect: Any = None) -> Any:
        try:
            result = call()
        except Exception as e:
            raise EngineStepError("vllm", name, f"{type(e).__name__}: {e}") from e
        if expect is not None and result is not expect:
            raise EngineStepError("vllm", name, f"the engine answered {result!r}, so it refused")
        return result

    def load(self, weights: list[tuple[str, Any]]) -> Loaded:
        """Pause, reload from the folder, forget cached KV (preempting running requests),
        resume; every answer checked (see module doc)."""
        self._usable()
        path = self._write(weights)
        try:
            self._step("sleep(level=0, mode='keep')", lambda: self.llm.sleep(level=0, mode="keep"))
            self._step("collective_rpc('reload_weights')", lambda: self.llm.collective_rpc(
                "reload_weights", timeout=RELOAD_TIMEOUT_S,
                kwargs={"weights_path": self.folder, "is_checkpoint_format": True}))
            self._step("reset_prefix_cache(reset_running_requests=True)",
                       lambda: self.llm.reset_prefix_cache(reset_running_requests=True), expect=True)
            self._step("wake_up(tags=['scheduling'])", lambda: self.llm.wake_up(tags=["scheduling"]), expect=True)
        except EngineStepError as e:
            self.broken = e
            raise
        finally:
            os.remove(path)
        return Loaded("reload_weights")

    def close(self) -> None:
        self._cleanup()
        core = getattr(self.engine, "engine_core", None)
        if core is not None and callable(getattr(core, "shutdown", None)):
            core.shutdown()


class VLLMEngine(StepEngine):
    """The engine protocol over vLLM (see module doc). ``weights_dir``: where the private
    weight folder is made (default ``/dev/shm``, else the temporary folder)."""

    def __init__(self, model_path: str, eos_id: int, max_batch: int = 64, dtype: str = "bfloat16",
                 seed: int = 0, gpu_memory_utilization: float = 0.5, weights_dir: str | None = None,
                 **llm_kwargs: Any):
        vllm = import_engine("vllm", "vLLM")
        llm = vllm.LLM(model=model_path, dtype=dtype, seed=seed, max_num_seqs=max_batch,
                       gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs",
                       **llm_kwargs)
        torch_dtype = getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32") else None
        super().__init__(VLLMBackend(llm, vllm, torch_dtype, weights_folder(weights_dir)), eos_id, max_batch)
