"""What runs inside one Serve replica: the SP worker group and the step-level engine (no Serve here)."""

import importlib
from typing import TYPE_CHECKING

from .contract import (
    CANCEL_STAGES,
    FAILURE_REASONS,
    MAX_PRIORITY,
    MIN_PRIORITY,
    REQUEST_EVENTS,
    STAGES,
    DeadlineExceeded,
    EngineDraining,
    EngineLimits,
    EngineLoad,
    EngineStalled,
    EngineStopped,
    PreviewPolicy,
    QueueFull,
)
from .scheduler import POLICIES
from .spec import ReplicaSpec

# The engine and the worker group import torch and the model (seconds of CPU): imported when one of their names
# is first used, so that the ingress and the deploy args, which need only the contract above, start without them.
_LAZY = {
    "Engine": ".engine",
    "EngineObserver": ".progress",
    "EngineStats": ".progress",
    "StageClient": ".stage_worker",
    "StepBoundary": ".hooks",
    "StepGate": ".hooks",
    "Ticket": ".requests",
    "PackFailed": ".worker_group",
    "WorkerGroup": ".worker_group",
    "WorkerGroupBroken": ".worker_group",
}

if TYPE_CHECKING:
    from .engine import Engine
    from .hooks import StepBoundary, StepGate
    from .progress import EngineObserver, EngineStats
    from .requests import Ticket
    from .stage_worker import StageClient
    from .worker_group import PackFailed, WorkerGroup, WorkerGroupBroken


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # once: later lookups find it without this hook
    return value


__all__ = [
    "CANCEL_STAGES",
    "FAILURE_REASONS",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "POLICIES",
    "REQUEST_EVENTS",
    "STAGES",
    "DeadlineExceeded",
    "Engine",
    "EngineDraining",
    "EngineLimits",
    "EngineLoad",
    "EngineObserver",
    "EngineStalled",
    "EngineStats",
    "EngineStopped",
    "PackFailed",
    "PreviewPolicy",
    "QueueFull",
    "ReplicaSpec",
    "StageClient",
    "StepBoundary",
    "StepGate",
    "Ticket",
    "WorkerGroup",
    "WorkerGroupBroken",
]
