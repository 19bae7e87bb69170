"""Starting the distributed data plane: :func:`launch` (child processes) or a command line.

:func:`launch` starts N :class:`~asyncflow.dataplane.transport.storage_server.StorageServer` processes, then
a :class:`~asyncflow.dataplane.transport.controller_server.ControllerServer` that knows their endpoints, and
returns a :class:`Deployment` (``client()``, ``shutdown()``). Children get only plain
data over the process-start pipe (schema as lists, endpoints, keys, token); each reports
the endpoint it bound.

Secure by default: every launch makes fresh CURVE :class:`~asyncflow.dataplane.transport.auth.Credentials`
(passed to the children over the pipe, never argv or environment) and a job folder
``<tmp>/asyncflow-plane-<pid>-XXXX`` of mode 0700: ``ipc`` sockets live in it (another user
cannot even reach them), and its ``state`` subfolder (or ``state_dir``) is the only place
``save``/``load`` touch. Nothing is left behind: ``Deployment.shutdown`` stops the servers and
removes the folder (but a saved state) and any segment a killed unit left; a process that
exits without it gets the same at exit (``atexit``); one killed with ``kill -9`` has its
servers stop and clean up by themselves (``watch_owner``), and a folder whose servers were
killed too (``<pid>`` is the launching process) is cleared by the next launch on the machine.
``Deployment.client()`` carries the client keys; a client made
without them is refused. ``secure=False`` (tests of the bare protocol only) starts the
servers without CURVE. For servers started by hand (or by another launcher)::

    python -m asyncflow.dataplane.transport.deploy keys job.keys        # 0600 file, once per job
    python -m asyncflow.dataplane.transport.deploy storage --schema s.json --keys job.keys --state-dir DIR
    python -m asyncflow.dataplane.transport.deploy controller --schema s.json --keys job.keys \
        --state-dir DIR --storage tcp://127.0.0.1:PORT0 tcp://127.0.0.1:PORT1

and clients connect with ``ZmqDataPlane(controller_endpoint, credentials=read_keys("job.keys"))``
(``$ASYNCFLOW_PLANE_TOKEN`` adds a token check, as before).

Across hosts: ``--bind ADDR`` (or ``launch(host=ADDR)``) binds and advertises
``tcp://ADDR:<port>``, ADDR being this host's address on the job's network; the same key
file on every host (copied as a 0600 file). A non-loopback address is refused without
keys, a wildcard always (one-line error). The controller takes the units' endpoints
(``--storage``, or ``launch(storage=[...], credentials=...)``); clients probe shared memory
per unit and use ZeroMQ frames with a unit on another host, on its sealed bulk port (AES-256-GCM
under a session key handed out over CURVE: :mod:`asyncflow.dataplane.transport.sealed`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import glob
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from asyncflow.dataplane.core.handouts import HANDOUT_TTL_S
from asyncflow.dataplane.core.schema import Schema, schema_from_msg, schema_to_msg
from asyncflow.dataplane.transport.auth import Credentials
from asyncflow.dataplane.transport.bulk import MAX_SESSIONS
from asyncflow.dataplane.transport.client import ZmqDataPlane
from asyncflow.dataplane.transport.controller_server import UNIT_DEADLINE_S, ControllerServer
from asyncflow.dataplane.transport.heap import keep_freed_pages
from asyncflow.dataplane.transport.link import DEADLINE_S
from asyncflow.dataplane.transport.receipts import receipt_key
from asyncflow.dataplane.transport.server_base import MAX_MSG_BYTES, _Server, check_bind, tcp_bind
from asyncflow.dataplane.transport.shm import sweep_pids
from asyncflow.dataplane.transport.storage_server import StorageServer

__all__ = ["Deployment", "launch", "main", "read_keys", "sweep_job_folders", "write_keys"]

FOLDER_PREFIX = "asyncflow-plane-"  # the job folder: <tmp>/asyncflow-plane-<launching pid>-XXXX


def _run_storage(schema_msg: list, bind: str, token: str | None, keys: list | None, state_dir: str,
                 limits: dict, owner: int, conn: Any) -> None:
    keep_freed_pages()  # before the ZeroMQ context's I/O thread allocates anything
    creds = None if keys is None else Credentials.from_msg(keys)
    server = StorageServer(schema_from_msg(schema_msg), bind, token, creds=creds, state_dir=state_dir,
                           **limits)
    server.watch_owner(owner)  # (launch's process gone, even by kill -9: the unit ends, its memory freed)
    conn.send(server.endpoint)
    conn.close()
    server.serve_forever()


def _run_controller(schema_msg: list, storage: list[str], bind: str, token: str | None,
                    capacity: int | None, keys: list | None, state_dir: str,
                    limits: dict, owner: int, folder: str, conn: Any) -> None:
    creds = None if keys is None else Credentials.from_msg(keys)
    server = ControllerServer(schema_from_msg(schema_msg), storage, bind, token, capacity, creds=creds,
                              state_dir=state_dir, **limits)
    server.watch_owner(owner)
    conn.send(server.endpoint)
    conn.close()
    server.serve_forever()
    if server.orphaned:  # (nobody is left to call Deployment.shutdown: the job folder goes as it would there)
        remove_job_folder(folder)


@dataclass
class Deployment:
    """A running controller + storage units (child processes of :func:`launch`).

    ``credentials``: the job's keys (``None`` only with ``launch(secure=False)``);
    ``folder``: the job's 0700 folder; ``state_dir``: where ``save``/``load`` names live."""

    endpoint: str
    token: str | None
    processes: list
    credentials: Credentials | None = None
    folder: str | None = None
    state_dir: str | None = None
    labels: list[str] | None = None  # what each of ``processes`` is, for error lines
    owner: int = field(default_factory=os.getpid)  # the launching process (its exit shuts this down)

    def lost(self) -> str | None:
        """The first server process of this deployment that is gone, in words, or ``None``."""
        for i, p in enumerate(self.processes):
            if not p.is_alive():
                who = self.labels[i] if self.labels and i < len(self.labels) else f"data-plane process {i}"
                code = p.exitcode
                how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited (code {code})"
                return f"{who} (pid {p.pid}) {how}"
        return None

    def client(self, use_shm: bool = True, deadline: float | None = None, sealed: bool = True) -> ZmqDataPlane:
        """A client of this deployment holding the job's client keys (picklable); ``sealed=False``
        sends frames on the units' CURVE sockets instead of their sealed bulk ports."""
        return ZmqDataPlane(self.endpoint, token=self.token, use_shm=use_shm, credentials=self.credentials,
                            deadline=DEADLINE_S if deadline is None else deadline, sealed=sealed)

    def shutdown(self, timeout: float = 5.0, polite: bool = True) -> None:
        """Stop every server process (asks them, then terminates stragglers, then kills what a
        terminate did not end), sweep the segments of units that did not unlink theirs and remove
        the job folder. ``polite=False`` skips the request (at interpreter exit)."""
        atexit.unregister(self._at_exit)
        polite = polite and all(p.is_alive() for p in self.processes)  # (a dead unit would never answer)
        if polite:
            try:
                self.client(deadline=timeout).shutdown_servers()
            except Exception:
                pass
        for p in self.processes:
            p.join(timeout if polite else 0)  # (without the request the others never exit by themselves)
            for end in (p.terminate, p.kill):
                if p.is_alive():
                    end()
                    p.join(timeout)
        sweep_pids([p.pid for p in self.processes if not p.is_alive()])  # segments of a killed unit
        self._remove_folder()

    def _at_exit(self) -> None:
        """The launching process exits without :meth:`shutdown`: without this, ``multiprocessing``
        would terminate the servers (SIGTERM: no clean-up of theirs runs) and leave the job folder
        in the temp dir and every unit's segments in /dev/shm. (Not in a forked child that exits:
        the servers are its parent's.)"""
        if os.getpid() == self.owner:
            self.shutdown(timeout=2.0, polite=False)

    def _remove_folder(self) -> None:
        if self.folder is not None:
            remove_job_folder(self.folder)


