"""Rollout: the role that generates answers, in one package.

* :mod:`~asyncflow.workflow.rollout.role`: :class:`RolloutRole`, the decode loop (weight
  swaps, refilling slots with admitted prompt groups, one decode step a poll);
* :mod:`~asyncflow.workflow.rollout.state`: :class:`RolloutState`, everything that loop
  mutates, as one typed record;
* :mod:`~asyncflow.workflow.rollout.collect`: :class:`Collector`, finished answers ->
  scored, placed groups -> the data plane;
* :mod:`~asyncflow.workflow.rollout.inflight`: the state's groups in a checkpoint, and put
  back on resume; :mod:`~asyncflow.workflow.rollout.episodes`: the same for multi-turn episodes
  (:mod:`asyncflow.agents`) in flight.

Step placement (which training step a finished group fills) is the plain arithmetic of
:class:`~asyncflow.workflow.placement.GroupPlacer`, held in the state.
"""

from asyncflow.workflow.rollout.role import RolloutRole
from asyncflow.workflow.rollout.state import RolloutState

__all__ = ["RolloutRole", "RolloutState"]
