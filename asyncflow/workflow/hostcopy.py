"""A checkpoint's host copy, taken beside the next step instead of at the step boundary.

At a step boundary the trainer's worker, on its compute thread right after the step
(:meth:`Worker.train_step <asyncflow.workflow.worker.Worker.train_step>` asked to), splits the
snapshot (:func:`~asyncflow.workflow.role_state.snapshot_parts`): what is small (RNG states,
versions, the LR schedule's position, AdamW's param groups) is copied at once, and the live
tensors (the weights, AdamW's moments and step counts) are only referenced. A
:class:`HostCopy` copies those to host memory on its own thread while the next step fetches
its rows, runs forward and backward; the pause at the boundary is only the small part.

Invariant: nothing changes a referenced tensor before it is copied. Every engine the
snapshot reads defers its next in-place update of the weights or AdamW's state
(``TrainEngine.defer_updates``): ``optimizer_step`` waits for the copy first (its wait is
the step's ``checkpoint_wait_s``; forward and backward only write gradients, which a
snapshot does not hold). So the snapshot is bitwise the state at the boundary
(tests/test_checkpoint.py compares it with a blocking one, the copy slowed down on
purpose). On CUDA the copy runs on its own stream, after the work queued before the
boundary (an event recorded then). An engine without ``defer_updates`` is copied at once.

:meth:`HostCopy.result` (the driver's checkpoint writer asks for it, never the compute
thread) waits for the copy, within its deadline, and raises the copy's error, if any.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from asyncflow.workflow.checkpoint import Snapshot, host_all


class HostCopy:
    """The host copy of ``live`` (tensors by reference) completing ``snap`` (module doc)."""

    def __init__(self, live: dict[str, torch.Tensor], snap: Snapshot, engines: list[Any], timeout: float):
        self.snap, self.timeout = snap, timeout
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.copy_s = 0.0
        self._copied: dict[str, np.ndarray] = {}
        if not live or not all(hasattr(e, "defer_updates") for e in engines):
            self._copy(live, None)  # (nothing to copy, or an engine that could not wait for it)
            return
        event = None
        if any(t.is_cuda for t in live.values()):  # the copy's stream starts after the work queued so far
            event = torch.cuda.Event()
            event.record()
        for engine in engines:
            engine.defer_updates(self.done, timeout)
        threading.Thread(target=self._copy, args=(live, event), name="checkpoint-copy", daemon=True).start()

    def _copy(self, live: dict[str, torch.Tensor], event: Any) -> None:
        t = time.perf_counter()
        try:
            if event is None:
                self._copied = host_all(live)
            else:
                stream = torch.cuda.Stream()
                stream.wait_event(event)
                with torch.cuda.stream(stream):
                    self._copied = host_all(live)  # (a copy to pageable memory: synchronous)
        except BaseException as e:  # (raised by result(); the engines' wait ends either way)
            self.error = e
        finally:
            self.copy_s = time.perf_counter() - t
            self.done.set()

    def result(self, timeout: float | None = None) -> Snapshot:
        """The whole snapshot once copied (raises the copy's error, or ``TimeoutError``)."""
        timeout = self.timeout if timeout is None else timeout
        if not self.done.wait(timeout):
            raise TimeoutError(f"the checkpoint's host copy did not finish within {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        tensors, meta = self.snap
        return {**tensors, **self._copied}, meta
