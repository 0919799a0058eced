"""A stage deployment whose device is poisoned (issue 53): a real H3Decoder replica under Serve (the tiny checkpoint
on the CPU), a CUDA-fatal error injected where a real one surfaces in it (the first device op on the rows a denoiser
handed over: a ``torch.AcceleratorError``, once), then Serve's own health checks.

The call that hit it raises ``ProcessPoisoned`` (a call the denoiser makes again, never the request's own failure),
the replica refuses the calls it still gets, fails its health check, and Serve replaces it; the replacement decodes
the same hand-over as the local pipeline does.
"""

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from ray import serve

from h3serve.deploy.common.args import DeployArgs
from h3serve.deploy.model_server.stage_client import ServeStages, _replica_lost
from h3serve.deploy.model_server.stage_deployments import H3Decoder
from h3serve.pipelines.h3 import DecodeHandoff, GenerationRequest, H3StageModels
from h3serve.replicas.cuda_faults import ProcessPoisoned
from tests.harness import wait_for

pytestmark = [pytest.mark.ray]
APP = "poisoned-decoder"
HEALTH_PERIOD_S = 1.0
# Serve replaces a replica after REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD (3) failed checks, one a period; then the
# new one starts and loads the tiny VAEs on 2 shared cores
REPLACED_WITHIN_S = 90.0


def poisoned_once(rows: torch.Tensor, ledger: Path) -> torch.Tensor:
    """``rows`` whose first ``.to`` in any process raises what torch raises for an illegal address (once: ``ledger``
    records it), as a copy onto a device whose context a fault poisoned does."""

    class OnPoisonedDevice(torch.Tensor):  # defined here: Ray ships it by value (the stage needs no tests package)
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "to" and not ledger.exists():
                from h3serve.replicas.cuda_faults import InjectedDeviceError

                ledger.write_text("fired")
                raise InjectedDeviceError("CUDA error: an illegal memory access was encountered (injected)")
            return super().__torch_function__(func, types, args, kwargs or {})

    return rows.as_subclass(OnPoisonedDevice)


def report(handle) -> dict:
    return handle.report.remote().result(timeout_s=60)


def test_a_cuda_fatal_error_in_a_stage_poisons_its_replica_not_the_request(
    ray_cluster, tiny_checkpoint, tiny_pipeline, tmp_path
):
    args = DeployArgs(stages={"decoder": {"ray_actor_options": {"num_cpus": 0.2}}})
    options = {**H3Decoder.deployment_options(args), "health_check_period_s": HEALTH_PERIOD_S}
    app = serve.deployment(H3Decoder, **options).bind(str(tiny_checkpoint), "cpu", "float32")
    handle = serve.run(app, name=APP, route_prefix=None)
    try:
        request = GenerationRequest(prompt="a kite", num_inference_steps=2, seed=1, width=64, height=64)
        clean = tiny_pipeline.decode_handoff(tiny_pipeline.prepare(request))
        poisoned = DecodeHandoff(poisoned_once(clean.video_rows, tmp_path / "fired"), clean.audio_rows, clean.layout)
        first = report(handle)
        assert first["poisoned"] is None

        with pytest.raises(ray.exceptions.RayTaskError) as raised:  # the call as a denoiser's ServeStages makes it
            handle.decode.remote(poisoned, None, "test").result(timeout_s=60)
        assert isinstance(raised.value.cause, ProcessPoisoned), raised.value
        assert "hit a CUDA-fatal error: InjectedDeviceError: CUDA error" in str(raised.value.cause)
        assert _replica_lost(raised.value)  # a denoiser makes it again elsewhere: never the request's failure
        assert (tmp_path / "fired").read_text() == "fired"

        hit = time.monotonic()
        now = report(handle)  # report() still answers, health does not
        assert now["replica_id"] == first["replica_id"], "replaced before 3 health checks could fail"
        assert "InjectedDeviceError" in now["poisoned"] and now["failures"] == 1
        with pytest.raises(ray.exceptions.RayTaskError, match="is poisoned"):  # refused: it serves nothing more
            handle.decode.remote(clean, None, "test").result(timeout_s=60)

        def replaced():
            try:
                r = handle.report.remote().result(timeout_s=10)
            except (ray.exceptions.RayError, TimeoutError):  # the poisoned replica going, its successor loading
                return False
            return r["replica_id"] != first["replica_id"] and r

        fresh = wait_for(replaced, timeout=REPLACED_WITHIN_S, what="Serve to replace the poisoned decoder replica")
        print(f"poisoned decoder replica replaced {time.monotonic() - hit:.1f} s after the fault")
        assert fresh["poisoned"] is None and fresh["failures"] == 0

        # the request's hand-over, made again through the denoiser's client, decodes on the replacement as locally
        stages = ServeStages(handle, handle, "test")  # type: ignore[arg-type]  # the handle's decode
        media = asyncio.run(stages.decode(poisoned, None))
        local = H3StageModels.load("decoder", str(tiny_checkpoint), device="cpu", dtype="float32").decode(clean)
        assert np.array_equal(media.frames, local.frames) and np.array_equal(media.audio, local.audio)
    finally:
        serve.delete(APP)
