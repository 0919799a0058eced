"""What runs inside one Serve replica: the SP worker group and the step-level engine (no Serve here)."""

from .engine import (
    FAILURE_REASONS,
    MAX_PRIORITY,
    MIN_PRIORITY,
    POLICIES,
    STAGES,
    DeadlineExceeded,
    Engine,
    EngineDraining,
    EngineLimits,
    EngineObserver,
    EngineStalled,
    EngineStats,
    EngineStopped,
    QueueFull,
    StageClient,
    StepBoundary,
    StepGate,
    Ticket,
)
from .spec import ReplicaSpec
from .worker_group import PackFailed, WorkerGroup, WorkerGroupBroken

__all__ = [
    "FAILURE_REASONS",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "POLICIES",
    "STAGES",
    "DeadlineExceeded",
    "Engine",
    "EngineDraining",
    "EngineLimits",
    "EngineObserver",
    "EngineStalled",
    "EngineStats",
    "EngineStopped",
    "PackFailed",
    "QueueFull",
    "ReplicaSpec",
    "StageClient",
    "StepBoundary",
    "StepGate",
    "Ticket",
    "WorkerGroup",
    "WorkerGroupBroken",
]
