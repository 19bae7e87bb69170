"""Per-job credentials of the distributed data plane: ZeroMQ CURVE keys and a ZAP check.

Security model (see also README "Safety and failures"):

* :func:`~asyncflow.dataplane.transport.deploy.launch` makes a fresh :class:`Credentials`
  per deployment: a server keypair (every controller and storage unit of the job) and a
  client keypair (every client of the job, and the controller's own links to the units).
  They reach the server processes over the process-start pipe (never argv or environment,
  which ``ps`` and ``/proc`` show), and the clients inside the picklable client object
  (``Deployment.client()``; Ray pickles it to its workers, inside Ray's own trust domain).
* Every server socket is a CURVE server: each connection is authenticated (the client
  proves it holds a secret key; :class:`ZapCheck`, run in the server's own loop, admits
  only the job's client public key) and every message after the handshake is encrypted
  and authenticated (CurveZMQ: Curve25519 key exchange, XSalsa20-Poly1305 per message).
  A peer without the job's keys never gets a request decoded: its handshake fails before
  any frame reaches the request loop; the server counts and logs it (``stats``:
  ``refused``).
* The one socket that is not a CURVE server: a storage unit's *bulk port*
  (:mod:`asyncflow.dataplane.transport.bulk`), for put and get bytes that do not go
  through shared memory. It authenticates every message instead of the connection: each is
  sealed with AES-256-GCM under a session key the unit handed out over CURVE (so only a
  client that passed the handshake above holds one), with per-direction counters that
  never repeat and are accepted only increasing (:mod:`asyncflow.dataplane.transport.sealed`).
  A message that does not open is dropped unread and logged; the port serves only
  ``write``, ``gather`` and ``ping``. AES-GCM with AES-NI runs at 4-6 GB/s a core here,
  against CURVE's 0.5-0.8 GB/s on libzmq's one I/O thread.
* The optional token (``ASYNCFLOW_PLANE_TOKEN``) is checked on top, inside the encrypted
  channel; a server without a token refuses a request that carries one (a mismatch of
  deployments, never silently accepted).
* The client side detects a refused handshake at once (a socket monitor reports
  ``HANDSHAKE_FAILED_AUTH``) and raises :class:`~asyncflow.dataplane.core.rules.DataPlaneUnavailable`.

Cost on loopback, measured (``benchmarks/curve_cost.py --iters 4``, 2 storage units, one
client, a 2-core machine shared with other jobs, so +-20%; ranges are two runs each):

* shm on, 16 MiB batch: put 1.10-1.46 -> 1.04-1.11 GB/s, get 1.38-1.39 -> 1.26-1.43 GB/s
  (CURVE off -> on; no measurable cost);
* frames, 2 MiB batch: put 0.48-0.55 -> 0.29-0.39 GB/s, get 0.39-0.67 -> 0.32-0.34 GB/s;
* frames, 16 MiB batch (shm off): put 0.66-0.85 -> 0.36-0.48 GB/s, get 0.38-0.53 -> 0.28-0.33 GB/s;
* ``get_meta`` of 1 row, p50: 0.32-0.34 -> 0.33-0.42 ms.

CURVE encrypts every byte that crosses a socket (~0.4 GB/s a core here); big payloads on
one host go through shared memory (:mod:`asyncflow.dataplane.transport.shm`: 0600 files of
the job's user) and cost nothing more. Chosen: CURVE on for every deployment, loopback
included. Loopback does not keep other users out (any local process can connect to
127.0.0.1), and a token alone would still let every stranger's frames reach the decoder;
the price, ~3 ms more per 2 MiB put or get, is small against training steps of seconds.
``launch(secure=False)`` exists for tests of the bare protocol only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

__all__ = ["Credentials", "ZapCheck", "secure_client", "secure_server"]

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a CURVE server who may connect


@dataclass(frozen=True)
class Credentials:
    """The CURVE keys of one data-plane job (Z85 text, 40 characters each).

    A client copy (:meth:`for_client`) has no ``server_secret``. Plain strs only, so it
    pickles and crosses msgpack without any code of ours on the other side.
    """

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    @classmethod
    def generate(cls) -> Credentials:
        """Fresh keypairs from libsodium's random source."""
        sp, ss = zmq.curve_keypair()
        cp, cs = zmq.curve_keypair()
        return cls(sp.decode(), ss.decode(), cp.decode(), cs.decode())

    def for_client(self) -> Credentials:
        """The keys a client needs (the server's secret left out)."""
        return Credentials(self.server_public, "", self.client_public, self.client_secret)

    def to_msg(self) -> list[str]:
        return [self.server_public, self.server_secret, self.client_public, self.client_secret]

    @classmethod
    def from_msg(cls, msg: Any) -> Credentials:
        """From :meth:`to_msg`'s list; ``ValueError`` naming the fix on anything else."""
        if not (isinstance(msg, (list, tuple)) and len(msg) == 4 and all(isinstance(k, str) for k in msg)):
            raise ValueError("data plane credentials must be [server_public, server_secret, client_public, "
                             "client_secret] (Z85 strs); make them with Credentials.generate()")
        return cls(*msg)

    def __repr__(self) -> str:  # never print a secret key in a log or traceback
        return f"Credentials(server_public={self.server_public!r}, client_public={self.client_public!r}, ...)"


def secure_server(sock: zmq.Socket, creds: Credentials) -> None:
    """Make ``sock`` a CURVE server with the job's server keys (before ``bind``)."""
    if not creds.server_secret:
        raise ValueError("these credentials are a client's copy (no server secret key); a server needs the "
                         "full Credentials made by launch() or Credentials.generate()")
    sock.curve_secretkey = creds.server_secret.encode()
    sock.curve_publickey = creds.server_public.encode()
    sock.curve_server = True
    sock.zap_enforce_domain = False  # the one ZAP handler answers every domain


def secure_client(sock: zmq.Socket, creds: Credentials) -> None:
    """Make ``sock`` a CURVE client of the job's servers (before ``connect``)."""
    sock.curve_secretkey = creds.client_secret.encode()
    sock.curve_publickey = creds.client_public.encode()
    sock.curve_serverkey = creds.server_public.encode()


class ZapCheck:
    """The ZAP handler of one server process: admits only the job's client public key.

    A REP socket bound at :data:`ZAP_ENDPOINT` in the server's context, answered by the
    server's own loop (:meth:`handle`), so no thread and no lock. ``refused`` counts the
    handshakes it turned down (each logged with the peer address).
    """

    def __init__(self, ctx: zmq.Context, creds: Credentials) -> None:
        self.allowed = z85.decode(creds.client_public.encode())
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.refused = 0

    def handle(self) -> None:
        """Answer every pending ZAP request (non-blocking)."""
        while self.sock.poll(0):
            msg = self.sock.recv_multipart()
            version, rid = (msg + [b"", b""])[:2]
            mechanism = msg[5] if len(msg) > 5 else b""
            ok = mechanism == b"CURVE" and len(msg) > 6 and msg[6] == self.allowed
            if not ok:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    address = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
                    log.warning("data plane: refused a connection from %s (not the job's client key; %d so far)",
                                address, self.refused)
            status, text = (b"200", b"OK") if ok else (b"400", b"not a client of this data plane job")
            self.sock.send_multipart([version, rid, status, text, b"client" if ok else b"", b""])
