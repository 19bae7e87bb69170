"""Write receipts: a commit names only what the storage units acknowledged storing.

Why: a put is ``alloc`` (controller), writes (units), ``commit`` (controller), and the
controller never sees the bytes. Without a check, a client (buggy, or compromised with the
job's keys) could commit fields it never wrote, or wrote to the wrong unit; the rows would
be handed out as ready and every honest ``get`` of them would fail with "not stored".

How: each storage unit answers a successful ``write`` with a *receipt*, a MAC (HMAC-SHA256,
16 bytes) over ``[unit id, sorted field names, the rows of that write]`` under the job's
*receipt key*. The controller and the units hold that key; clients never do: it is derived
from the CURVE server secret (:func:`receipt_key`, which ``Credentials.for_client`` leaves
out) or, for a deployment without keys, made by ``launch`` and given to the server processes
over their start pipe. The *unit id* is 16 random bytes a unit makes at start; the
controller asks every unit for its id before it serves (``unit_info``,
:mod:`~asyncflow.dataplane.transport.controller_start`), so a receipt names the unit it
came from and cannot be presented for another. The client sends its receipts with the
commit (per write message: its unit, the spans of the commit's rows it covered, the MAC);
:func:`check_receipts` recomputes each MAC from the commit's own rows and refuses the commit
(``PermissionError`` naming the row, field and unit) unless every row is covered, for
exactly the committed fields, by a receipt of the unit that row lives on (``shard_of``).

Invariants: a receipt is only ever made by the unit that stored those fields of those rows
(the MAC needs the key, the unit id binds it to the unit); fields are write-once and row ids
never reused, so a receipt replayed later still names bytes that are there (or rows already
forgotten, which the index refuses anyway). Cost: one HMAC over the packed row ids per write
message on the unit and per receipt on the controller, and numpy passes over the commit's
rows: linear in rows, as the commit's own bookkeeping already is (no extra round trip).
A deployment whose controller has no key checks nothing (servers started by hand without
``--keys``; documented).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from asyncflow.dataplane.transport.auth import Credentials
from asyncflow.dataplane.transport.protocol import SHARD_BLOCK, ProtocolError

__all__ = ["RECEIPT_BYTES", "check_receipts", "receipt_key", "sign"]

RECEIPT_BYTES = 16
_DOMAIN = b"asyncflow data plane: storage receipts v1"


def receipt_key(creds: Credentials | None) -> bytes | None:
    """The job's receipt key, derived from the CURVE server secret (``None`` without keys)."""
    if creds is None or not creds.server_secret:
        return None
    return hmac.digest(creds.server_secret.encode(), _DOMAIN, "sha256")


def sign(key: bytes, unit_id: bytes, fields: Sequence[str], rows: Sequence[int]) -> bytes:
    """The receipt of one write: ``fields`` of ``rows`` stored by the unit ``unit_id``."""
    blob = msgpack.packb([unit_id, sorted(fields), list(rows)], use_bin_type=True)
    return hmac.digest(key, blob, "sha256")[:RECEIPT_BYTES]


def check_receipts(key: bytes, unit_ids: Sequence[bytes], rows: list[int], fields: Sequence[str],
                   receipts: Any) -> None:
    """Refuse a commit of ``fields`` of ``rows`` unless ``receipts`` (``[[unit, [[i, j], ...],
    mac], ...]``, spans indexing ``rows``) cover every row on its own unit, for these fields."""
    if not isinstance(receipts, list):
        raise ProtocolError("commit: receipts must be a list of [unit, spans, receipt]")
    at = np.asarray(rows, dtype=np.int64)
    covered = np.zeros(len(rows), dtype=bool)
    for k, entry in enumerate(receipts):
        unit, spans, mac = _entry(k, entry, len(unit_ids), len(rows))
        idx = np.concatenate([np.arange(i, j) for i, j in spans]) if spans else np.empty(0, np.int64)
        mine = at[idx]
        wrong = np.flatnonzero(mine // SHARD_BLOCK % len(unit_ids) != unit)
        if len(wrong):
            raise PermissionError(f"commit refused: row {int(mine[wrong[0]])} lives on storage unit "
                                  f"{int(mine[wrong[0]]) // SHARD_BLOCK % len(unit_ids)}, not on unit {unit} "
                                  "whose receipt the client sent for it")
        if not hmac.compare_digest(sign(key, unit_ids[unit], fields, mine.tolist()), mac):
            raise PermissionError(f"commit refused: receipt {k} does not match what storage unit {unit} stored "
                                  f"(fields {sorted(fields)} of the rows it names): a commit may name only fields "
                                  "the unit acknowledged for those rows")
        covered[idx] = True
    if not covered.all():
        row = rows[int(np.argmin(covered))]
        raise PermissionError(f"commit refused: row {row} field {sorted(fields)[0]!r} has no receipt from storage "
                              f"unit {row // SHARD_BLOCK % len(unit_ids)}: a commit may name only fields the unit "
                              "acknowledged storing for those rows (never written there)")


def _entry(k: int, entry: Any, n_units: int, n_rows: int) -> tuple[int, list[tuple[int, int]], bytes]:
    """One receipt entry, checked for shape: ``(unit, spans, mac)``."""
    try:
        unit, spans, mac = entry
        spans = [(int(i), int(j)) for i, j in spans]
    except (TypeError, ValueError):
        raise ProtocolError(f"commit: receipt {k} must be [unit, [[i, j], ...], receipt]") from None
    if isinstance(unit, int) and 0 <= unit < n_units and mac is None:
        raise PermissionError(f"commit refused: storage unit {unit} gave no receipt for a write (a unit started "
                              "without this job's keys?)")
    if not (isinstance(unit, int) and 0 <= unit < n_units and isinstance(mac, bytes)
            and all(0 <= i < j <= n_rows for i, j in spans)):
        raise ProtocolError(f"commit: receipt {k} names no unit of {n_units}, or spans outside the "
                            f"commit's {n_rows} rows")
    return unit, spans, mac
