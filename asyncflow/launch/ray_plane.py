"""The ZeroMQ data plane over the nodes of a Ray cluster (``resources.data_plane`` on
more than one host).

Each storage unit is a Ray actor (:class:`StorageUnitActor`, no CPU reserved) pinned to
one node with ``NodeAffinitySchedulingStrategy(soft=False)``; it runs a
:class:`~asyncflow.dataplane.transport.storage_server.StorageServer` in a thread, bound
to that node's address (``tcp://<node ip>:<free port>``, CURVE: the job's fresh keys reach
the actor as an argument, inside Ray's own trust domain like the clients' keys). Units go
round-robin over the alive nodes (sorted by node id), at least one a node. The controller
is a child process of the driver bound to the driver node's address
(:func:`~asyncflow.dataplane.transport.deploy.launch` with ``storage=`` those endpoints).
A client on a unit's node uses shared memory with it; elsewhere, ZeroMQ frames.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from asyncflow.dataplane import Schema
from asyncflow.dataplane.core.schema import schema_from_msg, schema_to_msg
from asyncflow.dataplane.transport.auth import Credentials
from asyncflow.dataplane.transport.deploy import Deployment, launch
from asyncflow.dataplane.transport.heap import keep_freed_pages
from asyncflow.dataplane.transport.storage_server import StorageServer

__all__ = ["StorageUnitActor", "cluster_plane", "node_ips", "stop_units"]


class StorageUnitActor:
    """One storage unit serving from a thread of this actor's process (on its node)."""

    def __init__(self, schema_msg: list, keys: list, host: str) -> None:
        self.state_dir = tempfile.mkdtemp(prefix="asyncflow-unit-")  # 0700, on this node
        keep_freed_pages()  # a put's frames reuse the pages a clear freed (transport/heap.py)
        self.server = StorageServer(schema_from_msg(schema_msg), f"tcp://{host}:0", None,
                                    creds=Credentials.from_msg(keys), state_dir=self.state_dir)
        self.thread = threading.Thread(target=self.server.serve_forever, name="storage-unit", daemon=True)
        self.thread.start()

    def endpoint(self) -> str:
        return self.server.endpoint

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving (if ``shutdown`` has not) and remove the state folder unless a save is in it."""
        self.server.running = False
        self.thread.join(timeout)
        with contextlib.suppress(OSError):
            os.rmdir(self.state_dir)


def stop_units(units: list[Any], timeout: float = 10.0) -> None:
    """Stop each unit actor (its folder removed where empty), then kill it; never raises."""
    if not units:
        return
    with contextlib.suppress(Exception):
        ray.get([u.stop.remote() for u in units], timeout=timeout)
    for unit in units:
        with contextlib.suppress(Exception):
            ray.kill(unit)


def node_ips() -> list[tuple[str, str]]:
    """``(node id, address)`` of every alive node, sorted by node id."""
    return sorted((n["NodeID"], n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive"))


def cluster_plane(schema: Schema, storage_units: int, timeout: float = 120.0, handout_ttl: float = 60.0,
                  unit_deadline: float = 120.0) -> tuple[Deployment, list[Any]]:
    """Start the units on the cluster's nodes and a controller here (with those limits); the
    deployment and the unit actors (:func:`stop_units` after ``Deployment.shutdown``)."""
    nodes = node_ips()
    creds = Credentials.generate()
    actor: Any = ray.remote(StorageUnitActor)  # an actor class (Ray's stubs do not say so)
    units: list[Any] = [actor.options(num_cpus=0, max_concurrency=2, enable_task_events=False,
                           scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
             .remote(schema_to_msg(schema), creds.to_msg(), ip)
             for node_id, ip in (nodes[k % len(nodes)] for k in range(max(storage_units, len(nodes))))]
    try:
        endpoints = ray.get([u.endpoint.remote() for u in units], timeout=timeout)
        dep = launch(schema, n_storage=0, host=ray.util.get_node_ip_address(), credentials=creds,
                     storage=endpoints, handout_ttl=handout_ttl, unit_deadline=unit_deadline)
    except BaseException:
        stop_units(units)
        raise
    return dep, units
