"""A stand-in for vLLM 0.33.0's offline ``vllm.LLM`` that keeps the constraints an RL adapter meets.

Read against the vLLM 0.33.0 wheel (``pip download --no-deps vllm==0.33.0``, unpacked, not
installed); each behaviour names the file it mirrors:

* **A process boundary** (``vllm/v1/engine/core_client.py`` ``SyncMPClient``,
  ``vllm/v1/engine/core.py`` ``EngineCoreProc``): the engine core runs in another process
  (forked, as vLLM forks by default) with its own busy loop, so it keeps generating between
  the client's ``step()`` calls; ``step()`` blocks until an output arrives; a utility call
  (``collective_rpc``, ``reset_prefix_cache``, ``sleep``, ``wake_up``) runs between two
  engine steps and a failure comes back as ``Exception("Call to X method failed: ...")``.
* **Serialisation** (``vllm/v1/serial_utils.py`` ``MsgpackEncoder`` / ``MsgpackDecoder``):
  msgpack; a tensor or array travels as ``(dtype, shape, data)`` (inline under 256 bytes,
  else an index into side buffers); anything else, a function included, is a ``TypeError``
  unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (then pickle / cloudpickle). The engine
  core decodes utility arguments without a type, so a tensor arrives as a ``[dtype, shape,
  data]`` list, never a tensor.
* **Prefix cache** (``vllm/v1/core/sched/scheduler.py`` ``reset_prefix_cache``,
  ``vllm/v1/core/block_pool.py``): full blocks stay cached after a request ends; a reset
  while requests hold blocks is refused (returns ``False``) unless
  ``reset_running_requests=True``, which preempts them (their KV is recomputed from their
  tokens when they run again).
* **Pause** (``vllm/v1/engine/core.py`` ``sleep`` / ``pause_scheduler`` / ``wake_up``):
  ``sleep(level=0, mode="keep")`` stops scheduling and keeps the requests;
  ``wake_up(tags=["scheduling"])`` resumes.
* **Weights** (``vllm/v1/worker/gpu_worker.py`` ``Worker.reload_weights`` ->
  ``vllm/model_executor/model_loader/reload/inplace.py`` and ``default_loader.py``): a
  worker method called by name; ``weights_path`` is a folder whose ``*.safetensors`` files
  are loaded through the model's ``load_weights``.
* **Outputs** (``vllm/outputs.py``, ``vllm/logprobs.py``): ``RequestOutput`` with one
  cumulative ``CompletionOutput`` whose ``logprobs`` are ``{token: Logprob}`` per position;
  request ids are the caller's (``vllm/v1/engine/input_processor.py`` adds a random suffix
  internally; ``abort_request`` takes the caller's ids).

The model is the tiny Hugging Face model of the folder given as ``model``, decoding with
a real KV cache (``tests/fake_llm_core.py``). Test-only knobs (``LLM(..., fake_knobs={...})``):
``"reset": "refuse"`` makes ``reset_prefix_cache`` return ``False`` (as a KV connector
that refuses would); ``"hold": n`` stops every request after ``n`` tokens until the first
weight reload (a slow engine frozen mid-answer, so a test's swap always meets live requests);
``"first_batch": n`` makes the first engine step wait until ``n`` requests have arrived
(the client adds them one message at a time; a contract test expects one step to give each
of them a token).
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import pickle
import queue
import threading
import types
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
from fake_llm_core import PrefixDecoder, Seq, load_named, request_seed

RAW_VIEW, PICKLE, CLOUDPICKLE = 3, 1, 2  # vllm/v1/serial_utils.py CUSTOM_TYPE_*
THRESHOLD = 256  # VLLM_MSGPACK_ZERO_COPY_THRESHOLD
DEADLINE_S = 120.0  # the real client waits forever; the fake fails a test instead of hanging it


def _insecure() -> bool:
    return os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "0") == "1"


# --------------------------------------------------------------------------- serial_utils


class Encoder:
    """``MsgpackEncoder``: tensors and arrays as (dtype, shape, data), the rest refused."""

    def encode(self, obj: Any) -> list[bytes]:
        self.aux: list[bytes] = [b""]
        self.aux[0] = msgpack.packb(obj, default=self._hook, use_bin_type=True)
        return self.aux

    def _data(self, raw: bytes) -> Any:
        if len(raw) < THRESHOLD:
            return msgpack.ExtType(RAW_VIEW, raw)
        self.aux.append(raw)
        return len(self.aux) - 1

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            raw = obj.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            return [str(obj.dtype).removeprefix("torch."), list(obj.shape), self._data(raw)]
        if isinstance(obj, np.ndarray) and obj.dtype.kind not in ("O", "V"):
            return [obj.dtype.str, list(obj.shape), self._data(np.ascontiguousarray(obj).tobytes())]
        if not _insecure():
            raise TypeError(f"Object of type {type(obj)} is not serializableSet VLLM_ALLOW_INSECURE_SERIALIZATION=1 "
                            f"to allow fallback to pickle-based serialization.")
        if isinstance(obj, types.FunctionType):
            from ray import cloudpickle  # (vLLM's cloudpickle; Ray's copy: a dependency here)

            return msgpack.ExtType(CLOUDPICKLE, cloudpickle.dumps(obj))
        return msgpack.ExtType(PICKLE, pickle.dumps(obj))


def decode(frames: list[bytes]) -> Any:
    """``MsgpackDecoder`` without a type (how the engine core reads utility arguments)."""

    def ext(code: int, data: bytes) -> Any:
        if code == RAW_VIEW:
            return data
        if _insecure() and code in (PICKLE, CLOUDPICKLE):
            return pickle.loads(data)  # cloudpickle output loads with pickle
        raise NotImplementedError(f"Extension type code {code} is not supported")

    return msgpack.unpackb(frames[0], ext_hook=ext, raw=False, strict_map_key=False)


def _send(conn: Any, obj: Any) -> None:
    conn.send_bytes(msgpack.packb(Encoder().encode(obj), use_bin_type=True))


def _recv(conn: Any) -> Any:
    return decode(msgpack.unpackb(conn.recv_bytes(), raw=False))


# --------------------------------------------------------------------------- outputs (vllm/outputs.py)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool


@dataclass
class SamplingParams:
    """``vllm.SamplingParams`` (the fields the adapters use; others are refused)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    detokenize: bool = True


