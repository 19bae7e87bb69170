"""Ray launcher: each worker is a Ray actor process; the data plane and the weight store
are threaded actors. ``ray.remote`` is applied here, at launch, never on the classes.

* Starts a local Ray instance sized to this machine, or connects to ``RAY_ADDRESS``.
* ``owns_host``: this launcher started a local instance, so the machine is the job's and
  ``resources.pin_cores=auto`` pins each compute role to cores of its own.
* Resource requests are fractional CPUs that never add up to more than exist (a 2-core
  machine runs rollout and trainer with 1 CPU each; a reward worker
  (``reward.placement=separate``), the data plane and the weight store ask for 0).
* Each role's process starts with ``MALLOC_ARENA_MAX=1`` (:func:`_worker_env`), so its
  compute thread allocates from the arena that :func:`~asyncflow.engines.allocator.keep_heap`
  keeps (``ASYNCFLOW_ARENA_MAX`` sets another count, ``0`` leaves glibc's default).
* A local instance started here runs its workers at niceness 0 (``worker_niceness``; Ray's
  default is 15). At 15 every role's compute thread yields its core to any other process
  (the driver, the data-plane processes, Ray's daemons, anything else on the machine), and a
  data-parallel rank so delayed holds up the others at the next collective; the plain
  processes of ``benchmarks/minimal_grpo.py`` run at 0. An instance at ``RAY_ADDRESS`` keeps
  its own setting.
* A local instance started here has a reaper (:mod:`asyncflow.launch.reaper`): if this driver
  dies without shutting Ray down (``kill -9``), it ends the Ray processes that would outlive it.
* A data-parallel trainer's ranks are actor processes joined by ``torch.distributed``
  (gloo) at a rendezvous address with a free port chosen by rank 0 (``dp_rendezvous``).
* Actors report no task events to Ray (``enable_task_events=False``): every data-plane and
  weight-store call (tens to hundreds a second) would send one to Ray's control store for
  the dashboard's task table, which this job does not use (its timeline is ``trace.json``).
* Clients wrap actor handles with the plain-class API, so roles never see Ray; an error
  raised inside the data plane (timeout, closed, schema) is re-raised as itself.
* The data plane (``resources.data_plane``): ``zmq`` is the distributed ZeroMQ data plane
  (:mod:`asyncflow.dataplane.transport.deploy`: a controller + ``resources.storage_units`` storage
  units as child processes of the driver, bound to loopback, with fresh CURVE keys per
  job; roles get its picklable client, which carries the client keys); on a cluster of
  several hosts (``zmq`` or ``auto``) the units are Ray actors pinned one or more a node,
  bound to each node's address, and the controller binds the driver node's address
  (:mod:`asyncflow.launch.ray_plane`; CURVE as on one host); ``ray`` is one threaded
  actor holding an in-process ``DataPlane`` (calls go through Ray's RPC).
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import TYPE_CHECKING, Any

import ray

from asyncflow.config import ConfigError
from asyncflow.dataplane import Schema
from asyncflow.dataplane.transport.client import ZmqDataPlane
from asyncflow.dataplane.transport.deploy import Deployment, launch
from asyncflow.launch.ray_plane import cluster_plane, stop_units
from asyncflow.launch.ray_services import PackedDataPlane, RayDataPlane, RayWeightStore, ray_get
from asyncflow.launch.reaper import start_reaper
from asyncflow.weights.store import WeightStore

if TYPE_CHECKING:
    from asyncflow.workflow.plan import WorkerSpec


def _worker_env() -> dict:
    """Options that start each role's process with ``MALLOC_ARENA_MAX`` (default 1; ``0`` in
    ``ASYNCFLOW_ARENA_MAX`` leaves glibc's default): the compute thread is not the process's
    main thread, and a thread's own malloc arena gives its freed pages back to the kernel
    whatever :func:`asyncflow.engines.allocator.keep_heap` asks, so every step faults them
    in again. One arena (the main one, which keeps them) serves every thread."""
    value = os.environ.get("ASYNCFLOW_ARENA_MAX", "1")
    return {} if value == "0" else {"runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": value}}}


def _reaper() -> Any:
    """The reaper of the local instance just started (:mod:`asyncflow.launch.reaper`): what a
    ``kill -9`` of this driver leaves of Ray is ended; None where Ray's session folder is unknown."""
    node: Any = getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)
    session = getattr(node, "get_session_dir_path", lambda: None)()  # (None: another Ray version's internals)
    return start_reaper(session) if isinstance(session, str) else None


