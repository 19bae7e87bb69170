"""SGLang adapter (``rollout.engine=sglang``; ``pip install asyncflow[sglang]`` on a CUDA machine).

Checked against SGLang 0.5.23's source (the wheel, read, never installed here; see
docs/guide.md). SGLang is imported only inside this module, when an engine is built. Its
offline ``sglang.Engine`` runs the scheduler in other processes and its tokenizer manager
in ours, on asyncio: each request is one ``async_generate(input_ids=...,
return_logprob=True, rid=...)`` task, which holds the manager's reader lock
(``model_update_lock``) until it finishes. The manager binds itself to the first event loop
that uses it and answers control calls there, and its aborts go out on a socket of that
loop's thread; so **everything** (generation, aborts, the weight update) runs on one event
loop in one background thread owned by :class:`SGLangBackend`; the engine's own
synchronous methods (``Engine.update_weights_from_tensor`` etc., which run another loop)
are never called. :meth:`SGLangBackend.poll` returns what finished since the last poll.

* **Log-probs**: ``meta_info["output_token_logprobs"]`` is a list of
  ``(logprob, token_id, text)``: mapped by :func:`update_from_result`; they are
  ``log(softmax(logits / T))``, as our trainer's.
* **Weights** (slime's sequence), on the adapter's loop: ``pause_generation(mode="abort")``
  (every live generation is aborted and returns its tokens so far; the call returns once
  none holds the reader lock) -> ``flush_cache()`` (the radix cache held KV of the old
  weights; its ``success`` must be true) -> ``update_weights_from_tensor(flush_cache=False)``
  per bucket (each ``(success, message)`` checked) -> ``continue_generation()``. The
  aborted answers come back from ``load`` as interrupted updates with the old version, and
  :class:`~asyncflow.engines.adapters.StepBatch` re-submits them (prompt + tokens so far),
  so every answer continues under the new weights (``rollout.on_swap=continue``) or is
  restarted (``discard``). A failed step is an
  :class:`~asyncflow.engines.adapters.EngineStepError` naming it; the engine then stays
  paused and the backend refuses further use.
* **Abort**: ``tokenizer_manager.abort_request(rid)`` on the loop. SGLang's scheduler
  aborts every request whose id *starts with* the given one: the ids are prefix-free
  (:func:`~asyncflow.engines.adapters.request_id`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Awaitable, Coroutine, Mapping, Sequence
from typing import Any

import torch

from asyncflow.engines.adapters import EngineStepError, Loaded, StepEngine, Update, chunked, import_engine
from asyncflow.engines.types import SamplingParams

CALL_TIMEOUT_S = 60.0  # an abort
UPDATE_TIMEOUT_S = 600.0  # pause (waits for aborted generations), flush, every bucket, resume
FLUSH_TIMEOUT_S = 60.0  # flush_cache waits this long for the scheduler to be idle


def update_from_result(rid: str, result: Mapping[str, Any]) -> Update:
    """One ``async_generate`` result -> :class:`Update`: finished, or interrupted (aborted:
    its tokens so far, the answer not over)."""
    meta = result["meta_info"]
    items = meta.get("output_token_logprobs")
    if items is None:
        raise ValueError("SGLang returned no output_token_logprobs: generate with return_logprob=True")
    tokens = [int(it[1]) for it in items]
    logprobs = [float(it[0]) for it in items]
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason == "abort":
        return Update(rid, tokens, logprobs, finished=False, interrupted=True)
    return Update(rid, tokens, logprobs, True, "length" if reason == "length" else "stop")


class SGLangBackend:
    def __init__(self, engine: Any, bucket: int = 64, dtype: torch.dtype | None = None):
        from sglang.srt.managers import io_struct  # lazy: sglang (an optional extra)
        from sglang.srt.utils import MultiprocessingSerializer  # lazy: sglang (an optional extra)

        self.engine, self.bucket, self.dtype = engine, bucket, dtype
        self.io, self.serializer = io_struct, MultiprocessingSerializer
        self.tp = int(getattr(getattr(engine, "server_args", None), "tp_size", 1) or 1)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-loop", daemon=True)
        self.thread.start()
        self.results: queue.Queue[Update | EngineStepError] = queue.Queue()
        self.tasks: dict[str, concurrent.futures.Future] = {}
        self.broken: EngineStepError | None = None

    def _usable(self) -> None:
        if self.broken is not None:
            raise EngineStepError("sglang", "use after a failed weight update", str(self.broken))

    def _call(self, coro: Coroutine[Any, Any, Any], step: str, timeout_s: float) -> Any:
        """Run ``coro`` on the adapter's loop and wait for it (an EngineStepError on failure)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except EngineStepError:
            raise
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise EngineStepError("sglang", step, f"no answer in {timeout_s:.0f} s") from None
        except Exception as e:
            raise EngineStepError("sglang", step, f"{type(e).__name__}: {e}") from e

    async def _run(self, rid: str, prompt_ids: list[int], params: dict) -> None:
        try:
            result = await self.engine.async_generate(input_ids=prompt_ids, sampling_params=params,
                                                      return_logprob=True, rid=rid)
            self.results.put(update_from_result(rid, result))
        except Exception as e:  # reported by the next poll
            self.results.put(EngineStepError("sglang", f"generate (request {rid})", f"{type(e).__name__}: {e}"))

    def submit(self, rid: str, prompt_ids: list[int], max_tokens: int, min_tokens: int,
               sampling: SamplingParams) -> None:
        self._usable()
        params = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                  "max_new_tokens": max_tokens, "min_new_tokens": min_tokens}
        self.tasks[rid] = asyncio.run_coroutine_threadsafe(self._run(rid, list(prompt_ids), params), self.loop)

    def _drain(self, wait_s: float) -> list[Update]:
        out: list[Update] = []
        try:
            item = self.results.get(timeout=wait_s) if wait_s > 0 else self.results.get_nowait()
            while True:
                if isinstance(item, EngineStepError):
                    raise item
                self.tasks.pop(item.rid, None)
                out.append(item)
                item = self.results.get_nowait()
        except queue.Empty:
            pass
        return out

    def poll(self, wait_s: float = 0.05) -> list[Update]:
        """What finished since the last poll, waiting up to ``wait_s`` for one when any runs."""
        self._usable()
        return self._drain(wait_s if self.tasks else 0.0)

    async def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine.tokenizer_manager.abort_request(rid)

    def abort(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.tasks.pop(rid, None)
        self._call(self._abort(list(rids)), "abort_request", CALL_TIMEOUT_S)

    async def _checked(self, step: str, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except Exception as e:
            raise EngineStepError("sglang", step, f"{type(e).__name__}: {e}") from e

    async def _update(self, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
        tm, io = self.engine.tokenizer_manager, self.io
        pause = io.PauseGenerationReqInput(mode="abort")
        await self._checked("pause_generation(mode='abort')", tm.pause_generation(pause))
        flushed = await self._checked("flush_cache", tm.flush_cache(timeout_s=FLUSH_TIMEOUT_S))
        if not getattr(flushed, "success", False):
            raise EngineStepError("sglang", "flush_cache", getattr(flushed, "message", "") or "success=False")
        for i, part in enumerate(buckets):
            step = f"update_weights_from_tensor (bucket {i + 1} of {len(buckets)})"
            payload = [self.serializer.serialize(part) for _ in range(self.tp)]  # one per tensor-parallel rank
            req = io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, flush_cache=False)
            ok, message = await self._checked(step, tm.update_weights_from_tensor(req, None))
            if not ok:
                raise EngineStepError("sglang", step, message)
        await self._checked("continue_generation", tm.continue_generation(io.ContinueGenerationReqInput()))

    def load(self, weights: list[tuple[str, Any]]) -> Loaded:
        """Pause (aborting every generation), flush, update in buckets, resume, on the loop;
        the aborted generations' partial answers come back as ``settled``."""
        self._usable()
        tensors = []
        for name, t in weights:  # torch-owned copies: SGLang moves them into shared memory
            t = torch.as_tensor(t)
            tensors.append((name, t.to(self.dtype, copy=True) if self.dtype and t.is_floating_point() else t.clone()))
        buckets = [list(part) for part in chunked(tensors, self.bucket)]
        try:
            self._call(self._update(buckets), "weight update", UPDATE_TIMEOUT_S)
        except EngineStepError as e:
            self.broken = e
            raise
        return Loaded(f"update_weights_from_tensor x{len(buckets)}", self._drain(0.0))

    @staticmethod
    async def _cancel_tasks() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Cancel what runs on the loop (generations, the manager's handle loop), stop it, shut
        the engine down."""
        if self.loop.is_running():
            try:
                self._call(self._cancel_tasks(), "close", CALL_TIMEOUT_S)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(CALL_TIMEOUT_S)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()
        shutdown = getattr(self.engine, "shutdown", None)
        if callable(shutdown):
            shutdown()


class SGLangEngine(StepEngine):
    """The engine protocol over SGLang (see module doc)."""

    def __init__(self, model_path: str, eos_id: int, max_batch: int = 64, dtype: str = "bfloat16",
                 seed: int = 0, mem_fraction_static: float = 0.5, **engine_kwargs: Any):
        sglang = import_engine("sglang", "SGLang")
        engine = sglang.Engine(model_path=model_path, dtype=dtype, random_seed=seed, max_running_requests=max_batch,
                               mem_fraction_static=mem_fraction_static, **engine_kwargs)
        torch_dtype = getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32") else None
        super().__init__(SGLangBackend(engine, dtype=torch_dtype), eos_id, max_batch)
