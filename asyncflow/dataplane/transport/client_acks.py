"""Acknowledgement of hand-outs by the distributed client (a mixin of ``AsyncZmqDataPlane``).

Semantics: :mod:`asyncflow.dataplane.core.handouts`. A non-empty ``get_meta`` answer
carries a hand-out id (``BatchMeta.handout``). ``get_data`` acknowledges it after every
storage unit answered, and waits for the controller's answer before returning the data:
if the hand-out expired meanwhile (its rows went back and may be another consumer's),
the call raises :class:`~asyncflow.dataplane.core.rules.HandoutExpired` and delivers
nothing, so a row reaches at most one successful consumer of a task. A consumer killed
before that acknowledgement leaves its rows to return when the TTL passes. ``get_batch``
acknowledges through its ``get_data``; if that fails, it gives the rows back at once
(``nack``), since its caller never sees that meta.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncflow.dataplane.core.rules import BatchMeta

if TYPE_CHECKING:
    from asyncflow.dataplane.transport.link import Link

__all__ = ["ClientAcks"]


class ClientAcks:
    """``ack``/``nack`` of ``get_meta`` hand-outs."""

    if TYPE_CHECKING:  # AsyncZmqDataPlane's
        _ctrl: Link | None
        async def _ctrl_call(self, op: str, deadline: float | None | bool = True, **args: Any) -> Any: ...

    async def ack(self, meta: BatchMeta) -> None:
        """Acknowledge ``meta``'s rows without reading them (they become consumed); raises
        ``HandoutExpired`` if its hand-out expired; a no-op if already acknowledged."""
        await self._acknowledge(meta)

    async def nack(self, meta: BatchMeta) -> None:
        """Give ``meta``'s unacknowledged rows back to its task now (a later ``get_data`` or
        ``ack`` of ``meta`` raises ``HandoutExpired``)."""
        if meta.handout is not None:
            await self._ctrl_call("nack", handout=meta.handout, lease=None)

    async def _acknowledge(self, meta: BatchMeta) -> None:
        if meta.handout is not None:
            await self._ctrl_call("ack", handout=meta.handout, lease=None)
            meta.handout = None

    def _give_back(self, meta: BatchMeta) -> None:
        """``nack`` without waiting (after a failed ``get_batch`` read)."""
        if meta.handout is not None and self._ctrl is not None:
            self._ctrl.send("nack", {"handout": meta.handout, "lease": None}, noreply=True)
            meta.handout = None