# --------------------------------------------------------------------------- the engine core (other process)


class _Worker:
    """``vllm/v1/worker/gpu_worker.py`` ``Worker``: the model runner and ``reload_weights``."""

    def __init__(self, model: torch.nn.Module, model_path: str):
        self.model_path = model_path
        self.model_runner = types.SimpleNamespace(model=_VllmModel(model))
        self.loads = 0

    def reload_weights(self, weights_iterator: Any = None, weights_path: str | None = None,
                       is_checkpoint_format: bool = True) -> None:
        from safetensors.torch import load_file

        if weights_iterator is None:  # model_loader/reload/inplace.py -> DefaultModelLoader.get_all_weights
            path = weights_path if weights_path is not None else self.model_path
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not os.path.isdir(path) or not files:
                raise RuntimeError(f"Cannot find any model weights with `{path}`")
            self.model_path = path  # (vLLM points model_config.model at it)
            weights_iterator = (item for f in files for item in load_file(f).items())
        self.model_runner.model.load_weights(weights_iterator)
        self.loads += 1


class _VllmModel:
    """A vLLM model's ``load_weights`` / ``parameters`` over the Hugging Face model."""

    def __init__(self, hf: torch.nn.Module):
        self.hf = hf

    def parameters(self) -> Any:
        return self.hf.parameters()

    def load_weights(self, weights: Any) -> set[str]:
        return load_named(self.hf, weights)


