"""Streaming data plane between tasks (the TransferQueue design, in process).

A table of rows (samples, global ids) x fields (declared columns), grouped in partitions
(e.g. one per training step). Producers ``put`` columns; a consumer task asks the
controller for up to ``n`` rows whose required fields are produced and that the task has
not consumed (``get_meta``, choosing with a :class:`Sampler`), then reads only the columns
it needs (``get_data``); ``get_batch`` does both in one call. ``seal`` ends a partition,
``clear`` frees it, ``clear_rows`` frees single rows, ``reset_consumption`` lets a task
read everything again, ``save``/``load`` persist the whole state (msgpack + npz), ``close``
stops everything.

Modules, one role each:

* :mod:`~asyncflow.dataplane.core.schema`     declared fields and all-or-nothing validation
* :mod:`~asyncflow.dataplane.core.samplers`   selection policies: ``sample(ready, n, tags)``
* :mod:`~asyncflow.dataplane.core.index`      control plane bookkeeping (row ids, produced, consumed)
* :mod:`~asyncflow.dataplane.core.storage`    data plane storage unit (values by row and field)
* :mod:`~asyncflow.dataplane.core.rules`      request semantics shared by every deployment
* :mod:`~asyncflow.dataplane.core.controller` :class:`DataPlane`, the thread-safe in-process deployment
* :mod:`~asyncflow.dataplane.transport.protocol`   wire format: msgpack headers + raw numpy frames, no pickle
* :mod:`~asyncflow.dataplane.transport.controller_server` the distributed deployment: the controller server
* :mod:`~asyncflow.dataplane.transport.storage_server` its storage-unit server (N of them, rows sharded)
* :mod:`~asyncflow.dataplane.transport.deploy` starts it (child processes, or a command line)
* :mod:`~asyncflow.dataplane.core.leases`     pins that keep a ``get_batch``'s rows until read
* :mod:`~asyncflow.dataplane.core.handouts`   ack-based consumption: unacknowledged rows go back after a TTL
* :mod:`~asyncflow.dataplane.core.consumption` ack/nack, resets and save/load of the in-process plane
* :mod:`~asyncflow.dataplane.transport.unit_links` the controller's never-blocking links to its units
* :mod:`~asyncflow.dataplane.transport.controller_persist` consistent save/load of the distributed plane
* :mod:`~asyncflow.dataplane.transport.client_acks` the client's ack/nack
* :mod:`~asyncflow.dataplane.transport.shm`        same-host shared memory for big buffers (segments, lifetimes)
* :mod:`~asyncflow.dataplane.transport.shm_recycle` reuse of cleared segments, never under a reader
* :mod:`~asyncflow.dataplane.transport.client_async`  its client: one asyncio core with every ``DataPlane`` method
* :mod:`~asyncflow.dataplane.transport.client` the synchronous client the roles use: a thin wrapper
  that runs the async core on a private event-loop thread (both picklable)

Invariants: each row is consumed at most once per task (when acknowledged); a row is never handed out before
all its required fields are produced; a put is all-or-nothing; back-pressure never drops.
Everything crossing the API is plain data, so the distributed deployment keeps the same
signatures (partition names there: int, str or None; samplers: the built-in ones).
numpy, msgpack and pyzmq only: no torch, no ray in this package.
"""

from asyncflow.dataplane.core.controller import BatchMeta, DataPlane, QueueClosed, QueueTimeout
from asyncflow.dataplane.core.rules import DataPlaneUnavailable, HandoutExpired
from asyncflow.dataplane.core.samplers import (
    GroupSampler,
    Sampler,
    SequentialSampler,
    ShardSampler,
    StalenessSampler,
    TokenBalancedSampler,
    chunk_sizes,
)
from asyncflow.dataplane.core.schema import Field, Schema, SchemaError

__all__ = [
    "BatchMeta",
    "DataPlane",
    "DataPlaneUnavailable",
    "Field",
    "GroupSampler",
    "HandoutExpired",
    "QueueClosed",
    "QueueTimeout",
    "Sampler",
    "Schema",
    "SchemaError",
    "SequentialSampler",
    "ShardSampler",
    "StalenessSampler",
    "TokenBalancedSampler",
    "chunk_sizes",
]
