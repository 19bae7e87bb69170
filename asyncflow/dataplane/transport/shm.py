"""Same-host shared memory for big payloads of the distributed data plane.

Between a client and a storage unit on one host, column buffers need not cross a socket:
the client writes them into a file in ``/dev/shm`` (a *segment*) and sends only the msgpack
header with *refs* ``[name, offset, nbytes]``; the unit maps the file read-only and keeps
the mapping as the rows' storage (no copy on its side). A get symmetrically answers with
refs into the unit's segments, which the client maps (no copy on either side). Below
``min_bytes`` per message, and between hosts, buffers stay ZeroMQ frames.

Handshake (per client and unit, at connect): the unit answers ``shm_hello`` with its boot
id and its *prefix* ``afdp-<pid>-<random>-``; a client on the same boot id writes a probe
segment with random bytes and asks the unit to read it back (``shm_probe``), which proves
that both see the same ``/dev/shm``. Disabled by ``ASYNCFLOW_PLANE_SHM=0`` (in the client's
or the unit's environment), or ``shm=False`` on either side.

Names and lifetimes (every segment name starts with the unit's prefix):

* ``<prefix>c<pid>-<hex>``: written by a client for one put (or probe). On a successful
  write the unit *adopts* it: opens it, checks it (regular file of this user, large enough
  for every ref) and renames it ``<prefix>s<n>``; the client unlinks its name after any
  failed or unanswered write (a no-op once renamed). A client that dies between writing and
  sending leaves a ``c`` file: the unit unlinks ``c`` and ``x`` files older than
  :data:`STALE_S` (checked every few seconds).
* ``<prefix>s<n>``: owned by the unit, counted per stored ``(row, field)``; recycled or
  unlinked when the last one is dropped (clear, load, shutdown). Mappings that clients
  still hold stay valid (POSIX), so a get's arrays outlive a later clear, as they do with
  frames (a recycled segment is never rewritten while a reader maps it, below).
* ``<prefix>x<n>``: written by the unit for one get reply (rows that are not one slice of
  a stored segment); the client unlinks it as soon as it has mapped it.
* ``<prefix>r<n>``: a cleared ``s`` segment kept for reuse (*recycled*, below).

Recycling (:mod:`asyncflow.dataplane.transport.shm_recycle`): a big ``s`` segment whose last row is
dropped is kept as ``r<n>`` and *leased* to a client's next big put (``shm_lease``), which
writes over it: pages that exist write ~2x faster than fresh ones. A segment is leased only
once no process maps it any more.

Only an unlinked name frees memory, and only once no process maps it any more. A unit
that is killed leaves its ``s`` files; :func:`sweep_pids` (called by ``launch``'s
``shutdown``) removes every file of a dead unit's pid. Security: a ref names a file only
by its suffix under the unit's own prefix (``[0-9a-z-]``, no ``/`` or ``.``), opened with
``O_NOFOLLOW | O_NONBLOCK`` (a FIFO planted at a segment's name cannot block the unit) and
accepted only as a regular file of the unit's own user; a ref must lie inside the file,
so a client of the job can make the unit read only segments of this unit, never another
file. Requests are authenticated (CURVE, :mod:`asyncflow.dataplane.transport.auth`) before
any of this runs, segment files are created 0600, and the sockets stay loopback by default.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
import stat
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from asyncflow.dataplane.transport.shm_recycle import RECYCLE_BYTES, RECYCLE_IDLE_S, RECYCLE_MIN, Recycler

__all__ = ["RECYCLE_BYTES", "RECYCLE_IDLE_S", "RECYCLE_MIN", "ShmUnit", "boot_id", "enabled", "handshake", "map_refs",
           "segment_bytes", "sweep_pids", "unlink", "valid_prefix", "write_segment"]

SHM_DIR = "/dev/shm"
MIN_BYTES = 2 << 20  # per message; below it frames (a 1 MiB put slice measured no faster through a file)
STALE_S = 60.0  # an un-adopted client segment (or an unread export) older than this is removed
ALIGN = 64
_SUFFIX = re.compile(r"[0-9a-z-]{1,48}")
_IOV_MAX = 1024


def enabled(flag: bool = True) -> bool:
    """Shared memory is possible here and not disabled by ``ASYNCFLOW_PLANE_SHM=0``."""
    return flag and os.environ.get("ASYNCFLOW_PLANE_SHM", "1") != "0" and os.path.isdir(SHM_DIR)


def boot_id() -> str:
    """This host's identity for the handshake: hostname + kernel boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def valid_prefix(prefix: Any) -> bool:
    """A unit's prefix as :class:`ShmUnit` makes it (a client writes only such names)."""
    return isinstance(prefix, str) and re.fullmatch(r"afdp-[0-9]+-[0-9a-f]{8}-", prefix) is not None


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def _check_name(name: Any, prefix: str) -> str:
    if not (isinstance(name, str) and name.startswith(prefix) and _SUFFIX.fullmatch(name[len(prefix):])):
        raise PermissionError(f"shared-memory name {name!r} is not one of this storage unit's")
    return name