class RayLauncher:
    def __init__(self, num_cpus: int | None = None):
        self._num_cpus = num_cpus
        self._started = False
        self._owns = False  # this launcher called ray.init (and shuts Ray down)
        self._owns_host = False  # a local instance started here: the machine is the job's (resources.pin_cores)
        self._cpus = self._gpus = 0
        self._deployments: list[Deployment] = []  # ZeroMQ data planes started by data_plane()
        self._unit_actors: dict[str, list] = {}  # per deployment (its endpoint): storage units that are Ray actors
        self._reaper: Any = None  # a local instance's reaper (asyncflow.launch.reaper)

    def _start(self) -> None:
        """Start (or connect to) Ray on first use, not when the launcher is made: the driver
        checks the model folder and warm-starts first, so a mistake there never waits for Ray."""
        if self._started:
            return
        self._started = True
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True,
                          configure_logging=True)
            if address:
                ray.init(address=address, **kwargs)
            else:
                _own_token()
                ray.init(num_cpus=self._num_cpus or os.cpu_count() or 1, _system_config={"worker_niceness": 0},
                         **kwargs)
                self._owns_host = True
                self._reaper = _reaper()
            self._owns = True
        self._cpus = int(ray.available_resources().get("CPU", os.cpu_count() or 1))
        self._gpus = int(ray.cluster_resources().get("GPU", 0))

    @property
    def cpus(self) -> int:
        self._start()
        return self._cpus

    @property
    def gpus(self) -> int:
        self._start()
        return self._gpus

    @property
    def owns_host(self) -> bool:
        self._start()
        return self._owns_host

    def check_device(self, device: str) -> None:
        """A GPU job needs GPUs in the cluster (Ray detects a node's GPUs when it starts)."""
        if device != "cpu" and not self.gpus:
            raise ConfigError(f"resources.device={device}, but the Ray cluster has no GPU "
                              f"(ray.cluster_resources() lists none): set resources.device=cpu")

    @staticmethod
    def one_host() -> bool:
        """Every alive node of the Ray cluster is this machine (a local instance)."""
        here = ray.util.get_node_ip_address()
        return all(n.get("NodeManagerAddress") == here for n in ray.nodes() if n.get("Alive"))

    def data_plane(self, schema: Schema, kind: str = "auto", storage_units: int = 2, handout_ttl: float = 60.0,
                   unit_deadline: float = 120.0) -> ZmqDataPlane | RayDataPlane:
        self._start()  # (else an actor call would start Ray itself: all CPUs, never shut down here)
        if kind in ("zmq", "auto") and self.one_host():  # child processes of the driver, bound to loopback
            self._deployments.append(launch(schema, n_storage=storage_units, handout_ttl=handout_ttl,
                                             unit_deadline=unit_deadline))
            return self._deployments[-1].client()
        if kind in ("zmq", "auto"):  # units on every node, bound to each node's address (ray_plane)
            dep, units = cluster_plane(schema, storage_units, handout_ttl=handout_ttl, unit_deadline=unit_deadline)
            self._deployments.append(dep)
            self._unit_actors[dep.endpoint] = units
            return dep.client()
        actor = ray.remote(PackedDataPlane).options(num_cpus=0, max_concurrency=64, enable_task_events=False)
        return RayDataPlane(actor.remote(schema, handout_ttl=handout_ttl))

    def plane_names(self) -> dict[str, str]:
        """What each data-plane address is, for error lines (the controllers' endpoints)."""
        return {d.endpoint: "the data plane's controller" for d in self._deployments}

    def plane_lost(self) -> str | None:
        """A data-plane server process of this machine's deployments that is gone, in words."""
        return next((w for d in self._deployments if d.processes and (w := d.lost()) is not None), None)

    def weight_store(self) -> RayWeightStore:
        self._start()
        return RayWeightStore(ray.remote(WeightStore).options(num_cpus=0, max_concurrency=16,
                                                              enable_task_events=False).remote())

    def dp_rendezvous(self, rank0: Any, world: int) -> str:
        """A ``tcp://`` address with a free port on rank 0's machine, where ``world`` trainer
        ranks (actor processes) join one gloo group (``torch.distributed``)."""
        return self.call(rank0, "dp_address")

    def spawn(self, spec: WorkerSpec, cls: type, *args: Any) -> Any:
        self._start()
        return ray.remote(cls).options(num_cpus=spec.cpus, num_gpus=spec.gpus, max_concurrency=4, name=None,
                                       enable_task_events=False, **_worker_env()).remote(*args)

    def submit(self, handle: Any, method: str, *args: Any) -> ray.ObjectRef:
        return getattr(handle, method).remote(*args)

    def result(self, ref: ray.ObjectRef, timeout: float) -> Any:
        return ray_get(ref, timeout)

    def call(self, handle: Any, method: str, *args: Any) -> Any:
        return ray_get(getattr(handle, method).remote(*args))

    def release(self, obj: Any) -> None:
        """Kill the actor behind ``obj`` (a worker handle or a client) and free its CPUs."""
        for dep in [d for d in self._deployments if d.endpoint == getattr(obj, "endpoint", None)]:
            self._deployments.remove(dep)
            self._stop(dep)
        handle = getattr(obj, "handle", obj)
        try:
            ray.kill(handle)
        except Exception:  # already dead
            pass

    def _stop(self, dep: Deployment) -> None:
        dep.shutdown()  # asks every unit to stop too
        stop_units(self._unit_actors.pop(dep.endpoint, []))

    def shutdown(self) -> None:
        for dep in self._deployments:
            self._stop(dep)
        self._deployments.clear()
        if self._owns and ray.is_initialized():
            ray.shutdown()
        if self._reaper is not None:  # (it sweeps what the shutdown left, then ends)
            self._reaper.stdin.close()
            self._reaper = None


def _own_token() -> None:
    """A local Ray instance authenticates with a fresh token of its own (Ray's token mode, set
    explicitly, so Ray prints no warning and writes no ``~/.ray/auth_token``). The token is in
    this process's environment, which Ray's processes inherit: readable by this OS user only.
    A user's own ``RAY_AUTH_MODE`` (``disabled`` included) is respected."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    import ray._raylet as raylet  # Ray reads its auth settings once per process: refresh them after setting ours

    config, loader = getattr(raylet, "Config", None), getattr(raylet, "AuthenticationTokenLoader", None)
    if config is None or loader is None:  # another Ray: leave its defaults (token mode, with its warning)
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    config.initialize("")
    loader.instance().reset_cache()
