"""SGLang adapter (``rollout.engine=sglang``; ``pip install asyncflow[sglang]`` on a CUDA machine).

SGLang is imported only inside this module, when an engine is built. Its offline
``sglang.Engine`` runs its scheduler in other processes and is asynchronous: each request
is one ``async_generate(input_ids=..., return_logprob=True, rid=...)`` task on an event
loop in a background thread; :meth:`SGLangBackend.poll` returns the requests that finished
since the last poll (waiting briefly for one when any is running).

* **Log-probs**: ``meta_info["output_token_logprobs"]`` is a list of
  ``(logprob, token_id, text)``: mapped by :func:`update_from_result`. SGLang's sampled
  log-probs are taken after temperature scaling, as our trainer's.
* **Weights**: ``Engine.update_weights_from_tensor(named_tensors=[(hf_name, tensor)],
  flush_cache=True)``, in buckets; the radix (prefix) cache is flushed with the last one.
* **Abort**: ``Engine.tokenizer_manager.abort_request(rid)``; the task is cancelled.
* **Swap policy**: an answer's tokens arrive only when it finishes, so answers cannot be
  continued with a recomputed prefix; this engine needs ``rollout.on_swap=discard`` (the
  config says so in one line), which keeps every token's recorded version exact.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from asyncflow.engines.adapters import StepEngine, Update, chunked, import_engine
from asyncflow.engines.types import SamplingParams


def update_from_result(rid: str, result: Mapping[str, Any]) -> Update:
    """One finished ``async_generate`` result -> :class:`Update`."""
    meta = result["meta_info"]
    items = meta.get("output_token_logprobs")
    if items is None:
        raise ValueError("SGLang returned no output_token_logprobs: generate with return_logprob=True")
    tokens = [int(it[1]) for it in items]
    logprobs = [float(it[0]) for it in items]
    reason = (meta.get("finish_reason") or {}).get("type")
    return Update(rid, tokens, logprobs, True, "length" if reason == "length" else "stop")


class SGLangBackend:
    def __init__(self, engine: Any, bucket: int = 64):
        self.engine, self.bucket = engine, bucket
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-loop", daemon=True)
        self.thread.start()
        self.results: queue.Queue = queue.Queue()
        self.tasks: dict[str, Any] = {}

    async def _run(self, rid: str, prompt_ids: list[int], params: dict) -> None:
        result = await self.engine.async_generate(input_ids=prompt_ids, sampling_params=params,
                                                  return_logprob=True, rid=rid)
        self.results.put(update_from_result(rid, result))

    def submit(self, rid: str, prompt_ids: list[int], max_tokens: int, min_tokens: int,
               sampling: SamplingParams) -> None:
        params = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                  "max_new_tokens": max_tokens, "min_new_tokens": min_tokens}
        self.tasks[rid] = asyncio.run_coroutine_threadsafe(self._run(rid, list(prompt_ids), params), self.loop)

    def poll(self, wait_s: float = 0.05) -> list[Update]:
        out = []
        try:
            out.append(self.results.get(timeout=wait_s if self.tasks else 0))
            while True:
                out.append(self.results.get_nowait())
        except queue.Empty:
            pass
        for u in out:
            self.tasks.pop(u.rid, None)
        return out

    def abort(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.engine.tokenizer_manager.abort_request(rid)
            task = self.tasks.pop(rid, None)
            if task is not None:
                task.cancel()

    def load(self, weights: list) -> int:
        """Send ``(name, tensor)`` pairs in buckets; flush the prefix cache with the last one."""
        buckets = list(chunked(weights, self.bucket))
        for i, part in enumerate(buckets):
            self.engine.update_weights_from_tensor(named_tensors=list(part), flush_cache=i == len(buckets) - 1)
        return len(buckets)


class SGLangEngine(StepEngine):
    """The engine protocol over SGLang (see module doc)."""

    def __init__(self, model_path: str, eos_id: int, max_batch: int = 64, dtype: str = "bfloat16",
                 seed: int = 0, mem_fraction_static: float = 0.5, **engine_kwargs: Any):
        sglang = import_engine("sglang", "SGLang")
        engine = sglang.Engine(model_path=model_path, dtype=dtype, random_seed=seed, max_running_requests=max_batch,
                               mem_fraction_static=mem_fraction_static, **engine_kwargs)
        super().__init__(SGLangBackend(engine), eos_id, max_batch)
