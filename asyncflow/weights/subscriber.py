"""The rollout side of the delayed parameter update: :class:`WeightSubscriber`.

A background thread waits on a :class:`~asyncflow.weights.store.WeightSource` for a newer
version, copies it into host memory beside the worker and verifies it (``staged``); the
worker swaps it in at its own micro-batch boundary (:meth:`WeightSubscriber.swap_if_ready`),
so only that local copy is exposed to generation. A corrupted or partial set is rejected
(logged, counted in ``rejected``) and the weights in use stay. ``prepare`` (optional) turns a
verified set into what ``apply`` takes, on the background thread too, so work that needs no
change to the model (LoRA: merging adapters into copies of the base's weights,
:mod:`asyncflow.engines.lora_merge`) stays off the swap.

Invariants (``tests/test_contracts_weights.py``, over every
:class:`~asyncflow.weights.store.WeightSource`):

* ``apply`` runs only inside :meth:`WeightSubscriber.swap_if_ready`, on the caller's
  thread, with a verified set (checksum entry removed; passed through ``prepare`` if given)
  of a version newer than ``version``;
* ``staged_version()`` is the version the next swap would apply (``version`` if none);
  ``version`` only grows, and ``swaps`` counts the applied versions;
* a set that fails :func:`~asyncflow.weights.store.verify`, or that ``prepare`` refuses (raises
  ``ValueError``), is never staged: it is counted in ``rejected`` and a later good version is
  staged as usual.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from asyncflow.weights.store import WeightSource, WeightTransferError, verify

log = logging.getLogger(__name__)


class WeightSubscriber:
    """Prefetches new versions in the background; swaps at the caller's boundary."""

    def __init__(self, source: WeightSource, apply: Callable[[int, Any], None],
                 start_version: int = 0, poll_s: float = 0.5,
                 prepare: Callable[[Mapping[str, np.ndarray]], Any] | None = None):
        self._source, self._apply, self._prepare = source, apply, prepare
        self._lock = threading.Lock()
        self._staged: tuple[int, Any] | None = None  # (version, the verified set or what prepare made of it)
        self.version = start_version  # the version the worker runs now
        self._seen = start_version
        self._stop = threading.Event()
        self._new = threading.Event()
        self.swap_seconds = 0.0  # exposed cost: local copies into the model
        self.swaps = 0
        self.rejected = 0  # versions that failed verification
        self._poll_s = poll_s
        self.bell: threading.Event | None = None  # also rung when a version is staged (a waiter elsewhere)
        self._thread = threading.Thread(target=self._run, name="weight-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            got = self._source.wait_newer(self._seen, self._poll_s)
            if got is None:
                continue
            version, buffers = got
            staged: Any = {k: np.array(v, copy=True) for k, v in buffers.items()}  # host copy, off the hot path
            try:
                staged = verify(staged)  # checked on the local copy: what will be swapped in
                if self._prepare is not None:
                    staged = self._prepare(staged)
            except (WeightTransferError, ValueError) as e:
                self.rejected += 1
                self._seen = version  # skip it; the weights in use stay, the next version may pass
                log.error("rejected weight version %d: %s; keeping version %d", version, e, self.version)
                continue
            with self._lock:
                self._staged = (version, staged)
                self._seen = version
            self._new.set()
            if self.bell is not None:
                self.bell.set()

    def staged_version(self) -> int:
        with self._lock:
            return self._staged[0] if self._staged else self.version

    def swap_if_ready(self) -> bool:
        """Apply the newest staged version, if any. Returns True if the weights changed."""
        with self._lock:
            staged, self._staged = self._staged, None
            self._new.clear()
        if staged is None or staged[0] <= self.version:
            return False
        t = time.perf_counter()
        self._apply(*staged)
        self.swap_seconds += time.perf_counter() - t
        self.swaps += 1
        self.version = staged[0]
        return True

    def wait_staged(self, timeout: float) -> bool:
        """Block until a newer version is staged (or timeout)."""
        return self._new.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._poll_s + 1)
