"""A stand-in for SGLang 0.5.23's offline ``sglang.Engine`` that keeps the constraints an RL adapter meets.

Read against the SGLang 0.5.23 wheel (``pip download --no-deps sglang==0.5.23``, unpacked, not
installed); each behaviour names the file it mirrors:

* ``sglang/srt/entrypoints/engine.py`` ``Engine``: ``self.loop`` is the constructing thread's
  event loop (``_ensure_event_loop``); ``async_generate`` (non-streaming) returns
  ``await generator.__anext__()``, so the generator stays suspended inside the reader lock
  until it is finalised; the synchronous control methods (``update_weights_from_tensor``,
  ``flush_cache``) run ``self.loop.run_until_complete(...)`` on that loop.
* ``sglang/srt/managers/tokenizer_manager.py`` ``TokenizerManager``: ``generate_request``
  waits while paused (``is_pause_cond``) and holds ``model_update_lock.reader_lock``
  (``sglang/srt/utils/aio_rwlock.py``) for a generation's whole life; its handle loop is
  bound to the first event loop that uses it (``auto_create_handle_loop``) and sets the
  replies there, so a call from a second loop never gets its reply (the fake raises
  instead of hanging); ``abort_request`` sends on a ZMQ socket owned by that loop's thread
  (the fake raises from any other thread); ``pause_generation(mode="abort")`` aborts every
  request and waits until no generation holds the lock (the real one re-checks each 1 s,
  the fake each 10 ms); ``continue_generation`` resumes.
* ``sglang/srt/managers/tokenizer_control_mixin.py``: ``flush_cache`` returns
  ``FlushCacheReqOutput(success)``; ``update_weights_from_tensor`` returns ``(success,
  message)``: paused, it loads at once; not paused, the real one takes the writer lock and
  waits until every live generation has finished (the fake returns ``(False, ...)``: it
  fails an update that is not preceded by a pause).
* ``sglang/srt/managers/scheduler.py``: ``abort_request`` aborts every request whose id
  *starts with* the given one; an aborted request returns its tokens so far with
  ``finish_reason = {"type": "abort", ...}``; ``flush_cache`` succeeds only when idle.
* ``sglang/srt/managers/io_struct.py``: the request records; ``sglang/srt/utils/common.py``
  ``MultiprocessingSerializer``: torch's ``ForkingPickler`` (tensors in shared memory) and
  a restricted unpickler.

The model is the tiny Hugging Face model of ``model_path``, decoding with a real KV cache
and a radix-like prefix cache (``tests/fake_llm_core.py``), one token per request per tick
of a scheduler task on the tokenizer manager's loop. Test-only knobs (``Engine(...,
fake_knobs={...})``): ``"flush": "refuse"`` makes ``flush_cache`` fail; ``"hold": n`` stops
every request after ``n`` tokens until the first weight update (a slow engine frozen
mid-answer, so a test's swap always meets live generations).
"""

from __future__ import annotations

import asyncio
import io
import pickle
import threading
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from fake_llm_core import PrefixDecoder, Seq, load_named, request_seed

PAUSE_POLL_S = 0.01


# --------------------------------------------------------------------------- io_struct / utils


@dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: str = "abort"


@dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list[bytes]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass(kw_only=True)
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass(kw_only=True)
class GenerateReqInput:
    input_ids: list[int]
    sampling_params: dict
    return_logprob: bool = False
    rid: str | None = None
    stream: bool = False


class _SafeUnpickler(pickle.Unpickler):
    ALLOWED_PREFIXES = ("torch.", "builtins.", "collections.", "copyreg.", "multiprocessing.reduction.",
                        "multiprocessing.resource_sharer.")

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" or any(f"{module}.".startswith(p) for p in self.ALLOWED_PREFIXES):
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj: Any, output_str: bool = False) -> bytes:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory reductions on ForkingPickler

        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        return buf.getvalue()

    @staticmethod
    def deserialize(data: bytes) -> Any:
        return _SafeUnpickler(io.BytesIO(data)).load()