class _Core:
    """``EngineCoreProc`` + ``Scheduler`` + one worker, in the engine-core process."""

    def __init__(self, model_path: str, config: dict):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.decoder = PrefixDecoder(model, int(model.config.eos_token_id))
        self.worker = _Worker(model, model_path)
        self.max_seqs, self.seed, self.knobs = config["max_num_seqs"], config["seed"], config["knobs"]
        self.reqs: dict[str, Seq] = {}
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.paused = False
        self.stepped = False

    def _held(self, seq: Seq) -> bool:
        return "hold" in self.knobs and not self.worker.loads and seq.n_out >= self.knobs["hold"]

    def has_work(self) -> bool:
        if self.paused or (not self.stepped and len(self.reqs) < self.knobs.get("first_batch", 0)):
            return False
        return bool(self.waiting and len(self.running) < self.max_seqs) or any(not self._held(s) for s in self.running)

    def add(self, req: dict) -> None:
        p = req["params"]
        if p["top_p"] != 1.0:
            raise NotImplementedError("the fake samples with top_p = 1 only")
        seq = Seq(req["id"], list(req["prompt"]), len(req["prompt"]), p["max_tokens"], p["min_tokens"],
                  p["temperature"], request_seed(p["seed"] if p["seed"] is not None else self.seed, req["id"]))
        self.reqs[seq.rid] = seq
        self.waiting.append(seq)

    def _free(self, seq: Seq) -> None:
        self.reqs.pop(seq.rid, None)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.drop_kv()  # its blocks are freed (their hashes stay in the prefix cache)

    def abort(self, ids: list[str]) -> None:
        for rid in ids:
            if rid in self.reqs:
                self._free(self.reqs[rid])

    def step(self) -> list[list]:
        self.stepped = True
        while self.waiting and len(self.running) < self.max_seqs:
            self.running.append(self.waiting.popleft())
        outs = []
        for seq in [s for s in self.running if not self._held(s)]:
            tok, lp = self.decoder.next_token(seq)
            reason = self.decoder.finish_reason(seq)
            outs.append([seq.rid, [tok], [lp], reason])
            if reason:
                self._free(seq)
        return outs

    # ---- utility methods (called by name from the client)
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        if reset_running_requests:  # preempt: back to waiting, KV freed, recomputed from the tokens later
            for seq in reversed(self.running):
                seq.drop_kv()
                self.waiting.appendleft(seq)
            self.running.clear()
        if self.running:  # block_pool.reset_prefix_cache: "some blocks are not freed yet"
            return False
        if self.knobs.get("reset") == "refuse":
            return False
        self.decoder.clear()
        return True

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if level != 0 or mode != "keep":
            raise NotImplementedError(f"the fake implements sleep(level=0, mode='keep') only, not ({level}, {mode!r})")
        self.paused = True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        if tags is None or "scheduling" in tags:
            self.paused = False
        return True

    def collective_rpc(self, method: Any, timeout: float | None = None, args: Any = (), kwargs: Any = None) -> list:
        if isinstance(method, str):
            if not hasattr(self.worker, method):
                raise NotImplementedError(f"Method {method!r} is not implemented.")
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]
        return [method(self.worker, *args, **(kwargs or {}))]  # a function (only with insecure serialisation)


UTILITIES = ("reset_prefix_cache", "sleep", "wake_up", "collective_rpc")


def _core_main(model_path: str, config: dict, conn_in: Any, conn_out: Any) -> None:
    torch.set_num_threads(1)
    core = _Core(model_path, config)
    _send(conn_out, ["READY"])
    while True:
        timeout = 0.0 if core.has_work() else 0.05
        try:
            while conn_in.poll(timeout):
                msg = _recv(conn_in)
                timeout = 0.0
                if msg[0] == "SHUTDOWN":
                    return
                _handle(core, msg, conn_out)
        except (EOFError, OSError):  # the client is gone
            return
        except Exception as e:  # a message it cannot decode is fatal to the real engine core too
            _send(conn_out, ["DEAD", f"EngineCore encountered a fatal error: {type(e).__name__}: {e}"])
            return
        if core.has_work():
            outs = core.step()
            if outs:
                _send(conn_out, ["OUT", outs])