def launch(schema: Schema, n_storage: int = 2, capacity: int | None = None, token: str | None = None,
           host: str = "127.0.0.1", start_method: str = "spawn", transport: str = "tcp",
           secure: bool = True, state_dir: str | os.PathLike | None = None,
           max_msg_bytes: int = MAX_MSG_BYTES, credentials: Credentials | None = None,
           storage: Sequence[str] = (), handout_ttl: float = HANDOUT_TTL_S,
           unit_deadline: float = UNIT_DEADLINE_S, max_sessions: int = MAX_SESSIONS) -> Deployment:
    """Start ``n_storage`` storage units and a controller as processes; return their handle.

    Each binds ``tcp://<host>:<free port>``, or with ``transport="ipc"`` a Unix socket in
    the job's 0700 folder (one machine only; skips the TCP stack). ``secure`` (default):
    fresh CURVE keys for this job (see the module docstring). ``state_dir``: the folder
    ``save``/``load`` names are relative to (default: ``state`` in the job folder).
    ``max_msg_bytes``: the largest message a server reads (clients split their puts below it);
    ``max_sessions``: sealed bulk sessions per storage unit (:mod:`~asyncflow.dataplane.transport.bulk`).
    The child processes get only plain data (the schema as lists, endpoints, keys, token).

    Across hosts: ``host`` is the address this machine's servers bind and advertise
    (``tcp://<host>:<port>``; a non-loopback one needs ``secure``, a wildcard is refused);
    ``storage`` adds units started elsewhere (another host's ``deploy storage --bind``,
    or a launcher's) by endpoint, after the local ones, all holding ``credentials`` (the
    job's keys, instead of fresh ones). ``handout_ttl``: seconds before unacknowledged rows
    go back to their task; ``unit_deadline``: the controller's wait for a unit's save/load.
    """
    creds = credentials if credentials is not None else Credentials.generate() if secure else None
    _check_launch(transport, n_storage + len(storage), host, creds)
    folder, state = _job_folder(state_dir)
    bind = (lambda k: f"ipc://{folder}/sock/{k}") if transport == "ipc" else (lambda k: tcp_bind(host))
    keys = None if creds is None else creds.to_msg()
    ctx = mp.get_context(start_method)
    msg, procs = schema_to_msg(schema), []

    def start(target: Callable, *args: Any) -> Any:
        parent, child = ctx.Pipe(duplex=False)
        # every concrete context has Process; typeshed's BaseContext (get_context of a str) does not
        p = ctx.Process(target=target, args=(*args, child), daemon=True)  # type: ignore[attr-defined]
        with _without_main():
            p.start()
        procs.append(p)
        return parent

    # write receipts (receipts.py): keyed by the CURVE keys, else a key only these processes get
    rkey = receipt_key(creds) or (None if storage else os.urandom(32))
    try:
        unit_limits = {"max_msg_bytes": max_msg_bytes, "max_sessions": max_sessions, "receipts": rkey}
        pipes = [start(_run_storage, msg, bind(k), token, keys, state, unit_limits, os.getpid())  # all at once
                 for k in range(n_storage)]
        endpoints = [_endpoint_of(pipe, f"storage unit {k}") for k, pipe in enumerate(pipes)] + list(storage)
        limits = {"handout_ttl": handout_ttl, "unit_deadline": unit_deadline, "max_msg_bytes": max_msg_bytes,
                  "receipts": rkey}
        endpoint = _endpoint_of(start(_run_controller, msg, endpoints, bind("ctl"), token, capacity, keys, state,
                                     limits, os.getpid(), folder), "controller")
    except BaseException:
        _undo(procs, folder)  # none is left behind by a launch that failed
        raise
    labels = [f"storage unit {k} ({endpoints[k]})" for k in range(n_storage)] + [
        f"the data plane's controller {endpoint}"]
    dep = Deployment(endpoint, token, procs, creds, folder, state, labels)
    atexit.register(dep._at_exit)  # (runs before multiprocessing's own exit hook, registered at its import)
    return dep


