"""CUDA-fatal errors: what poisons the process that raised them, and a health ping that launches real work.

A device-side assert, an illegal address or an Xid leaves the CUDA context of the process unusable: every later CUDA
call in it fails, so the error says nothing about the pack's data, and bisecting the pack only fails each request in
turn. Such an error is the process's: a worker rank that raised one is lost (killed, a new actor takes its bundle),
rank 0 marks the replica unrecoverable (health fails, Serve replaces it), and the pack's requests run again (on the
new group; on rank 0, on another replica after a 503), never failed as bad data.

``fatal`` is the one classifier, a table of types and of message fragments torch puts in the RuntimeErrors it raises
from CUDA and NCCL calls. An error from another process (a Ray task's error re-raised here, which Ray makes an
instance of its cause's type too) is that process's, never this one's.
"""

from __future__ import annotations

import re
import time

import torch
import torch.distributed as dist
from ray.exceptions import RayError

# (type, message pattern or None): the first row whose type matches and whose pattern is found (None: any message).
# torch.AcceleratorError is what torch 2.8+ raises for a failed CUDA call (cudaErrorIllegalAddress, a device-side
# assert, ECC, launch failures); DistBackendError for NCCL's own failures (ncclUnhandledCudaError, a remote error);
# older paths raise plain RuntimeErrors with these texts.
FATAL: tuple[tuple[type[BaseException], re.Pattern[str] | None], ...] = (
    (torch.AcceleratorError, None),
    (dist.DistBackendError, None),
    (RuntimeError, re.compile(r"CUDA error|device-side assert|illegal memory access|CUBLAS_STATUS_EXECUTION_FAILED")),
    (RuntimeError, re.compile(r"NCCL (error|Error)|ncclUnhandledCudaError|ncclSystemError|ncclInternalError")),
)
# Never fatal, checked first: an out-of-memory is the pack's (cudaErrorMemoryAllocation is not sticky), and an error a
# rank raises after its own communicator was aborted is h3serve's abort, not a fault of the process.
NOT_FATAL = re.compile(r"out of memory|communicator was aborted|Communicator was aborted|aborted on rank")


def fatal(error: BaseException) -> str | None:
    """Why ``error`` is fatal to this process (its type and message, one line), or None."""
    if isinstance(error, RayError) or isinstance(error, torch.OutOfMemoryError):
        return None
    text = str(error)
    if NOT_FATAL.search(text):
        return None
    for kind, pattern in FATAL:
        if isinstance(error, kind) and (pattern is None or pattern.search(text)):
            return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
    return None


class ProcessPoisoned(RuntimeError):
    """This process hit a CUDA-fatal error: it serves nothing more until it is replaced. A caller in another process
    makes the call again elsewhere (as for a process that died under it); never the request's own failure."""


class DeviceUnhealthy(RuntimeError):
    """This process's device did not run a tiny kernel within the ping's deadline (or it raised)."""


_PING_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def device_ping(device: torch.device, timeout_s: float) -> None:
    """Launch a tiny kernel on ``device`` and wait for it within ``timeout_s`` (an event polled, so a hung device does
    not hang the caller). On a side stream: it must not queue behind a running step's kernels. A poisoned context
    raises at the launch; a wedged device misses the deadline. On CPU the same path runs a CPU op."""
    if device.type != "cuda":
        probe = torch.ones(1, device=device).add_(1)
        if probe.item() != 2.0:
            raise DeviceUnhealthy(f"{device}: 1 + 1 gave {probe.item()}")
        return
    stream = _PING_STREAMS.get(device)
    if stream is None:  # its own high-priority stream: a pool stream may be the stage worker's, behind a VAE decode
        stream = _PING_STREAMS[device] = torch.cuda.Stream(device=device, priority=-1)
    with torch.cuda.stream(stream):
        probe = torch.ones(1, device=device).add_(1)
        done = torch.cuda.Event()
        done.record(stream)
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            raise DeviceUnhealthy(f"{device}: a one-element kernel did not finish within {timeout_s:g} s")
        time.sleep(0.001)
    if probe.item() != 2.0:
        raise DeviceUnhealthy(f"{device}: 1 + 1 gave {probe.item()}")


class InjectedDeviceError(torch.AcceleratorError):
    """What an injected CUDA-fatal fault raises (``h3serve.replicas.faults``): the type torch raises for an illegal
    address or a device-side assert, so the classifier is tested on the real type."""