# Never follow a link, never block in open (a FIFO at a segment's name would, until a
# writer came), never leak the descriptor into a child.
_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def segment_bytes(buffers: Sequence[Any]) -> int:
    """The size of the segment :func:`write_segment` writes for ``buffers``."""
    end = 0
    for buf in buffers:
        end = _aligned(end) + sum(np.asarray(p).nbytes for p in (buf if isinstance(buf, list) else [buf]))
    return end


def write_segment(prefix: str, tag: str, buffers: Sequence[Any], leased: str | None = None) -> tuple[str, list[list]]:
    """Write ``buffers`` (arrays or lists of row arrays, each written back to back) into a
    new segment ``<prefix><tag><pid>-<hex>``, or over the ``leased`` one (a recycled segment
    a unit renamed for us; cut to size after); return its name and one ref per buffer."""
    name = leased or f"{prefix}{tag}{os.getpid()}-{secrets.token_hex(6)}"
    flags = os.O_WRONLY | _SAFE | (0 if leased else os.O_CREAT | os.O_EXCL)
    fd = os.open(os.path.join(SHM_DIR, name), flags, 0o600)
    try:
        _check_file(fd, name)
        refs, off, end = [], 0, 0
        for buf in buffers:
            parts = [np.ascontiguousarray(p).data.cast("B") for p in (buf if isinstance(buf, list) else [buf])]
            n = sum(p.nbytes for p in parts)
            _pwrite_all(fd, [p for p in parts if p.nbytes], off)
            refs.append([name, off, n])
            end, off = off + n, _aligned(off + n)
        if leased and os.fstat(fd).st_size > end:
            os.ftruncate(fd, end)
        return name, refs
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)


def _pwrite_all(fd: int, parts: list[memoryview], off: int) -> None:
    while parts:
        chunk = parts[:_IOV_MAX]
        done = os.pwritev(fd, chunk, off)
        off += done
        while chunk and done >= chunk[0].nbytes:  # drop what was written; keep a partial tail
            done -= chunk[0].nbytes
            chunk.pop(0)
            parts.pop(0)
        if done:
            parts[0] = parts[0][done:]


def _check_file(fd: int, name: str) -> os.stat_result:
    """Only a regular file of this user is a segment (never a FIFO, device or another's file)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"shared-memory segment {name!r} is not a regular file of this user")
    return st


def _map(name: str) -> tuple[mmap.mmap | None, int, int]:
    """Map ``name`` read-only: ``(mapping or None if empty, size, inode)``."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | _SAFE)
    try:
        st = _check_file(fd, name)
        mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ) if st.st_size else None
        return mm, st.st_size, st.st_ino
    finally:
        os.close(fd)


def _views(refs: Sequence[Any], maps: dict[str, tuple], frames: Sequence[Any]) -> list[Any]:
    """One buffer per ref: ``None`` takes the next frame, ``[name, off, n]`` a slice of a
    mapped segment (bounds checked)."""
    out, it = [], iter(frames)
    for ref in refs:
        if ref is None:
            out.append(next(it, b""))
            continue
        name, off, n = ref
        mm, size = maps[name][:2]
        if not (isinstance(off, int) and isinstance(n, int) and 0 <= off and 0 <= n and off + n <= size):
            raise ValueError(f"shared-memory ref {ref!r} lies outside its segment ({size} bytes)")
        out.append(memoryview(mm)[off:off + n] if n else b"")
    return out + list(it)


def map_refs(refs: Sequence[Any], frames: Sequence[Any], prefix: str) -> list[Any]:
    """Client side of a get: map every segment named in ``refs`` (names under ``prefix``
    only), unlink export segments at once, and return the buffers in order.

    After mapping, the name must still be the file we mapped: a stored segment is renamed
    (``r``) the moment its rows are cleared, before it can be recycled, so a mapping that
    passes this check was made while the rows were live, and from then on the unit sees
    it in ``/proc/<pid>/maps`` and never hands the file out for rewriting."""
    maps = {}
    for ref in refs:
        if ref is not None and ref[0] not in maps:
            name = _check_name(ref[0], prefix)
            try:
                maps[name] = _map(name)
                if os.stat(os.path.join(SHM_DIR, name)).st_ino != maps[name][2]:
                    raise FileNotFoundError(name)
            except FileNotFoundError:
                raise ValueError("rows were cleared while being read (their shared memory is gone)") from None
            if name[len(prefix):].startswith("x"):
                unlink(name)
    return _views(refs, maps, frames)