class RWLock:
    """``aio_rwlock.RWLock``: many readers or one writer; waiting writers block new readers."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers, self.writer, self.waiting_writers = 0, False, 0

    async def acquire_reader(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writer and not self.waiting_writers)
            self.readers += 1

    async def release_reader(self) -> None:
        async with self._cond:
            self.readers -= 1
            self._cond.notify_all()

    async def is_locked(self) -> bool:
        async with self._cond:
            return self.writer or self.readers > 0

    @property
    def reader_lock(self) -> _Reader:
        return _Reader(self)


class _Reader:
    def __init__(self, lock: RWLock):
        self.lock = lock

    async def __aenter__(self) -> None:
        await self.lock.acquire_reader()

    async def __aexit__(self, *exc: Any) -> None:
        await self.lock.release_reader()


# --------------------------------------------------------------------------- the scheduler (a task on the loop)


@dataclass
class _ReqState:
    out: dict | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


class _Scheduler:
    def __init__(self, tm: TokenizerManager, decoder: PrefixDecoder, max_running: int, seed: int, knobs: dict):
        self.tm, self.decoder, self.max_running, self.seed, self.knobs = tm, decoder, max_running, seed, knobs
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.paused = False
        self.wake = asyncio.Event()

    def add(self, obj: GenerateReqInput) -> None:
        p = obj.sampling_params
        if p.get("top_p", 1.0) != 1.0:
            raise NotImplementedError("the fake samples with top_p = 1 only")
        self.waiting.append(Seq(obj.rid or "", list(obj.input_ids), len(obj.input_ids), p["max_new_tokens"],
                                p.get("min_new_tokens", 0), p.get("temperature", 1.0),
                                request_seed(self.seed, obj.rid or "")))
        self.wake.set()

    def abort(self, rid: str, abort_all: bool) -> None:
        for seq in [*self.running, *self.waiting]:
            if abort_all or seq.rid.startswith(rid):  # scheduler.abort_request: a prefix match
                self._finish(seq, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})

    def pause(self, mode: str) -> None:
        self.paused = True
        if mode == "retract":
            for seq in reversed(self.running):
                seq.drop_kv()
                self.waiting.appendleft(seq)
            self.running.clear()

    def resume(self) -> None:
        self.paused = False
        self.wake.set()

    def _held(self, seq: Seq) -> bool:
        return "hold" in self.knobs and not self.tm.engine.updates and seq.n_out >= self.knobs["hold"]

    def flush(self) -> bool:
        if self.running or (self.waiting and not self.paused):  # is_fully_idle(ignore_waiting=paused)
            return False
        if self.knobs.get("flush") == "refuse":
            return False
        self.decoder.clear()
        return True

    def _finish(self, seq: Seq, reason: dict) -> None:
        for q in (self.running, self.waiting):
            if seq in q:
                q.remove(seq)
        seq.drop_kv()
        out = {"text": "", "output_ids": seq.tokens[seq.n_prompt:],
               "meta_info": {"id": seq.rid, "finish_reason": reason, "prompt_tokens": seq.n_prompt,
                             "completion_tokens": seq.n_out,
                             "output_token_logprobs": [(lp, t, None) for lp, t in
                                                       zip(seq.logprobs, seq.tokens[seq.n_prompt:])]}}
        self.tm.deliver(seq.rid, out)

    async def run(self) -> None:
        while True:
            admit = self.waiting and len(self.running) < self.max_running
            if self.paused or not (admit or any(not self._held(s) for s in self.running)):
                self.wake.clear()
                await self.wake.wait()
                continue
            while self.waiting and len(self.running) < self.max_running:
                self.running.append(self.waiting.popleft())
            for seq in [s for s in self.running if not self._held(s)]:
                self.decoder.next_token(seq)
                kind = self.decoder.finish_reason(seq)
                if kind == "length":
                    self._finish(seq, {"type": "length", "length": seq.max_tokens})
                elif kind == "stop":
                    self._finish(seq, {"type": "stop", "matched": self.decoder.eos_id})
            await asyncio.sleep(0)


# --------------------------------------------------------------------------- the tokenizer manager (caller's process)


class TokenizerManager:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None
        self.model_update_lock = RWLock()
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.rid_to_state: dict[str, _ReqState] = {}
        self.scheduler = _Scheduler(self, engine.decoder, engine.max_running, engine.seed, engine.knobs)
        self.tasks: list[asyncio.Task] = []

    def auto_create_handle_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self.event_loop is None:
            self.event_loop, self.loop_thread = loop, threading.get_ident()
            self.tasks.append(loop.create_task(self.scheduler.run()))
        elif loop is not self.event_loop:
            raise RuntimeError("fake SGLang: the tokenizer manager is used on a second event loop; the real one sets "
                               "its replies from its handle loop on the first, so this call would wait forever")

    def deliver(self, rid: str, out: dict) -> None:
        state = self.rid_to_state.pop(rid, None)
        if state is not None:
            state.out = out
            state.event.set()

    async def generate_request(self, obj: GenerateReqInput, request: Any = None) -> Any:
        self.auto_create_handle_loop()
        state = self.rid_to_state[obj.rid or ""] = _ReqState()
        async with self.is_pause_cond:
            await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        async with self.model_update_lock.reader_lock:
            self.scheduler.add(obj)
            await state.event.wait()
            yield state.out

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if threading.get_ident() != self.loop_thread:
            raise RuntimeError("fake SGLang: abort_request from another thread; the real one sends on the ZMQ socket "
                               "of the tokenizer manager's loop thread, which is not thread-safe")
        if not abort_all and (not rid or rid not in self.rid_to_state):
            return
        self.scheduler.abort(rid, abort_all)

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        self.auto_create_handle_loop()
        async with self.is_pause_cond:
            self.is_pause = True
            if obj.mode != "abort":
                self.scheduler.pause(obj.mode)
                return
            while True:
                self.abort_request(abort_all=True)
                if not await self.model_update_lock.is_locked():
                    break
                await asyncio.sleep(PAUSE_POLL_S)

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        self.auto_create_handle_loop()
        async with self.is_pause_cond:
            self.is_pause = False
            self.scheduler.resume()
            self.is_pause_cond.notify_all()

    async def flush_cache(self, timeout_s: float | None = None) -> FlushCacheReqOutput:
        self.auto_create_handle_loop()
        return FlushCacheReqOutput(success=self.scheduler.flush())

    async def update_weights_from_tensor(self, obj: UpdateWeightsFromTensorReqInput,
                                         request: Any = None) -> tuple[bool, str]:
        self.auto_create_handle_loop()
        async with self.is_pause_cond:
            paused = self.is_pause
        if not paused:
            return False, ("fake SGLang: update_weights_from_tensor without pause_generation (the real engine takes "
                           "the writer lock and waits until every live generation has finished)")
        try:
            load_named(self.engine.model, MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0]))
        except Exception as e:  # the scheduler reports a failed load as (False, message)
            return False, f"Failed to update weights: {e}."
        if obj.flush_cache:
            self.scheduler.flush()
        self.engine.updates += 1
        return True, "Succeeded to update model weights."


ENGINE_ARGS = {"dtype", "random_seed", "max_running_requests", "mem_fraction_static", "log_level", "tp_size",
               "skip_tokenizer_init", "disable_radix_cache"}


class Engine:
    """``sglang.Engine`` (the calls an RL adapter makes)."""

    _built: list[Engine] = []

    def __init__(self, model_path: str, fake_knobs: dict | None = None, **kwargs: Any):
        from transformers import AutoModelForCausalLM

        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:  # ServerArgs(**kwargs)
            raise TypeError(f"ServerArgs.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.decoder = PrefixDecoder(self.model, int(self.model.config.eos_token_id))
        self.max_running = kwargs.get("max_running_requests") or 64
        self.seed = kwargs.get("random_seed") or 0
        self.server_args = types.SimpleNamespace(model_path=model_path, tp_size=kwargs.get("tp_size", 1), **kwargs)
        self.updates = 0
        self.knobs = dict(fake_knobs or {})
        self.tokenizer_manager = TokenizerManager(self)
        self.loop = self._ensure_event_loop()
        Engine._built.append(self)

    @staticmethod
    def _ensure_event_loop() -> asyncio.AbstractEventLoop:
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            pass
        loop = asyncio.new_event_loop()  # (the real one takes the policy's loop of this thread, or makes one)
        return loop

    async def async_generate(self, prompt: Any = None, sampling_params: dict | None = None,
                             input_ids: list[int] | None = None, return_logprob: bool = False,
                             rid: str | None = None, stream: bool = False, **kwargs: Any) -> Any:
        obj = GenerateReqInput(input_ids=list(input_ids or []), sampling_params=dict(sampling_params or {}),
                               return_logprob=return_logprob, rid=rid, stream=stream)
        generator = self.tokenizer_manager.generate_request(obj, None)
        if stream:
            return generator
        return await generator.__anext__()

    def update_weights_from_tensor(self, named_tensors: list, load_format: str | None = None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        payload = [MultiprocessingSerializer.serialize(named_tensors)]
        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, load_format=load_format,
                                              flush_cache=flush_cache)
        return self.loop.run_until_complete(self.tokenizer_manager.update_weights_from_tensor(obj, None))

    def flush_cache(self) -> FlushCacheReqOutput:
        return self.loop.run_until_complete(self.tokenizer_manager.flush_cache())

    def shutdown(self) -> None:
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


def modules() -> dict[str, types.ModuleType]:
    """``sglang``, ``sglang.srt.managers.io_struct`` and ``sglang.srt.utils`` for ``sys.modules``."""
    root, srt, managers = (types.ModuleType(n) for n in ("sglang", "sglang.srt", "sglang.srt.managers"))
    io_struct, utils = types.ModuleType("sglang.srt.managers.io_struct"), types.ModuleType("sglang.srt.utils")
    root.Engine, root.__version__ = Engine, "0.5.23"  # type: ignore[attr-defined]
    root.srt, srt.managers, srt.utils, managers.io_struct = srt, managers, utils, io_struct  # type: ignore[attr-defined]
    for cls in (PauseGenerationReqInput, ContinueGenerationReqInput, UpdateWeightsFromTensorReqInput,
                FlushCacheReqOutput, GenerateReqInput):
        setattr(io_struct, cls.__name__, cls)
    utils.MultiprocessingSerializer = MultiprocessingSerializer  # type: ignore[attr-defined]
    return {m.__name__: m for m in (root, srt, managers, io_struct, utils)}


def shutdown_all() -> None:
    while Engine._built:
        Engine._built.pop().shutdown()
