"""Starting the distributed data plane: :func:`launch` (child processes) or a command line.

:func:`launch` starts N :class:`~asyncflow.dataplane.transport.storage_server.StorageServer` processes, then
a :class:`~asyncflow.dataplane.transport.controller_server.ControllerServer` that knows their endpoints, and
returns a :class:`Deployment` (``client()``, ``shutdown()``). Children get only plain
data over the process-start pipe (schema as lists, endpoints, token); each reports the
endpoint it bound. For servers started by hand (or by another launcher)::

    ASYNCFLOW_PLANE_TOKEN=... python -m asyncflow.dataplane.transport.deploy storage --schema s.json
    ASYNCFLOW_PLANE_TOKEN=... python -m asyncflow.dataplane.transport.deploy controller --schema s.json \
        --storage tcp://127.0.0.1:PORT0 tcp://127.0.0.1:PORT1

and clients connect with ``ZmqDataPlane(controller_endpoint, token)``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from asyncflow.dataplane.core.schema import Schema, schema_from_msg, schema_to_msg
from asyncflow.dataplane.transport.controller_server import ControllerServer, _Server
from asyncflow.dataplane.transport.shm import sweep_pids
from asyncflow.dataplane.transport.storage_server import StorageServer

__all__ = ["Deployment", "launch", "main"]


def _run_storage(schema_msg: list, bind: str, token: str | None, conn: Any) -> None:
    server = StorageServer(schema_from_msg(schema_msg), bind, token)
    conn.send(server.endpoint)
    conn.close()
    server.serve_forever()


def _run_controller(schema_msg: list, storage: list[str], bind: str, token: str | None,
                    capacity: int | None, conn: Any) -> None:
    server = ControllerServer(schema_from_msg(schema_msg), storage, bind, token, capacity)
    conn.send(server.endpoint)
    conn.close()
    server.serve_forever()


@dataclass
class Deployment:
    """A running controller + storage units (child processes of :func:`launch`)."""

    endpoint: str
    token: str | None
    processes: list

    def client(self, use_shm: bool = True):
        from asyncflow.dataplane.transport.client import ZmqDataPlane

        return ZmqDataPlane(self.endpoint, token=self.token, use_shm=use_shm)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every server process (asks them, then terminates stragglers)."""
        if all(p.is_alive() for p in self.processes):  # a dead unit would never answer
            try:
                self.client().shutdown_servers()
            except Exception:
                pass
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(timeout)
        sweep_pids([p.pid for p in self.processes if not p.is_alive()])  # segments of a killed unit


def launch(schema: Schema, n_storage: int = 2, capacity: int | None = None, token: str | None = None,
           host: str = "127.0.0.1", start_method: str = "spawn", transport: str = "tcp") -> Deployment:
    """Start ``n_storage`` storage units and a controller as processes; return their handle.

    Each binds ``tcp://<host>:<free port>``, or with ``transport="ipc"`` a Unix socket in
    the temp folder (one machine only; skips the TCP stack). The child processes get only
    plain data (the schema as lists, endpoints, token).
    """
    if transport not in ("tcp", "ipc"):
        raise ValueError(f"transport must be 'tcp' or 'ipc', got {transport!r}")
    prefix = os.path.join(tempfile.gettempdir(), f"asyncflow-plane-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    bind = (lambda k: f"ipc://{prefix}-{k}") if transport == "ipc" else (lambda k: f"tcp://{host}:0")
    if n_storage < 1:
        raise ValueError(f"n_storage must be >= 1, got {n_storage}")
    ctx = mp.get_context(start_method)
    msg, procs = schema_to_msg(schema), []

    def start(target: Callable, *args: Any) -> Any:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(*args, child), daemon=True)
        with _without_main():
            p.start()
        procs.append(p)
        return parent

    def endpoint_of(parent: Any, what: str) -> str:
        if not parent.poll(60):
            raise RuntimeError(f"data plane {what} did not start")
        return parent.recv()

    try:
        pipes = [start(_run_storage, msg, bind(k), token) for k in range(n_storage)]  # start together
        endpoints = [endpoint_of(pipe, f"storage unit {k}") for k, pipe in enumerate(pipes)]
        endpoint = endpoint_of(start(_run_controller, msg, endpoints, bind("ctl"), token, capacity), "controller")
    except BaseException:
        for p in procs:  # none is left behind by a launch that failed
            p.terminate()
            p.join(5)
        sweep_pids([p.pid for p in procs])
        raise
    return Deployment(endpoint, token, procs)


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """Start children without the parent's ``__main__``: a spawned child re-imports the
    parent's main script (as ``__mp_main__``), which in a training script means torch and
    transformers: 7 s of CPU per server measured, where the servers need only numpy,
    msgpack and pyzmq (0.3 s). Their targets live in this module, so nothing of
    ``__main__`` is needed."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is None:
            del sys.modules["__main__"]
        else:
            sys.modules["__main__"] = main


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m asyncflow.dataplane.transport.deploy {storage,controller} --schema S.json ...``

    The schema file is ``[[name, dtype, shape, ragged], ...]``; the token is read from
    ``$ASYNCFLOW_PLANE_TOKEN`` (never from the command line, where ``ps`` would show it).
    """
    ap = argparse.ArgumentParser(prog="python -m asyncflow.dataplane.transport.deploy")
    ap.add_argument("role", choices=["storage", "controller"])
    ap.add_argument("--schema", required=True, help="JSON file: [[name, dtype, shape, ragged], ...]")
    ap.add_argument("--bind", default="tcp://127.0.0.1:0")
    ap.add_argument("--storage", nargs="*", default=[], help="controller: storage unit endpoints, in order")
    ap.add_argument("--capacity", type=int, default=None)
    args = ap.parse_args(argv)
    with open(args.schema) as fh:
        schema = schema_from_msg(json.load(fh))
    token = os.environ.get("ASYNCFLOW_PLANE_TOKEN") or None
    if args.role == "storage":
        server: _Server = StorageServer(schema, args.bind, token)
    else:
        server = ControllerServer(schema, args.storage, args.bind, token, args.capacity)
    print(server.endpoint, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
