"""What runs inside one Serve replica: the SP worker group and the step-level engine (no Serve here)."""

from .engine import Engine, EngineLimits, EngineObserver, EngineStopped, QueueFull, Ticket
from .spec import ReplicaSpec
from .worker_group import WorkerGroup, WorkerGroupBroken

__all__ = [
    "Engine",
    "EngineLimits",
    "EngineObserver",
    "EngineStopped",
    "QueueFull",
    "ReplicaSpec",
    "Ticket",
    "WorkerGroup",
    "WorkerGroupBroken",
]
