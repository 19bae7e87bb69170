"""The driver's watchdog: every call to a worker has a deadline, and a stalled step is named.

* :meth:`Watchdog.ask` calls a worker and waits at most ``timeout`` seconds: a worker that
  does not answer, or whose process is gone (the launcher raises
  :class:`~asyncflow.workflow.failure.WorkerLost`), becomes one ``WorkerLost`` naming it
  and the call; any other error is tagged with the worker's name (unless the worker
  tagged it already, :func:`~asyncflow.workflow.failure.tag`).
* :meth:`Watchdog.beat` (the job calls it every ~2 s while it waits for a step) asks every
  worker for its heartbeat (``Worker.health``: raises a failed role's error; else per role
  ``items`` done and ``stuck_s``, the seconds it has spent in its current poll). A dead or
  silent worker is found within ``HEALTH_TIMEOUT_S``. When no role's ``items`` moved and no
  step finished for ``train.step_timeout_s``, the step is stalled: :class:`StepStalled`
  names the role stuck longest in one call (or says every role was waiting) and the step;
  every worker's thread stacks (``Worker.stacks``, or why there are none) ride on it for
  ``error.log``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from asyncflow.workflow.failure import CAUSE, STACKS, WHERE, DeadlineMissed, StepStalled, WorkerLost, tag

HEALTH_TIMEOUT_S = 10.0  # a worker that does not answer a heartbeat (or a stop) within this is lost
STACKS_TIMEOUT_S = 5.0


class Watchdog:
    def __init__(self, launcher: Any, workers: dict[str, Any], step_timeout_s: float):
        self.launcher, self.workers, self.step_timeout_s = launcher, workers, step_timeout_s
        self.what = "starting"
        self._items: int | None = None
        self._since = time.monotonic()

    def ask(self, name: str, method: str, *args: Any, timeout: float | None = None) -> Any:
        """``workers[name].method(*args)``, waiting at most ``timeout`` (default: the step timeout)."""
        timeout = self.step_timeout_s if timeout is None else timeout
        try:
            return self.launcher.result(self.launcher.submit(self.workers[name], method, *args), timeout)
        except Exception as e:
            raise self.blame(name, e, method, timeout) from None

    def wait_built(self, limit: float) -> None:
        """Wait for every worker's build up to ``limit`` seconds (``train.build_timeout_s``): a build
        is not a stall, so one slower than the step timeout (a loaded machine) says so in one line and
        goes on; a worker whose process dies while building fails at once (the launcher's result)."""
        t0, told = time.monotonic(), False
        futs = {name: self.launcher.submit(w, "health") for name, w in self.workers.items()}
        for name, fut in futs.items():
            while True:
                left = limit - (time.monotonic() - t0)
                try:
                    self.launcher.result(fut, max(0.0, min(left, self.step_timeout_s)))
                    break
                except TimeoutError as e:
                    if left <= self.step_timeout_s:
                        raise self.blame(name, e, "health", limit) from None
                    if not told:
                        told = True
                        print(f"asyncflow: building the workers takes longer than train.step_timeout_s = "
                              f"{self.step_timeout_s:g} s (a loaded machine?); waiting up to train.build_timeout_s "
                              f"= {limit:g} s", file=sys.stderr, flush=True)
                except Exception as e:
                    raise self.blame(name, e, "health") from None

    def blame(self, name: str, e: Exception, method: str | None = None, timeout: float | None = None) -> Exception:
        """``e`` (raised by a call of ``method`` on worker ``name``) as the error to report."""
        during = f"{method}(), {self.what}" if method else self.what
        if isinstance(e, TimeoutError):
            return DeadlineMissed(f"worker '{name}' did not answer within {timeout:.0f} s ({during})")
        if isinstance(e, WorkerLost) and getattr(e, WHERE, None) is None:
            return tag(WorkerLost(f"worker '{name}' was lost ({during}): {e}"), f"worker '{name}'")
        return self._name_servers(tag(e, f"worker '{name}'"))

    def _name_servers(self, e: Exception) -> Exception:
        """Say which data-plane process an address in ``e``'s cause is (the launcher's ``plane_names``)."""
        cause, names = getattr(e, CAUSE, None), getattr(self.launcher, "plane_names", None)
        if cause and names is not None:
            for address, who in names().items():
                if address in cause and who not in cause:
                    cause = cause.replace(address, f"{address} ({who})")
            setattr(e, CAUSE, cause)
        return e

    def waiting(self, what: str) -> None:
        """The driver starts waiting for ``what`` (e.g. ``step 3``): progress counts from now."""
        self.what, self._since = what, time.monotonic()

    def beat(self) -> None:
        """Heartbeat every worker; raise ``WorkerLost`` / a role's error / ``StepStalled``. A
        data-plane server process of this machine that died (the launcher's ``plane_lost``) is a
        ``WorkerLost`` naming it at once, before the clients' deadlines run out."""
        lost = getattr(self.launcher, "plane_lost", None)
        if lost is not None and (gone := lost()) is not None:
            raise tag(WorkerLost(f"{gone} ({self.what})"), gone.split(" (pid")[0])
        beats = {name: self.ask(name, "health", timeout=HEALTH_TIMEOUT_S) or {} for name in self.workers}
        items = sum(int(b.get("items", 0)) for hb in beats.values() for b in hb.values())
        now = time.monotonic()
        if items != self._items:
            self._items, self._since = items, now
        elif now - self._since > self.step_timeout_s:
            raise self.stalled(beats, now - self._since)

    def stalled(self, beats: dict[str, dict], idle_s: float) -> StepStalled:
        stuck = [(b.get("stuck_s", 0.0), role, name) for name, hb in beats.items() for role, b in hb.items()]
        worst = max(stuck, default=(0.0, "", ""))
        if worst[0] >= min(self.step_timeout_s, idle_s) / 2:
            who = f"role '{worst[1]}' on worker '{worst[2]}' has been in one call for {worst[0]:.0f} s"
        else:
            who = "no role is computing (every one is waiting)"
        err = StepStalled(f"{self.what} made no progress for {idle_s:.0f} s (train.step_timeout_s="
                          f"{self.step_timeout_s:g}): {who}")
        setattr(err, STACKS, self.stacks())
        return err

    def stacks(self) -> dict[str, str]:
        """Every worker's thread stacks, or why it gave none."""
        out: dict[str, str] = {}
        for name in self.workers:
            try:
                text = self.ask(name, "stacks", timeout=STACKS_TIMEOUT_S)
            except Exception as e:
                out[name] = f"(it did not answer: {type(e).__name__}: {e})"
                continue
            pid = text.partition("\n")[0]  # workers of one process (the local launcher): dumped once
            same = [n for n, t in out.items() if t.partition("\n")[0] == pid]
            out[name] = f"{pid}: the same process as worker '{same[0]}'" if same else text
        return out
