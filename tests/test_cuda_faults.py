"""CUDA-fatal classification, NCCL's environment, the bounded join and abort: the parts that need no Ray.

The fault matrix (tests/test_sp_fault_matrix.py, tests/test_worker_group_faults.py, tests/test_engine_faults.py) runs
the same faults through real ranks; here each piece is held to its table and its bound in this process.
"""

import threading
import time

import pytest
import torch
import torch.distributed as dist
from ray.exceptions import RayTaskError

from h3serve.replicas import nccl
from h3serve.replicas.cuda_faults import InjectedDeviceError, device_ping, fatal
from h3serve.replicas.faults import Fault, FaultInjector, InjectedFault
from h3serve.replicas.worker_group import free_port


def remote(cause: Exception) -> Exception:
    """``cause`` as Ray re-raises it in another process: an instance of its type too."""
    return RayTaskError("forward", "Traceback ...", cause).as_instanceof_cause()


@pytest.mark.parametrize(
    "error, is_fatal",
    [
        (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True),
        (InjectedDeviceError("CUDA error: unspecified launch failure"), True),
        (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, unhandled cuda error"), True),
        (RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA"), True),
        (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"), True),
        (RuntimeError("NCCL Error 1: unhandled cuda error (run with NCCL_DEBUG=INFO for details)"), True),
        # the pack's problems, or h3serve's own abort: never the process's
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("CUDA error: out of memory"), False),
        (dist.DistBackendError("NCCL communicator was aborted on rank 1."), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"), False),
        (IndexError("index 1000 is out of bounds for dimension 0 with size 9"), False),
        (InjectedFault("injected fault: raise on rank 1 at final_gather"), False),
        # raised in another process (a stage deployment): that process's, not this one's
        (remote(torch.AcceleratorError("CUDA error: an illegal memory access was encountered")), False),
    ],
    ids=lambda v: v if isinstance(v, bool) else f"{type(v).__name__}:{str(v)[:30]}",
)
def test_the_classifier_table(error, is_fatal):
    why = fatal(error)
    assert (why is not None) == is_fatal, why
    if is_fatal:
        assert why.startswith(type(error).__name__) and "\n" not in why


def test_nccl_environment_sets_h3serve_s_choices_and_refuses_what_fights_its_abort():
    env: dict[str, str] = {}
    assert nccl.nccl_environment(300, 10, env) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "NCCL_NVLS_ENABLE": "0",
    }
    assert nccl.nccl_environment(300, 10, {"NCCL_NVLS_ENABLE": "1"})["NCCL_NVLS_ENABLE"] == "1"  # measured: kept
    for handling in ("1", "2", "3"):
        with pytest.raises(ValueError, match=f"TORCH_NCCL_ASYNC_ERROR_HANDLING={handling}: h3serve aborts"):
            nccl.nccl_environment(300, 10, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": handling})
    # monitoring on: its heartbeat must outlast h3serve's own bounds (torch's default 480 s does, for 300 + 10)
    kept = nccl.nccl_environment(300, 10, {"TORCH_NCCL_ENABLE_MONITORING": "1"})
    assert kept["TORCH_NCCL_ENABLE_MONITORING"] == "1"
    with pytest.raises(ValueError, match=r"HEARTBEAT_TIMEOUT_SEC=300.*\(310 s"):
        nccl.nccl_environment(300, 10, {"TORCH_NCCL_ENABLE_MONITORING": "1", nccl.HEARTBEAT: "300"})


def test_device_ping_runs_a_real_op_on_the_cpu():
    started = time.perf_counter()
    device_ping(torch.device("cpu"), 1.0)
    assert time.perf_counter() - started < 1.0


def test_faults_for_the_new_points_and_actions():
    with pytest.raises(ValueError, match="only 'freeze'"):
        Fault(0, "abort", "hang")
    with pytest.raises(ValueError, match="does not fit point 'join'"):
        Fault(1, "join", "cuda_fatal")
    faults = FaultInjector(1)
    faults.arm(Fault(1, "final_gather", "cuda_fatal"))
    with pytest.raises(InjectedDeviceError) as raised:
        faults.at("final_gather")
    assert fatal(raised.value) is not None
    faults.arm(Fault(1, "between_all_to_alls", "cuda_fatal_late", block=0))
    faults.at("between_all_to_alls", block=0)  # nothing yet: the kernels "ran"
    with pytest.raises(InjectedDeviceError, match="surfacing at sync"):
        faults.sync()
    faults.sync()  # once


def test_a_rank_that_never_comes_up_fails_the_join_within_its_bound():
    started = time.monotonic()
    with pytest.raises(nccl.JoinFailed, match=r"rank 0: the SP group at .* did not come up: .*1/2 clients joined"):
        nccl.join("gloo", f"127.0.0.1:{free_port()}", 0, 2, 1.0, torch.device("cpu"))
    assert time.monotonic() - started < 1.0 + 2.0  # the bound, and the store's own poll
    assert not dist.is_initialized()


def test_an_abort_that_does_not_return_is_given_up_at_its_deadline_and_a_later_abort_ends_the_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    release = threading.Event()

    def stuck():  # as ncclCommAbort with a dead peer has hung
        release.wait(30)
        raise InjectedFault("the abort was stuck")

    try:
        started = time.monotonic()
        assert nccl.abort(0.5, before=stuck) is False
        assert 0.5 <= time.monotonic() - started < 1.5
        assert dist.is_initialized()  # the stuck abort never reached the group
    finally:
        release.set()
        assert nccl.abort(5.0) is True
    assert not dist.is_initialized()