def _handle(core: _Core, msg: list, conn_out: Any) -> None:
    if msg[0] == "ADD":
        core.add(msg[1])
    elif msg[0] == "ABORT":
        core.abort(msg[1])
    elif msg[0] == "UTILITY":
        _, call_id, method, args = msg
        try:
            if method not in UTILITIES:
                raise AttributeError(f"'EngineCoreProc' object has no attribute {method!r}")
            _send(conn_out, ["UTIL", call_id, True, getattr(core, method)(*args)])
        except Exception as e:  # the real core reports every failure to the caller
            _send(conn_out, ["UTIL", call_id, False, f"Call to {method} method failed: {e}"])


# --------------------------------------------------------------------------- the client (the caller's process)


class _EngineCoreClient:
    """``SyncMPClient``: sends inputs, a reader thread sorts outputs from utility replies."""

    def __init__(self, model_path: str, config: dict):
        ctx = mp.get_context("fork")
        core_in, self._to_core = ctx.Pipe(duplex=False)
        self._from_core, core_out = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_core_main, args=(model_path, config, core_in, core_out), daemon=True,
                                name="fake-vllm-EngineCore")
        self.proc.start()
        core_in.close()
        core_out.close()
        if not self._from_core.poll(DEADLINE_S) or _recv(self._from_core)[0] != "READY":
            raise RuntimeError("fake vLLM: the engine core did not start")
        self.outputs: queue.Queue = queue.Queue()
        self.utility: dict[int, Future] = {}
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="fake-vllm-output-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                msg = _recv(self._from_core)
                if msg[0] == "OUT":
                    self.outputs.put(msg[1])
                elif msg[0] == "DEAD":
                    raise EOFError(msg[1])
                else:
                    _, call_id, ok, value = msg
                    fut = self.utility.pop(call_id)
                    fut.set_result(value) if ok else fut.set_exception(Exception(value))
        except (EOFError, OSError) as e:
            dead = RuntimeError(f"fake vLLM: the engine core died ({e or 'its pipe closed'})")
            self.outputs.put(dead)
            for fut in list(self.utility.values()):
                fut.set_exception(dead)

    def send(self, msg: list) -> None:
        frames = Encoder().encode(msg)  # a TypeError here is the client's, before anything is sent
        with self._send_lock:
            self._to_core.send_bytes(msgpack.packb(frames, use_bin_type=True))

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = uuid.uuid1().int >> 64
        fut: Future = Future()
        self.utility[call_id] = fut
        try:
            self.send(["UTILITY", call_id, method, list(args)])
        except Exception:
            self.utility.pop(call_id, None)
            raise
        return fut.result(timeout=DEADLINE_S)

    def get_output(self) -> list:
        try:
            out = self.outputs.get(timeout=DEADLINE_S)
        except queue.Empty:
            raise TimeoutError(f"fake vLLM: step() blocked {DEADLINE_S:.0f} s for an output (the real one blocks "
                               f"forever)") from None
        if isinstance(out, Exception):
            raise out
        return out

    def shutdown(self) -> None:
        if self.proc.is_alive():
            try:
                self.send(["SHUTDOWN"])
            except OSError:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)


@dataclass
class _State:
    """``vllm/v1/engine/output_processor.py`` ``RequestState`` (cumulative output)."""

    external: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    want_logprobs: bool = False


