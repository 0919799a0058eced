"""The SP group's communicator, set up and torn down on purpose.

Set up: every rank joins with ``init_process_group`` (on CUDA with ``device_id``, so NCCL creates the communicator
eagerly rather than inside the first step's broadcast), then one one-element all-reduce, polled against the join's
deadline (``collective_timeout_s`` from the join's start): a communicator exists on every rank before the first step,
and a rank that never comes up fails the join, within its bound, instead of the first user's step.

NCCL's own error handling stays out of h3serve's way (``nccl_environment``):

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: h3serve aborts communicators itself (the step bound, then ``abort`` below);
  torch's watchdog aborting the same communicator concurrently (1, 2) or tearing the process down (3) races that, and
  torch's ``_abort_process_group`` is documented for 0. Another value is refused, not overridden quietly.
- ``TORCH_NCCL_ENABLE_MONITORING=0``: the heartbeat monitor ``std::abort()``s a process whose watchdog thread wedges,
  and rank 0 is the Serve replica: every request on it would die with no log line. h3serve's own bounds (the step
  bound, the abort deadline, the health ping) find a wedged rank and replace it. An operator who turns it on must set
  ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` above h3serve's bounds (``collective_timeout_s`` plus the abort deadline), or
  the rank is refused.
- ``NCCL_NVLS_ENABLE=0`` unless set: NVLink SHARP buffers cost GPU memory the plan does not count and help
  all-reduces h3serve does not run in a step (its collectives are all-to-alls, a broadcast and a gather).

Torn down: ``abort`` runs ``_abort_process_group`` on a daemon thread and waits for it within a deadline. With a dead
peer ``ncclCommAbort`` has hung in several NCCL releases; past the deadline the caller treats the process as
unrecoverable (a worker is killed and replaced, rank 0's replica fails its health).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, MutableMapping

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group  # torch 2.13: abort, world state cleared

logger = logging.getLogger(__name__)

ABORT_DEADLINE_S = 10.0  # how long an abort may take before its process is given up (WorkerGroup.abort_grace_s)
NCCL_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "0", "NCCL_NVLS_ENABLE": "0"}
HEARTBEAT = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
TORCH_HEARTBEAT_DEFAULT_S = 480.0  # torch's default, when monitoring is on and the variable unset


class JoinFailed(RuntimeError):
    """A rank's communicator did not come up within the join's bound (a peer never joined, or its first collective
    failed): the join is over, its process group aborted."""


class AbortTimedOut(RuntimeError):
    """A communicator's abort did not return within its deadline: its process cannot be trusted with another."""


def nccl_environment(
    collective_timeout_s: float, abort_deadline_s: float, env: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Set NCCL's and torch's NCCL variables in ``env`` (``os.environ``) before the process group is made, keeping an
    operator's own choices where they are safe, refusing those that fight h3serve's abort. Returns what is in force."""
    env = os.environ if env is None else env
    handling = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    if handling != "0":
        raise ValueError(
            f"TORCH_NCCL_ASYNC_ERROR_HANDLING={handling}: h3serve aborts NCCL communicators itself and needs 0 "
            "(torch's watchdog would abort the same communicators concurrently, or end the process)"
        )
    if env.get("TORCH_NCCL_ENABLE_MONITORING", "0") not in ("0", ""):
        heartbeat = float(env.get(HEARTBEAT, TORCH_HEARTBEAT_DEFAULT_S))
        needed = collective_timeout_s + abort_deadline_s
        if heartbeat <= needed:
            raise ValueError(
                f"TORCH_NCCL_ENABLE_MONITORING is on with {HEARTBEAT}={heartbeat:g}: the monitor would end a rank "
                f"(rank 0 is the replica) before h3serve's own bounds ({needed:g} s: collective_timeout_s plus the "
                "abort deadline) replace it; set it above that, or leave monitoring off"
            )
    for name, value in NCCL_DEFAULTS.items():
        env.setdefault(name, value)
    return {name: env[name] for name in (*NCCL_DEFAULTS, HEARTBEAT) if name in env}


def abort(deadline_s: float, before: Callable[[], None] | None = None) -> bool:
    """Abort this process's torch.distributed group (no collective; the world state cleared for a new one) on a daemon
    thread; whether it returned within ``deadline_s``. ``before``: run on that thread first (tests' faults)."""
    if not dist.is_initialized():
        return True
    failed: list[BaseException] = []

    def run() -> None:
        try:
            if before is not None:
                before()
            _abort_process_group()
        except BaseException as e:  # noqa: BLE001  # reported by the caller, never lost on a daemon thread
            failed.append(e)

    thread = threading.Thread(target=run, name="h3-nccl-abort", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        logger.error("the communicator's abort did not return within %g s: this process is given up", deadline_s)
        return False
    if failed:
        logger.error("the communicator's abort raised: %s: %s", type(failed[0]).__name__, failed[0])
        return False
    return True


def join(
    backend: str,
    master: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    device: torch.device,
    before_first_collective: Callable[[], None] | None = None,
) -> None:
    """Join the group at ``master`` and run its first collective, all within ``timeout_s``: JoinFailed otherwise (the
    group aborted). ``before_first_collective``: tests' faults, between the rendezvous and the all-reduce."""
    started = time.monotonic()
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,  # NCCL: the communicator is made here, eagerly
        )
    except Exception as e:  # the rendezvous (a peer that never came) or the communicator's creation
        raise JoinFailed(f"rank {rank}: the SP group at {master} did not come up: {type(e).__name__}: {e}") from e
    try:
        if before_first_collective is not None:
            before_first_collective()
        probe = torch.ones(1, device=device)
        work = dist.all_reduce(probe, async_op=True)
        deadline = started + timeout_s
        while not work.is_completed():  # polled: a NCCL work's wait() would block past any deadline of ours
            if time.monotonic() > deadline:
                raise TimeoutError(f"its first all-reduce did not finish within {timeout_s:g} s of the join")
            time.sleep(0.001)
        work.wait()  # raises the collective's own error, if it failed
        if probe.item() != world_size:
            raise RuntimeError(f"its first all-reduce gave {probe.item()}, not {world_size}")
    except Exception as e:
        abort(ABORT_DEADLINE_S)
        raise JoinFailed(f"rank {rank}: the SP group at {master} did not come up: {type(e).__name__}: {e}") from e
