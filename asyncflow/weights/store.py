"""Host-memory weight store and the delayed parameter update.

The trainer *publishes* version ``v`` as a dict of numpy buffers and returns at once.
Each rollout worker owns a :class:`WeightSubscriber`: a background thread that waits for a
newer version, copies it into host memory next to the worker (``staged``), and leaves it
there. The worker calls :meth:`WeightSubscriber.swap_if_ready` at its own micro-batch
boundary; only that local copy into the model is exposed to generation.

Invariants
----------
* Versions only grow: a store never serves an older version than it served before.
* A staged version is complete (all buffers copied) before ``swap_if_ready`` can see it.
* ``wait_newer(v)`` returns the newest version once it is ``> v``, or ``None`` on timeout/close.
* Weights travel *sealed* (:func:`seal`: a CRC-32 per tensor); a subscriber verifies its
  local copy before staging it, and a corrupted or partial set is rejected (logged and
  counted in ``rejected``) while the weights in use stay.

The store is a plain class; the Ray launcher wraps it in an actor with the same methods.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np

log = logging.getLogger(__name__)
CHECKSUMS = "__crc32__"  # reserved key of a sealed weight set


class WeightTransferError(ValueError):
    """Received weights do not match what the trainer sealed (corrupted or partial)."""


def seal(buffers: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``buffers`` plus a CRC-32 of every tensor under :data:`CHECKSUMS` (names in sorted order)."""
    names = sorted(buffers)
    crc = np.asarray([zlib.crc32(np.ascontiguousarray(buffers[n]).view(np.uint8).data) for n in names], dtype=np.uint64)
    return {**buffers, CHECKSUMS: crc}


def verify(buffers: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors of a sealed set, after checking that none is missing, extra or changed.

    Raises :class:`WeightTransferError` naming the first bad tensor.
    """
    if CHECKSUMS not in buffers:
        raise WeightTransferError("weights arrived without checksums (publish seal(weights))")
    tensors = {k: v for k, v in buffers.items() if k != CHECKSUMS}
    expected = buffers[CHECKSUMS]
    if len(expected) != len(tensors):
        raise WeightTransferError(f"partial weights: {len(tensors)} tensors arrived, {len(expected)} were sealed")
    for name, crc in zip(sorted(tensors), expected.tolist()):
        if zlib.crc32(np.ascontiguousarray(tensors[name]).view(np.uint8).data) != crc:
            raise WeightTransferError(f"weights corrupted in transfer: tensor '{name}' fails its CRC-32")
    return tensors


@runtime_checkable
class WeightSource(Protocol):
    """A weight store: what the trainer publishes to and a :class:`~asyncflow.weights.subscriber.WeightSubscriber`
    waits on. Implementations: :class:`WeightStore` (in process) and
    ``asyncflow.launch.ray_services.RayWeightStore`` (an actor holding one); one contract
    test (``tests/test_contracts_weights.py``) runs against each.

    Invariants:

    * versions only grow: a publish of a version ``<=`` the newest is ignored, and
      ``latest_version`` (``-1`` before any publish) never goes down;
    * ``wait_newer(v, timeout)`` returns ``(version, buffers)`` of the newest version once it
      is ``> v`` (at once if it already is), or ``None`` when ``timeout`` passes or the store
      is closed first;
    * the buffers come back as published (a sealed set, :func:`seal`, still verifies);
    * ``publish`` may return before the version is visible (a remote store does not wait);
      ``close`` wakes every waiter.
    """

    def publish(self, version: int, buffers: Mapping[str, np.ndarray]) -> bool | None:
        """Keep ``buffers`` as ``version`` if it is newer than every version so far."""

    def wait_newer(self, version: int, timeout: float) -> tuple[int, dict] | None:
        """The newest ``(version, buffers)`` once newer than ``version``; ``None`` on timeout or close."""

    def latest_version(self) -> int:
        """The newest version published (``-1``: none)."""

    def close(self) -> None:
        """Wake every waiter (they get ``None``); later waits return ``None`` at once."""


class WeightStore:
    """Keeps the newest published weights (one version; older ones are dropped)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = -1
        self._buffers: dict[str, np.ndarray] = {}
        self._closed = False

    def publish(self, version: int, buffers: Mapping[str, np.ndarray]) -> bool:
        """Keep ``buffers`` as the newest version; an older or equal version is ignored
        (publishes may arrive out of order through a concurrent actor)."""
        with self._cond:
            if version <= self._version:
                return False
            self._version, self._buffers = version, dict(buffers)
            self._cond.notify_all()
            return True

    def latest_version(self) -> int:
        with self._cond:
            return self._version

    def wait_newer(self, version: int, timeout: float) -> tuple[int, dict] | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._version <= version and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            if self._version <= version:
                return None
            return self._version, self._buffers

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