class LLMEngine:
    """``vllm/v1/engine/llm_engine.py`` ``LLMEngine`` over the engine-core process."""

    def __init__(self, model_path: str, config: dict):
        self.engine_core = _EngineCoreClient(model_path, config)
        self.states: dict[str, _State] = {}  # internal id -> state
        self.external: dict[str, list[str]] = {}
        self.threads: set[int] = set()  # every thread that called this engine
        self._busy = threading.Lock()

    def _enter(self) -> None:
        self.threads.add(threading.get_ident())
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("fake vLLM: LLMEngine used from two threads at once (its sockets are not thread-safe)")
        self._busy.release()

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> str:
        self._enter()
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        internal = f"{request_id}-{uuid.uuid4().hex[:8]}"  # input_processor.assign_request_id
        ids = list(prompt["prompt_token_ids"])
        self.states[internal] = _State(request_id, ids, want_logprobs=params.logprobs is not None)
        self.external.setdefault(request_id, []).append(internal)
        self.engine_core.send(["ADD", {"id": internal, "prompt": ids, "params": asdict(params)}])
        return request_id

    def step(self) -> list[RequestOutput]:
        self._enter()
        outs = []
        for internal, toks, lps, reason in self.engine_core.get_output():
            st = self.states.get(internal)
            if st is None:  # aborted: its late outputs are dropped
                continue
            st.tokens += toks
            if st.want_logprobs:
                st.logprobs += [{t: Logprob(lp, rank=1)} for t, lp in zip(toks, lps)]
            if reason:
                self._forget(internal)
            comp = CompletionOutput(0, "", list(st.tokens), None, list(st.logprobs) if st.want_logprobs else None,
                                    reason, None)
            outs.append(RequestOutput(st.external, None, st.prompt, None, [comp], reason is not None))
        return outs

    def _forget(self, internal: str) -> None:
        st = self.states.pop(internal)
        ids = self.external.get(st.external, [])
        if internal in ids:
            ids.remove(internal)
        if not ids:
            self.external.pop(st.external, None)

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        self._enter()
        gone = [i for rid in request_ids for i in list(self.external.get(rid, []))]
        for i in gone:
            self._forget(i)
        if gone:
            self.engine_core.send(["ABORT", gone])

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.states)

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        self._enter()
        return self.engine_core.call_utility("collective_rpc", method, timeout, args, kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self._enter()
        return self.engine_core.call_utility("reset_prefix_cache", reset_running_requests, reset_connector)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self._enter()
        self.engine_core.call_utility("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self._enter()
        return self.engine_core.call_utility("wake_up", tags)


LLM_ARGS = {"dtype", "seed", "max_num_seqs", "gpu_memory_utilization", "logprobs_mode", "enable_prefix_caching",
            "tensor_parallel_size", "max_model_len", "enforce_eager", "weight_transfer_config", "worker_extension_cls"}
LOGPROBS_MODES = ("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs")


class LLM:
    """``vllm/entrypoints/llm.py`` ``LLM`` (the calls an RL adapter makes)."""

    _built: list[LLM] = []

    def __init__(self, model: str, fake_knobs: dict | None = None, **kwargs: Any):
        unknown = set(kwargs) - LLM_ARGS
        if unknown:  # EngineArgs(**kwargs)
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        if kwargs.get("logprobs_mode", "raw_logprobs") not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}")
        self.kwargs = kwargs
        config = {"max_num_seqs": kwargs.get("max_num_seqs") or 256, "seed": kwargs.get("seed", 0),
                  "knobs": dict(fake_knobs or {})}
        self.llm_engine = LLMEngine(model, config)
        LLM._built.append(self)

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.llm_engine.sleep(level=level, mode=mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return self.llm_engine.wake_up(tags)


def module() -> types.ModuleType:
    """A ``vllm`` module for ``sys.modules`` (``LLM``, ``SamplingParams``, the output types)."""
    mod = types.ModuleType("vllm")
    mod.__version__ = "0.33.0"  # type: ignore[attr-defined]
    for obj in (LLM, SamplingParams, RequestOutput, CompletionOutput, Logprob):
        setattr(mod, obj.__name__, obj)
    return mod


def shutdown_all() -> None:
    while LLM._built:
        LLM._built.pop().llm_engine.engine_core.shutdown()