def _undo(procs: list, folder: str) -> None:
    """Stop the processes a failed launch started and remove its job folder."""
    for p in procs:
        p.terminate()
        p.join(5)
    sweep_pids([p.pid for p in procs])
    shutil.rmtree(folder, ignore_errors=True)


def _job_folder(state_dir: str | os.PathLike | None) -> tuple[str, str]:
    """A new job folder (mode 0700, its ``sock`` subfolder) and the state folder; stale job
    folders of killed jobs are cleared first (:func:`sweep_job_folders`)."""
    sweep_job_folders()
    folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")  # mode 0700: this user only
    os.mkdir(os.path.join(folder, "sock"), 0o700)
    state = os.path.join(folder, "state") if state_dir is None else os.path.abspath(state_dir)
    os.makedirs(state, 0o700, exist_ok=True)
    return folder, state


def remove_job_folder(folder: str) -> None:
    """Remove a deployment's job folder's sockets; the folder too unless a saved state is in it
    (at shutdown, or by the controller once the process that launched it is gone)."""
    shutil.rmtree(os.path.join(folder, "sock"), ignore_errors=True)
    for path in (os.path.join(folder, "state"), folder):  # each only if empty (no state there with a state_dir)
        with contextlib.suppress(OSError):
            os.rmdir(path)


