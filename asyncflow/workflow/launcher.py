"""What the workflow needs from a launcher: the :class:`Launcher` protocol.

A launcher decides *where* things run; the job (:mod:`asyncflow.workflow.job`) decides
*what* runs. The workflow declares this interface and :mod:`asyncflow.launch` implements it
(``local``: threads of this process; ``ray``: Ray actors), so the layers point down: the
workflow never imports a launcher. One contract test (``tests/test_contracts_launcher.py``)
runs against every implementation.

Invariants: ``spawn`` builds the object from picklable arguments (a Ray launcher builds it
in another process); ``result`` raises ``TimeoutError`` when ``timeout`` passes and the
call's own exception when it failed, and
:class:`~asyncflow.workflow.failure.WorkerLost` when the worker's process is gone (a
launcher with processes: Ray); ``release`` and ``shutdown`` are idempotent.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from asyncflow.dataplane.core.schema import Schema


@runtime_checkable
class Launcher(Protocol):
    cpus: int  # CPUs the workers may ask for, in all
    gpus: int  # GPUs the workers may ask for (0: none)
    owns_host: bool  # the machine is this job's (``resources.pin_cores=auto`` pins then)

    def check_device(self, device: str) -> None:
        """Raise ``ConfigError`` if ``resources.device`` cannot be used where the roles run."""

    def data_plane(self, schema: Schema, kind: str = "auto", storage_units: int = 2, handout_ttl: float = 60.0,
                   unit_deadline: float = 120.0) -> Any:
        """A data-plane client (:class:`~asyncflow.dataplane.api.DataPlaneClient`) over a new deployment
        (``resources.handout_ttl_s``, ``resources.unit_deadline_s``: its controller's limits)."""

    def weight_store(self) -> Any:
        """A weight store (:class:`~asyncflow.weights.store.WeightSource`) the trainer publishes to."""

    def dp_rendezvous(self, rank0: Any, world: int) -> Any:
        """What ``world`` data-parallel trainer ranks join to form their group."""

    def spawn(self, spec: Any, cls: type, *args: Any) -> Any:
        """A handle to ``cls(*args)`` built where ``spec`` (a :class:`~asyncflow.workflow.plan.WorkerSpec`) says."""

    def submit(self, handle: Any, method: str, *args: Any) -> Any:
        """Call ``handle.method(*args)`` without waiting; a future for :meth:`result`."""

    def result(self, fut: Any, timeout: float) -> Any:
        """The future's value; ``TimeoutError`` after ``timeout`` seconds."""

    def call(self, handle: Any, method: str, *args: Any) -> Any:
        """Call ``handle.method(*args)`` and wait for its value."""

    def release(self, obj: Any) -> None:
        """Free a worker or a service this launcher made."""

    def shutdown(self) -> None:
        """Free everything this launcher started."""
