"""Control plane bookkeeping: which rows exist, what is produced, what each task consumed.

The index holds no sample data, only row ids, field names, small integer tags and
counters, so in a distributed deployment it lives in the controller and every message to
it is a few lists of ints. Per partition it keeps

* ``rows``: live row ids (an insertion-ordered dict, so ascending),
* ``produced[field]``: rows whose ``field`` has been written,
* ``pending[task]``: rows not yet consumed by ``task`` (ascending; created on the task's
  first consumption in the partition, until then every row is pending),
* ``tags[name][row]``: integer metadata for samplers,
* ``sealed``: no new rows will be added.

Invariant: ``produced[field]`` holds only live rows of its partition (a write is checked
first, a dropped row leaves every set), so a field written on as many rows as the partition
has is on all of them, and :meth:`RowIndex.ready` skips the intersection (the common case).
Every update touches only the rows it names (O(changed rows), plus one copy of a
partition's rows on a task's first consumption there). Computing the ready set walks only
the task's pending rows of one partition, so a long-running partition that a task keeps
up with costs O(in-flight rows) per request, not O(history); cleared partitions are
forgotten. Row ids are global, monotonic and never reused, so a stale id held by a
consumer cannot alias a newer sample.

Not thread-safe by itself: :class:`~asyncflow.dataplane.core.controller.DataPlane` serialises calls.
All ``check_*`` methods raise ``ValueError`` naming the offending row before anything
changes, so callers can validate first and then apply.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

__all__ = ["RowIndex"]


@dataclass
class _Partition:
    rows: dict[int, None] = field(default_factory=dict)
    produced: dict[str, set[int]] = field(default_factory=dict)
    pending: dict[str, dict[int, None]] = field(default_factory=dict)
    tags: dict[str, dict[int, int]] = field(default_factory=dict)
    sealed: bool = False


class RowIndex:
    """Produced/consumed state of every live row, grouped by partition."""

    def __init__(self) -> None:
        self._partitions: dict[Hashable, _Partition] = {}  # creation order
        self._partition_of: dict[int, Hashable] = {}
        self._next_row = 0
        self.consumed_total: Counter[str] = Counter()
        self.dropped_total: Counter[str] = Counter()
        self.rows_allocated = 0

    # -- partitions --------------------------------------------------------------------
    def partitions(self) -> list[Hashable]:
        """Live partitions, oldest first."""
        return list(self._partitions)

    def has(self, partition: Hashable) -> bool:
        return partition in self._partitions

    def sealed(self, partition: Hashable) -> bool:
        p = self._partitions.get(partition)
        return p is not None and p.sealed

    def seal(self, partition: Hashable) -> None:
        """Mark ``partition`` complete (creating it empty if needed)."""
        self._partitions.setdefault(partition, _Partition()).sealed = True

    def drop(self, partition: Hashable) -> list[int]:
        """Forget ``partition``; return its rows (for the storage to free)."""
        p = self._partitions.pop(partition, None)
        if p is None:
            return []
        for row in p.rows:
            del self._partition_of[row]
        return list(p.rows)

    def has_row(self, row: int) -> bool:
        return row in self._partition_of

    def live(self) -> list[int]:
        """Every live row id (any partition)."""
        return list(self._partition_of)

    @property
    def live_rows(self) -> int:
        return len(self._partition_of)

    def row_counts(self) -> dict[Hashable, int]:
        return {name: len(p.rows) for name, p in self._partitions.items()}

    # -- writes ------------------------------------------------------------------------
    def check_new(self, partition: Hashable) -> None:
        if self.sealed(partition):
            raise ValueError(f"partition {partition!r} is sealed; no new rows can be added")

    def allocate(self, partition: Hashable, n: int) -> list[int]:
        """Create ``n`` new rows in ``partition`` (created if new)."""
        self.check_new(partition)
        p = self._partitions.setdefault(partition, _Partition())
        rows = list(range(self._next_row, self._next_row + n))
        self._next_row += n
        self.rows_allocated += n
        new = dict.fromkeys(rows)
        p.rows.update(new)
        for pending in p.pending.values():
            pending.update(new)
        for row in rows:
            self._partition_of[row] = partition
        return rows

    def check_rows(self, rows: Iterable[int], partition: Hashable | None = None) -> None:
        """Every row is live (and, if given, in ``partition``)."""
        for row in rows:
            owner = self._partition_of.get(row, _MISSING)
            if owner is _MISSING:
                raise ValueError(
                    f"row {row} does not exist (never allocated, or its partition was cleared)"
                )
            if partition is not None and owner != partition:
                raise ValueError(f"row {row} belongs to partition {owner!r}, not {partition!r}")

    def check_write(self, partition: Hashable, rows: Sequence[int], fields: Iterable[str]) -> None:
        """Rows exist in ``partition``, are distinct, and none of ``fields`` is written yet."""
        self.check_rows(rows, partition)
        if len(set(rows)) != len(rows):
            dup = next(r for r, k in Counter(rows).items() if k > 1)
            raise ValueError(f"row {dup} appears more than once in one put")
        p = self._partitions[partition]
        for name in fields:
            done = p.produced.get(name, ())
            for row in rows:
                if row in done:
                    raise ValueError(
                        f"row {row} field {name!r} was already written; fields are write-once"
                    )

    def mark_produced(
        self,
        partition: Hashable,
        rows: Sequence[int],
        fields: Iterable[str],
        tags: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        p = self._partitions[partition]
        for name in fields:
            p.produced.setdefault(name, set()).update(rows)
        for name, values in (tags or {}).items():
            p.tags.setdefault(name, {}).update(zip(rows, values))

    # -- reads -------------------------------------------------------------------------
    def ready(self, partition: Hashable, task: str, fields: Sequence[str]) -> list[int]:
        """Rows of ``partition`` with every field produced and not consumed by ``task``."""
        p = self._partitions.get(partition)
        if p is None:
            return []
        pending = p.pending.get(task, p.rows)
        if all(len(p.produced.get(name, ())) == len(p.rows) for name in fields):
            return list(pending)  # every live row has every field (produced <= rows): no intersection
        ready: Set[int] = pending.keys()
        for name in fields:  # C-speed set intersections, O(pending rows)
            ready = ready & p.produced.get(name, set())
        if len(ready) == len(pending):
            return list(pending)  # already ascending: skip the sort
        return sorted(ready)

    def is_ready(self, partition: Hashable, task: str, fields: Sequence[str], row: int) -> bool:
        """Whether ``row`` is one of :meth:`ready`'s rows, in O(fields)."""
        p = self._partitions.get(partition)
        return (p is not None and row in p.pending.get(task, p.rows)
                and all(row in p.produced.get(name, ()) for name in fields))

    def exhausted(self, partition: Hashable, task: str, n_ready: int) -> bool:
        """Sealed, and every row not yet consumed by ``task`` is ready: nothing more can come."""
        p = self._partitions.get(partition)
        if p is None or not p.sealed:
            return False
        return n_ready == len(p.pending.get(task, p.rows))

    def tags(self, partition: Hashable) -> Mapping[str, Mapping[int, int]]:
        return self._partitions[partition].tags

    def consume(self, partition: Hashable, task: str, rows: Iterable[int], n_dropped: int) -> None:
        rows = list(rows)
        p = self._partitions[partition]
        pending = p.pending.get(task)
        if pending is None:
            pending = p.pending[task] = dict(p.rows)
        for row in rows:
            del pending[row]
        if len(rows) > n_dropped:
            self.consumed_total[task] += len(rows) - n_dropped
        if n_dropped:
            self.dropped_total[task] += n_dropped

    def unconsume(self, partition: Hashable, task: str, rows: Iterable[int]) -> None:
        """Give ``task`` back rows it was handed and did not acknowledge (those still live
        become pending again, in row order; ``consumed_total`` counts them no more)."""
        p = self._partitions.get(partition)
        pending = None if p is None else p.pending.get(task)
        if p is None or pending is None:
            return
        back = [r for r in rows if r in p.rows and r not in pending]
        if back:
            p.pending[task] = dict.fromkeys(sorted([*pending, *back]))
            self.consumed_total[task] -= len(back)

    def reset_consumption(self, task: str) -> None:
        """Forget what ``task`` consumed: every live row is pending for it again."""
        for p in self._partitions.values():
            p.pending.pop(task, None)

    def drop_rows(self, rows: Iterable[int]) -> list[int]:
        """Forget single rows (all fields, tags, consumption); return them for the storage.

        Every row must be live (checked first, so an unknown row changes nothing); the
        partitions stay, even if emptied.
        """
        rows = list(dict.fromkeys(rows))
        self.check_rows(rows)
        for row in rows:
            p = self._partitions[self._partition_of.pop(row)]
            del p.rows[row]
            for done in p.produced.values():
                done.discard(row)
            for pending in p.pending.values():
                pending.pop(row, None)
            for values in p.tags.values():
                values.pop(row, None)
        return rows

    # -- persistence -------------------------------------------------------------------
    def state(self, in_flight: Iterable[tuple[Hashable, str, Sequence[int]]] = ()) -> dict:
        """The whole index as msgpack/JSON-able plain data (see :meth:`from_state`).

        ``in_flight``: ``(partition, task, rows)`` handed out and not acknowledged; they are
        written as not consumed (the state in which their consumer never got them).

        Partition names must be ``int``, ``str`` or ``None``: anything else cannot
        round-trip through msgpack/JSON, so it raises ``ValueError`` here.
        """
        back: dict[tuple[Hashable, str], list[int]] = {}
        for partition, task, rows in in_flight:
            back.setdefault((partition, task), []).extend(rows)
        consumed = Counter(self.consumed_total)
        parts = []
        for name, p in self._partitions.items():
            check_partition_name(name)
            pending = {t: list(rows) for t, rows in p.pending.items()}
            for t in pending:
                extra = [r for r in back.get((name, t), ()) if r in p.rows and r not in p.pending[t]]
                if extra:
                    pending[t] = sorted([*pending[t], *extra])
                    consumed[t] -= len(extra)
            parts.append({
                "name": name,
                "rows": list(p.rows),
                "produced": {f: sorted(done) for f, done in p.produced.items()},
                "pending": pending,
                "tags": {t: [list(v.keys()), list(v.values())] for t, v in p.tags.items()},
                "sealed": p.sealed,
            })
        return {
            "next_row": self._next_row,
            "rows_allocated": self.rows_allocated,
            "consumed_total": dict(consumed),
            "dropped_total": dict(self.dropped_total),
            "partitions": parts,
        }

    @classmethod
    def from_state(cls, state: Mapping) -> RowIndex:
        """Rebuild an index from :meth:`state` (rows keep their ids; new ids continue)."""
        index = cls()
        index._next_row = int(state["next_row"])
        index.rows_allocated = int(state["rows_allocated"])
        index.consumed_total.update(state["consumed_total"])
        index.dropped_total.update(state["dropped_total"])
        for d in state["partitions"]:
            name = d["name"]
            p = index._partitions[name] = _Partition(sealed=bool(d["sealed"]))
            p.rows = dict.fromkeys(int(r) for r in d["rows"])
            p.produced = {f: set(rows) & p.rows.keys() for f, rows in d["produced"].items()}  # (produced <= rows)
            p.pending = {t: dict.fromkeys(rows) for t, rows in d["pending"].items()}
            p.tags = {t: dict(zip(rows, values)) for t, (rows, values) in d["tags"].items()}
            for row in p.rows:
                index._partition_of[row] = name
        return index

    def check_readable(self, rows: Sequence[int], fields: Iterable[str]) -> None:
        self.check_rows(rows)
        for name in fields:
            for row in rows:
                if row not in self._partitions[self._partition_of[row]].produced.get(name, ()):
                    raise ValueError(f"row {row} field {name!r} has not been produced yet")

    def row_tags(self, rows: Sequence[int]) -> dict[str, list[int]]:
        """Tags defined on every one of ``rows``, as ``name -> [value per row]``."""
        self.check_rows(rows)
        per_row = [self._partitions[self._partition_of[r]].tags for r in rows]
        if not per_row:
            return {}
        names = [n for n in per_row[0] if all(n in t and r in t[n] for t, r in zip(per_row, rows))]
        return {n: [t[n][r] for t, r in zip(per_row, rows)] for n in names}


_MISSING = object()


def check_partition_name(name: object) -> None:
    """Partition names that survive msgpack/JSON unchanged: int, str, None (not bool)."""
    if not (name is None or isinstance(name, str) or (isinstance(name, int) and not isinstance(name, bool))):
        raise ValueError(
            f"partition {name!r}: only int, str or None partition names can be saved or sent "
            f"over the network, got {type(name).__name__}"
        )