def sweep_job_folders(root: str | None = None) -> None:
    """Remove what :func:`remove_job_folder` would of every job folder in ``root`` (the temp dir)
    whose launching process is gone and that belongs to this user: a job whose servers were
    killed with it at once (``kill -9`` of its process group) leaves its folder, and the next
    launch on this machine clears it. Folders of live processes and of other users stay."""
    root = tempfile.gettempdir() if root is None else root
    for folder in glob.glob(os.path.join(glob.escape(root), f"{FOLDER_PREFIX}*-*")):
        pid = os.path.basename(folder)[len(FOLDER_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or os.lstat(folder).st_uid != os.getuid() or _alive(int(pid)):
                continue
        except OSError:
            continue
        remove_job_folder(folder)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return True


def _endpoint_of(parent: Any, what: str) -> str:
    if not parent.poll(60):
        raise RuntimeError(f"data plane {what} did not start")
    return parent.recv()


def _check_launch(transport: str, units: int, host: str, creds: Credentials | None) -> None:
    """Refuse a launch that cannot work, here rather than in a child that would only time out."""
    if transport not in ("tcp", "ipc"):
        raise ValueError(f"transport must be 'tcp' or 'ipc', got {transport!r}")
    if units < 1:
        raise ValueError(f"need at least one storage unit (n_storage plus storage endpoints), got {units}")
    if transport == "tcp":
        check_bind(tcp_bind(host), creds)


def write_keys(path: str | os.PathLike) -> Credentials:
    """Write fresh job credentials to ``path`` (JSON, created with mode 0600); return them."""
    creds = Credentials.generate()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(creds.to_msg(), fh)
    return creds


def read_keys(path: str | os.PathLike) -> Credentials:
    """The credentials :func:`write_keys` wrote (refused unless the file is this user's, 0600)."""
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path}: a key file must belong to this user with mode 0600; "
                              "chmod 600 it (or make a new one with 'deploy keys')")
    with open(path) as fh:
        return Credentials.from_msg(json.load(fh))


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

    The schema file is ``[[name, dtype, shape, ragged], ...]``; keys come from a 0600 file
    (``--keys``, made by the ``keys`` role), the token from ``$ASYNCFLOW_PLANE_TOKEN`` (never
    from the command line, where ``ps`` would show it).
    """
    ap = argparse.ArgumentParser(prog="python -m asyncflow.dataplane.transport.deploy")
    ap.add_argument("role", choices=["storage", "controller", "keys"])
    ap.add_argument("file", nargs="?", help="keys: the key file to create (mode 0600)")
    ap.add_argument("--schema", help="JSON file: [[name, dtype, shape, ragged], ...]")
    ap.add_argument("--keys", help="the job's key file (from the 'keys' role); without it: no CURVE")
    ap.add_argument("--state-dir", default=None, help="the only folder save/load may touch (the same for "
                    "the controller and every unit; without it both are refused)")
    ap.add_argument("--bind", default="127.0.0.1", help="the address to bind and advertise (this host's address "
                    "on the job's network; a non-loopback one needs --keys), or a full tcp://HOST:PORT endpoint")
    ap.add_argument("--storage", nargs="*", default=[], help="controller: storage unit endpoints, in order")
    ap.add_argument("--capacity", type=int, default=None)
    ap.add_argument("--handout-ttl", type=float, default=HANDOUT_TTL_S, help="controller: seconds before rows "
                    "handed out by get_meta and not acknowledged go back to their task")
    ap.add_argument("--max-sessions", type=int, default=MAX_SESSIONS, help="storage: sealed bulk sessions held "
                    "(past it the least recently used is forgotten; its client makes a new one)")
    args = ap.parse_args(argv)
    if args.role == "keys":
        if not args.file:
            ap.error("keys: name the key file to create")
        write_keys(args.file)
        return
    if not args.schema:
        ap.error(f"{args.role}: --schema is required")
    with open(args.schema) as fh:
        schema = schema_from_msg(json.load(fh))
    token = os.environ.get("ASYNCFLOW_PLANE_TOKEN") or None
    creds = None if args.keys is None else read_keys(args.keys)
    try:
        check_bind(tcp_bind(args.bind), creds)
        if args.role == "storage":
            keep_freed_pages()  # before the ZeroMQ context's I/O thread allocates anything
            server: _Server = StorageServer(schema, tcp_bind(args.bind), token, creds=creds,
                                            state_dir=args.state_dir, max_sessions=args.max_sessions)
        else:
            server = ControllerServer(schema, args.storage, tcp_bind(args.bind), token, args.capacity, creds=creds,
                                      state_dir=args.state_dir, handout_ttl=args.handout_ttl)
    except (ValueError, zmq.ZMQError) as exc:  # one line, no traceback (e.g. an address not on this host)
        sys.exit(f"deploy {args.role}: {exc} (--bind {args.bind})")
    print(server.endpoint, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