async def handshake(call: Callable[[str, dict], Awaitable[tuple[Any, list]]]) -> str | None:
    """Client side, per unit (``call(op, args)`` is a request to it): the unit's prefix if
    it runs on this host and reads back a probe segment we wrote, else ``None``."""
    info = (await call("shm_hello", {}))[0]
    if not isinstance(info, dict) or info.get("boot") != boot_id() or not valid_prefix(info.get("prefix")):
        return None
    secret = os.urandom(16)
    try:
        name, refs = write_segment(info["prefix"], "c", [np.frombuffer(secret, np.uint8)])
    except OSError:
        return None
    try:
        got = (await call("shm_probe", {"shm": refs}))[0]
    except (ValueError, PermissionError, OSError):
        return None
    finally:
        unlink(name)
    return info["prefix"] if got == secret else None


class ShmUnit:
    """A storage unit's side: adopts client segments, counts stored references, exports."""

    def __init__(self, recycle_bytes: int | None = None) -> None:
        self.prefix = f"afdp-{os.getpid()}-{secrets.token_hex(4)}-"
        self.refs: Counter[str] = Counter()  # owned segment -> stored (row, field) pairs
        self._n = 0
        self._next_sweep = 0.0
        self.recycler = Recycler(self.prefix, SHM_DIR, recycle_bytes)

    def hello(self) -> dict:
        return {"boot": boot_id(), "prefix": self.prefix}

    def probe(self, refs: Any) -> bytes:
        """Read back a client's probe segment (then remove it)."""
        if not (isinstance(refs, list) and len(refs) == 1 and isinstance(refs[0], list) and refs[0]):
            raise ValueError(f"bad shared-memory probe {refs!r}")
        name = _check_name(refs[0][0], self.prefix)
        try:
            mm, size, _ = _map(name)
            return bytes(mm[:min(size, 64)]) if mm is not None else b""
        finally:
            unlink(name)

    def adopt(self, refs: Any, frames: Sequence[Any]) -> tuple[list[Any], str | None]:
        """The buffers of a put whose refs name one client segment; the segment is renamed
        into this unit's ownership (count 0: call :meth:`hold`, or :meth:`release` with 0)."""
        if not isinstance(refs, list) or any(r is not None and not (isinstance(r, list) and len(r) == 3)
                                             for r in refs):
            raise ValueError(f"bad shared-memory refs {refs!r}")
        names = {_check_name(r[0], self.prefix) for r in refs if r is not None}
        if len(names) != 1 or not next(iter(names))[len(self.prefix):].startswith("c"):
            raise PermissionError(f"a put names one client segment, got {sorted(names)}")
        (name,) = names
        mm, size, ino = _map(name)
        self._n += 1
        owned = f"{self.prefix}s{self._n}"
        os.rename(os.path.join(SHM_DIR, name), os.path.join(SHM_DIR, owned))
        try:
            if os.stat(os.path.join(SHM_DIR, owned)).st_ino != ino:
                raise PermissionError(f"shared-memory segment {name!r} was replaced while adopted")
            views = _views([r if r is None else [owned, *r[1:]] for r in refs], {owned: (mm, size)}, frames)
        except BaseException:
            unlink(owned)
            raise
        self.refs[owned] = 0
        self.recycler.adopted(owned, mm)
        return views, owned

    def hold(self, name: str, n: int) -> None:
        self.refs[name] += n

    def release(self, name: str, n: int = 1) -> None:
        """Drop ``n`` stored references; unlink the segment at zero (mappings stay valid)."""
        self.refs[name] -= n
        if self.refs[name] <= 0:
            del self.refs[name]
            self.recycler.keep_or_unlink(name)

    def read_by(self, name: str, pid: Any) -> None:
        """A get answered refs into owned segment ``name`` to process ``pid``."""
        self.recycler.read_by(name, pid)

    def lease(self, nbytes: Any, pid: Any) -> str | None:
        """A recycled segment of at least ``nbytes`` for client ``pid`` to write over, or ``None``."""
        return self.recycler.lease(nbytes, pid)

    def export(self, buffers: Sequence[Any]) -> list[list]:
        """Write buffers (arrays or lists of row arrays) for one get reply; the client
        unlinks the segment after mapping it (or the sweep, if it never does)."""
        self._n += 1
        return write_segment(self.prefix, "x", buffers)[1]

    def sweep(self, now: float, every: float = 5.0) -> None:
        """Unlink client segments never adopted and exports never mapped (older than
        :data:`STALE_S`); at most every ``every`` seconds."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + every
        self.recycler.expire(now)
        wall = time.time()
        for name in _listdir(self.prefix):
            if name[len(self.prefix):][:1] in ("c", "x"):
                try:
                    if wall - os.stat(os.path.join(SHM_DIR, name)).st_mtime > STALE_S:
                        unlink(name)
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        """Unlink every file of this unit (owned, exported, un-adopted)."""
        for name in _listdir(self.prefix):
            unlink(name)
        self.refs.clear()
        self.recycler.pool.clear()


def _listdir(prefix: str) -> list[str]:
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return []


def sweep_pids(pids: Sequence[int]) -> None:
    """Remove every segment of the storage units with these pids (they have exited)."""
    for pid in pids:
        for name in _listdir(f"afdp-{pid}-"):
            unlink(name)
