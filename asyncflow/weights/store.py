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

Weights published in parts (:func:`publish_parts`; a sharded trainer gathers its whole weights
bucket by bucket and hands each on before gathering the next): ``publish_part(version, index,
buffers, total)`` keeps each part of a version aside, and the version becomes visible, whole,
only once all ``total`` parts have arrived (in any order: a remote store may take them out of
order); the last part carries the CRC-32s of every tensor of every part, so the whole set
verifies as if :func:`seal` had sealed it at once.

The store is a plain class; the Ray launcher wraps it in an actor with the same methods.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import zlib
from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import numpy as np

log = logging.getLogger(__name__)
CHECKSUMS = "__crc32__"  # reserved key of a sealed weight set


class WeightTransferError(ValueError):
    """Received weights do not match what the trainer sealed (corrupted or partial)."""


def _crc(t: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(t).view(np.uint8).data)


def seal(buffers: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``buffers`` plus a CRC-32 of every tensor under :data:`CHECKSUMS` (names in sorted order)."""
    crc = np.asarray([_crc(buffers[n]) for n in sorted(buffers)], dtype=np.uint64)
    return {**buffers, CHECKSUMS: crc}


def publish_parts(store: WeightSource, version: int, parts: Iterable[Mapping[str, np.ndarray]]) -> None:
    """Publish ``version`` from ``parts`` (dicts of tensors by name, taken one at a time), sealed as a
    whole: one part is one :meth:`~WeightSource.publish` of it sealed; several are one
    :meth:`~WeightSource.publish_part` each, then a last part of the checksums of them all."""
    it = iter(parts)
    first, second = next(it, None), next(it, None)
    if first is None or second is None:  # (one part: as a whole)
        store.publish(version, seal(first or {}))
        return
    crc: dict[str, int] = {}
    index = 0
    for part in itertools.chain((first, second), it):  # (each part leaves before the next is gathered)
        crc.update((name, _crc(t)) for name, t in part.items())
        store.publish_part(version, index, part)
        index += 1
    store.publish_part(version, index, {CHECKSUMS: np.asarray([crc[n] for n in sorted(crc)], dtype=np.uint64)},
                       total=index + 1)


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
    * the buffers come back as published (a sealed set, :func:`seal`, still verifies); a version
      published in parts comes back as one set, the union of its parts, once every part arrived;
    * ``publish`` may return before the version is visible (a remote store does not wait);
      ``close`` wakes every waiter.
    """

    def publish(self, version: int, buffers: Mapping[str, np.ndarray]) -> bool | None:
        """Keep ``buffers`` as ``version`` if it is newer than every version so far."""

    def publish_part(self, version: int, index: int, buffers: Mapping[str, np.ndarray],
                     total: int | None = None) -> bool | None:
        """Keep part ``index`` of ``version`` aside; ``total`` (given with any part, usually the last):
        how many parts it has. Once all have arrived the version is published whole, as by
        :meth:`publish` (ignored if not newer than every version so far)."""

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
        self._parts: dict[int, dict[int, Mapping[str, np.ndarray]]] = {}  # version -> index -> part
        self._totals: dict[int, int] = {}
        self._closed = False

    def publish(self, version: int, buffers: Mapping[str, np.ndarray]) -> bool:
        """Keep ``buffers`` as the newest version; an older or equal version is ignored
        (publishes may arrive out of order through a concurrent actor)."""
        with self._cond:
            if version <= self._version:
                return False
            self._version, self._buffers = version, dict(buffers)
            self._drop_parts(version)
            self._cond.notify_all()
            return True

    def _drop_parts(self, upto: int) -> None:
        for v in [v for v in self._parts if v <= upto]:
            self._parts.pop(v)
            self._totals.pop(v, None)

    def publish_part(self, version: int, index: int, buffers: Mapping[str, np.ndarray],
                     total: int | None = None) -> bool:
        """Part ``index`` of ``version``; publishes the union once all ``total`` parts are here (and
        drops the parts of that version and older ones); a part of an old version is ignored."""
        with self._cond:
            if version <= self._version:
                return False
            parts = self._parts.setdefault(version, {})
            parts[index] = buffers
            if total is not None:
                self._totals[version] = total
            if len(parts) != self._totals.get(version):
                return False
            whole: dict[str, np.ndarray] = {}
            for i in sorted(parts):
                whole.update(parts[i])
            self._drop_parts(version)
            self._version, self._buffers = version, whole
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
