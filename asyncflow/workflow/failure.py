"""How a failed run is told: one line for the user, the whole story in ``RUN_DIR/error.log``.

* A worker calls :func:`tag` on an exception before it leaves it: *where* it failed (``role
  'reward' on worker 'reward'``), *what* the root cause is (``ValueError: boom``), the
  ``file:line`` that raised it and the full traceback. They are plain attributes, so they
  cross processes with the exception (Ray pickles its ``__dict__``; the traceback object
  and ``__cause__`` do not travel).
* :func:`one_line` makes the line the CLI prints (``asyncflow: error: <it>``);
  :func:`write_error_log` writes the driver's traceback, the worker's and any stack dumps.
* :class:`WorkerLost` (a worker's process died or stopped answering) and
  :class:`StepStalled` (no step progress for ``train.step_timeout_s``) are raised by the
  job's watchdog (:mod:`asyncflow.workflow.job`); they and a dead data-plane process are
  :func:`recoverable` (the driver restarts the run from its checkpoint, ``train.max_restarts``).
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import TypeVar

_E = TypeVar("_E", bound=BaseException)

WHERE, CAUSE, AT, TRACE = "asyncflow_where", "asyncflow_cause", "asyncflow_at", "asyncflow_trace"
LOG = "asyncflow_log"  # the error.log the driver wrote (set on the exception it re-raises)
STACKS = "asyncflow_stacks"  # worker name -> its threads' stacks (or why there are none)
RESUME = "asyncflow_resume"  # how to continue the run (set when the automatic restarts ran out)
ROOT = "asyncflow_root"  # the root cause's type name, recorded by tag()
MACHINERY = ("DataPlaneUnavailable", "QueueClosed")  # root causes that are a dead process, not user code


class WorkerLost(RuntimeError):
    """A worker's process died, or it did not answer a call within its deadline (``DeadlineMissed``)."""


class DeadlineMissed(WorkerLost):
    """A worker did not answer a call within its deadline: it may be alive and only slow (a loaded
    machine), which a restart says apart from a fault (:func:`restart_cause`)."""


class StepStalled(RuntimeError):
    """The trainer's step made no progress for ``train.step_timeout_s`` seconds."""


def restart_cause(exc: BaseException) -> str:
    """What a restart is after, for its one line: a missed deadline (with the setting that sets
    it) or a fault (a process died, a data-plane process went away)."""
    if isinstance(exc, DeadlineMissed):
        return "a missed deadline (the worker may only be slow: raise its timeout if the machine is loaded)"
    if isinstance(exc, StepStalled):
        return "a missed deadline (no progress: raise train.step_timeout_s if the machine is loaded)"
    return "a fault"


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of ``exc``'s chain (``raise ... from``, or raised while handling)."""
    seen = {id(exc)}
    while True:
        nxt = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if nxt is None or id(nxt) in seen:
            return exc
        seen.add(id(nxt))
        exc = nxt


def origin(exc: BaseException) -> str | None:
    """``file:line`` of the frame that raised ``exc`` (the last of its traceback), if known."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _first_line(text: str) -> str:
    lines = [s.strip() for s in text.strip().splitlines() if s.strip()]
    return lines[0] if lines else ""


def describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc``'s root cause, on one line."""
    root = root_cause(exc)
    msg = _first_line(str(root))
    return f"{type(root).__name__}: {msg}" if msg else type(root).__name__


def tag(exc: _E, where: str) -> _E:
    """Record on ``exc`` where it failed, its root cause, its ``file:line`` and traceback
    (the first tag wins: the innermost caller knows best); returns ``exc``."""
    if getattr(exc, WHERE, None) is None:
        try:
            setattr(exc, WHERE, where)
            setattr(exc, CAUSE, describe(exc))
            setattr(exc, AT, origin(root_cause(exc)))
            setattr(exc, ROOT, type(root_cause(exc)).__name__)  # (an exception's __cause__ does not cross Ray)
            setattr(exc, TRACE, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        except AttributeError:  # an exception type without a __dict__ (rare): told as it is
            pass
    return exc


def recoverable(exc: BaseException) -> bool:
    """Whether a run that failed with ``exc`` may be restarted from its checkpoint: a lost
    worker, a stalled step, a data-plane process that is gone (not a user's or a config error)."""
    root = getattr(exc, ROOT, None) or type(root_cause(exc)).__name__  # (tagged where it was raised)
    return isinstance(exc, (WorkerLost, StepStalled)) or root in MACHINERY


def mark_resumable(exc: BaseException, run_dir: Path) -> None:
    """Have :func:`one_line` end with the command that continues the run in ``run_dir``."""
    has = any(p.name.startswith("step-") for p in (Path(run_dir) / "checkpoints").glob("step-*"))
    hint = (f"to continue: asyncflow train --resume {run_dir}" if has
            else "no checkpoint yet: run it again")
    try:
        setattr(exc, RESUME, hint)
    except AttributeError:
        pass


def one_line(exc: BaseException) -> str:
    """What the CLI prints after ``asyncflow: error:``: where, the root cause, ``file:line``."""
    where, cause = getattr(exc, WHERE, None), getattr(exc, CAUSE, None) or describe(exc)
    at = getattr(exc, AT, None) or origin(root_cause(exc))
    text = f"{where} failed: {cause}" if where else cause
    if isinstance(exc, (WorkerLost, StepStalled)):  # the watchdog's own line says it all
        text = _first_line(str(exc))
    elif at:
        text += f" (at {at})"
    log, hint = getattr(exc, LOG, None), getattr(exc, RESUME, None)
    text = f"{text}; details in {log}" if log else text
    return f"{text}; {hint}" if hint else text


def write_error_log(path: Path, exc: BaseException) -> Path:
    """Write the driver's traceback of ``exc``, the worker's (when it came from one) and the
    workers' stack dumps (the watchdog's) to ``path``; mark ``exc`` with it."""
    parts = ["asyncflow: error: " + one_line(exc), "",
             "driver traceback:", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))]
    if getattr(exc, TRACE, None):
        parts += [f"traceback in the worker ({getattr(exc, WHERE, '?')}):", getattr(exc, TRACE)]
    for name, stacks in (getattr(exc, STACKS, None) or {}).items():
        parts += [f"threads of worker '{name}':", stacks]
    path.write_text("\n".join(parts) + "\n")
    try:
        setattr(exc, LOG, str(path))
    except AttributeError:
        pass
    return path
