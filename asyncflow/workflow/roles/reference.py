"""Reference role: log-probs of a frozen copy of the initial policy, for the KL term.

``sampler``: which ready rows it takes (data-parallel ``sync``: a
:class:`~asyncflow.dataplane.ShardSampler`, only its rank's rows; default: any)."""

from __future__ import annotations

from asyncflow.dataplane import Sampler
from asyncflow.dataplane.api import DataPlaneClient
from asyncflow.engines.training import TrainEngine
from asyncflow.workflow.roles.base import Role

FIELDS = ["prompt_ids", "response_ids"]


class ReferenceRole(Role):
    name = "reference"

    def __init__(self, engine: TrainEngine, plane: DataPlaneClient, micro: int = 32,
                 sampler: Sampler | None = None):
        super().__init__()
        self.engine, self.plane, self.micro, self.sampler = engine, plane, micro, sampler

    def poll(self, timeout: float) -> int:
        got = self.fetch(self.plane, "reference", FIELDS, self.micro, None, timeout, self.sampler)
        if got is None:
            return 0
        meta, data = got
        with self.work():
            ref = self.engine.logprobs([p.tolist() for p in data["prompt_ids"]],
                                       [r.tolist() for r in data["response_ids"]])
            self.plane.put_nowait({"ref_logprobs": ref}, partition=meta.partition, rows=meta.rows)
            self.items += len(meta.rows)
        self.linger(len(meta.rows), self.micro)
        return len(meta.rows)
