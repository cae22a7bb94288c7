"""The pure decision core: ``decide`` and the vocabulary, state and decision it uses.

One module per concept: ``vocabulary`` (stages and reasons), ``state`` (what a tick
carries to the next, and its JSON codec), ``decision`` (what a tick decided),
``models`` (the caller-owned cache of capacity models), the stages (``smoothing``,
``steady``, ``calibration``, ``recommend``, ``normalisation``), ``forecast`` (the
optional rate forecaster) and ``pipeline`` (``decide``, the list of stages). The
names most callers need are importable from here.
"""

from controller.policy.decision import Decision, PoolDecision
from controller.policy.models import CapacityModels
from controller.policy.pipeline import decide
from controller.policy.state import ControllerState, PoolState
from controller.policy.vocabulary import Reason, ReasonEntry, Stage

__all__ = [
    "CapacityModels",
    "ControllerState",
    "Decision",
    "PoolDecision",
    "PoolState",
    "Reason",
    "ReasonEntry",
    "Stage",
    "decide",
]
