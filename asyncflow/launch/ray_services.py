"""The services of a Ray job behind their plain-class APIs: the data plane and the weight store.

The roles never see Ray: a :class:`RayDataPlane` has the methods of a data-plane client and
a :class:`RayWeightStore` those of a weight store, each wrapping an actor handle. An error
raised inside the actor (timeout, closed, schema) is re-raised as itself (:func:`ray_get`).
They live here, not in :mod:`asyncflow.dataplane` / :mod:`asyncflow.weights`, because Ray is
imported only under :mod:`asyncflow.launch`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import ray

from asyncflow.dataplane import BatchMeta, DataPlane
from asyncflow.dataplane.core.rules import Data
from asyncflow.dataplane.transport.wire import pack_columns, unpack_columns
from asyncflow.workflow.failure import TRACE, WorkerLost


def ray_get(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get`` that raises what the call raised: the task's own exception (Ray keeps it as
    ``cause``), ``TimeoutError``, or :class:`~asyncflow.workflow.failure.WorkerLost` when the
    actor's process is gone (killed, crashed: ``RayActorError``, ``ActorDiedError``)."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError from None
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else None
        if cause is not None:
            raise cause from None
        err = RuntimeError(_last_line(getattr(e, "traceback_str", "") or str(e)))  # the cause did not unpickle
        setattr(err, TRACE, getattr(e, "traceback_str", None) or str(e))
        raise err from None
    except ray.exceptions.RayActorError as e:  # Ray's few paragraphs: their first sentence
        first = (str(e).strip().splitlines() or [""])[0].split(". ")[0].rstrip(".")
        raise WorkerLost(f"its process died ({first})") from None


def _last_line(text: str) -> str:
    lines = [s.strip() for s in text.strip().splitlines() if s.strip()]
    return lines[-1] if lines else text


class PackedDataPlane(DataPlane):
    """The data-plane actor: a :class:`DataPlane` that takes and returns packed columns
    (:mod:`asyncflow.dataplane.transport.wire`), so each column crosses processes as one buffer."""

    def put_packed(self, packed: Any, **kwargs: Any) -> list[int]:
        return self.put(unpack_columns(packed), **kwargs)

    def get_batch_packed(self, task: str, fields: Sequence[str], n: int, **kwargs: Any) -> tuple[BatchMeta, Any]:
        meta, data = self.get_batch(task, fields, n, **kwargs)
        return meta, pack_columns(data)

    def get_data_packed(self, meta: BatchMeta, fields: Sequence[str] | None = None) -> Any:
        return pack_columns(self.get_data(meta, fields))


class RayDataPlane:
    """Client of a :class:`PackedDataPlane` actor with the :class:`DataPlane` methods.

    ``put_nowait`` sends without waiting; the first error among the sent puts is raised
    by the next call of this client (so nothing fails silently), ``flush`` waits for all.
    Other methods are forwarded as blocking calls.
    """

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._sent: list = []

    def __getstate__(self) -> dict:
        return {"handle": self.handle}  # a copy in another process has sent nothing

    def __setstate__(self, state: dict) -> None:
        self.handle, self._sent = state["handle"], []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or name == "handle":  # unpickling looks these up before __init__
            raise AttributeError(name)
        method = getattr(self.handle, name)

        def call(*a: Any, **kw: Any) -> Any:
            self._check_sent()
            return ray_get(method.remote(*a, **kw))

        return call

    def put(self, data: Mapping[str, Any], partition: Hashable = 0, rows: Sequence[int] | None = None,
            tags: Mapping[str, Sequence[int]] | None = None, timeout: float | None = None) -> list[int]:
        self._check_sent()
        return ray_get(self.handle.put_packed.remote(pack_columns(data), partition=partition, rows=rows,
                                                  tags=tags, timeout=timeout))

    def put_nowait(self, data: Mapping[str, Any], partition: Hashable = 0, rows: Sequence[int] | None = None,
                   tags: Mapping[str, Sequence[int]] | None = None) -> None:
        self._check_sent()
        self._sent.append(self.handle.put_packed.remote(pack_columns(data), partition=partition, rows=rows,
                                                        tags=tags))

    def get_batch(self, task: str, fields: Sequence[str], n: int, **kwargs: Any) -> tuple[BatchMeta, Data]:
        self._check_sent()
        meta, packed = ray_get(self.handle.get_batch_packed.remote(task, fields, n, **kwargs))
        return meta, unpack_columns(packed)

    def get_data(self, meta: BatchMeta, fields: Sequence[str] | None = None) -> Data:
        self._check_sent()
        return unpack_columns(ray_get(self.handle.get_data_packed.remote(meta, fields)))

    def flush(self) -> None:
        refs, self._sent = self._sent, []
        for ref in refs:
            ray_get(ref)

    def _check_sent(self) -> None:
        if self._sent:
            done, self._sent = ray.wait(self._sent, num_returns=len(self._sent), timeout=0)
            for ref in done:
                ray_get(ref)


class RayWeightStore:
    """Client of a weight-store actor.

    ``publish`` puts the buffers into Ray's object store once (host shared memory) and
    hands the store only a reference, without waiting; subscribers read the buffers
    from shared memory, so the store actor never copies or pickles weights.
    """

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def publish(self, version: int, buffers: Mapping[str, np.ndarray]) -> None:
        self.handle.publish.remote(version, {"ref": [ray.put(dict(buffers))]})  # a list: not resolved

    def publish_part(self, version: int, index: int, buffers: Mapping[str, np.ndarray],
                     total: int | None = None) -> None:
        """One part into the object store now (the caller frees its copy at once); the store keeps
        its reference under a key of its own, so the parts' union holds every reference."""
        self.handle.publish_part.remote(version, index, {f"ref.{index}": [ray.put(dict(buffers))]}, total)

    def wait_newer(self, version: int, timeout: float) -> tuple[int, dict] | None:
        got = ray_get(self.handle.wait_newer.remote(version, timeout))
        if got is None:
            return None
        out: dict = {}
        for part in ray_get([refs[0] for _, refs in sorted(got[1].items())]):  # (a whole set, or its parts)
            out.update(part)
        return got[0], out

    def latest_version(self) -> int:
        return ray_get(self.handle.latest_version.remote())

    def close(self) -> None:
        return ray_get(self.handle.close.remote())
