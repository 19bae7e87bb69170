"""What the simulated job does besides rollout and training: evaluations and checkpoints.

* **Evaluations** every ``Workload.eval_every`` steps (not after the last: the final one is
  outside the measured window, as in the driver). Beside training (``eval_beside``: stream/async
  with ``train.eval_overlap``) the driver's evaluator thread computes ``cost.eval_s(1)`` at
  nice 19: it gets a core only when the roles leave one free (with ``cores`` shared: fewer busy
  threads than cores; it never stretches a role), a due one is skipped while one runs, and
  nothing waits for it (its span is on the ``evaluator`` track, as in a real trace). Otherwise
  the trainer pauses for it: the next step is queued once ``cost.eval_s(threads)`` of the
  trainer's work is done (not a span: the real one runs outside the roles' sections).
* **Checkpoints** every ``save_every`` steps and after the last (``checkpoint_last``):
  ``cost.checkpoint_s()`` = ``(pause, copy, write)``: the trainer's pause at the step boundary
  (before the step's result returns), then the host copy of the weights and AdamW's state on a
  thread of its own beside the next step, whose optimizer step waits for it, then the
  driver's writer serialising it; both on the ``checkpoint`` track and the shared cores.

Each event is counted in ``SimResult.counts`` (``eval_beside``, ``eval_skipped``, ``eval_pause``,
``checkpoint``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncflow.planner.sim import _Job


class Extras:
    def __init__(self, job: _Job):
        self.job = job
        self.copying = False  # a checkpoint's host copy runs (the next optimizer step waits for it)
        self.evaluating = False

    def eval_due(self, v: int) -> bool:
        wl = self.job.wl
        return wl.eval_every > 0 and (v + 1) % wl.eval_every == 0 and v + 1 < wl.steps

    def ckpt_due(self, v: int) -> bool:
        wl = self.job.wl
        return (wl.save_every > 0 and (v + 1) % wl.save_every == 0) or (wl.checkpoint_last and v + 1 == wl.steps)

    def after_step(self, v: int, role: str, threads: int) -> Iterator:
        """The trainer's step ``v`` is done: a due checkpoint's pause (the step returns after it)."""
        if not self.ckpt_due(v):
            return
        job = self.job
        pause, copy, write = job.cost.checkpoint_s()
        job.counts["checkpoint"] += 1
        if pause > 0:
            yield pause
        self.copying = True
        job.env.process(self._copy(copy, write))

    def _copy(self, copy: float, write: float) -> Iterator:
        job = self.job
        yield from job.work("checkpoint", "copy", copy, 1)
        self.copying = False
        job.changed.fire()
        yield from job.work("checkpoint", "write", write, 1)

    def wait_copy(self) -> Iterator:
        """Before an optimizer step: the last checkpoint's host copy must be done."""
        while self.copying:
            yield self.job.changed

    def pause(self, v: int, role: str, threads: int) -> Iterator:
        """After step ``v`` returned: a due evaluation, beside training or pausing the trainer."""
        if not self.eval_due(v):
            return
        job = self.job
        if job.wl.eval_beside:
            if self.evaluating:
                job.counts["eval_skipped"] += 1
                return
            self.evaluating = True
            job.counts["eval_beside"] += 1
            job.env.process(self._beside(job.cost.eval_s(1)))
            return
        job.counts["eval_pause"] += 1
        yield from job.work(role, "eval", job.cost.eval_s(threads), threads, span=False)

    def _beside(self, seconds: float) -> Iterator:
        """The evaluator at nice 19: it computes only while the roles leave a core free."""
        job = self.job
        from asyncflow.planner.sim import QUANTUM_S  # (the same quantum as the roles' sharing)

        start, left = job.env.now, seconds
        while left > 1e-12:
            if job.cores and sum(job.busy_threads.values()) >= job.cores:
                yield QUANTUM_S  # (starved: the roles have every core)
                continue
            piece = min(left, QUANTUM_S)
            left -= piece
            yield piece
        job.spans.append(("evaluator", "eval", start, job.env.now - start))
        self.evaluating = False
