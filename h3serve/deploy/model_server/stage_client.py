"""The engine's ``StageClient`` over the stage deployments' Serve handles: a call whose stage replica died is made
again on a live one."""

from __future__ import annotations

import collections
import logging

import ray
from ray.serve.handle import DeploymentHandle

from h3serve.deploy.common.errors import StageUnavailable
from h3serve.deploy.common.metrics import EngineMetrics
from h3serve.deploy.common.retry import Backoff, retry
from h3serve.pipelines.h3 import DecodeHandoff, EncodedMedia, GeneratedMedia, GenerationRequest, PreparedState
from h3serve.replicas.cuda_faults import ProcessPoisoned

logger = logging.getLogger(__name__)
# a stage call whose replica died under it is made again, on a live replica, up to this many calls in all; the
# waits between them double from the first to the second (Serve's router meanwhile drops the dead replica)
STAGE_ATTEMPTS = 3
STAGE_BACKOFF = Backoff(first_s=1.0, max_s=5.0, attempts=STAGE_ATTEMPTS)
# the stage replica (not the stage's code) failed: its actor died or is unreachable, or its result was lost
# with its node
STAGE_REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)


class ServeStages:
    """The engine's ``StageClient`` over the stage deployments' handles
    (``h3serve/deploy/model_server/stage_deployments.py``); ``caller`` is this H3Replica's replica id, which the stages
    count their work by.

    A call whose stage replica died under it (``STAGE_REPLICA_LOST``: Ray's actor-died or actor-unavailable error,
    or its result lost with its node) is made again: Serve's router has dropped the dead replica, so the call
    goes to another live replica, or waits for the one Serve starts in its place. At most ``STAGE_ATTEMPTS`` calls
    in all, ``STAGE_BACKOFF`` apart; then ``StageUnavailable``. The stage's own exception (a request it
    refuses) is never retried. Each retry is logged and counted by stage (``retries``, and the observer's
    ``on_stage_retry``). The arguments stay here until a call returns: a redone decode gets the same finished
    latents, so no denoising is ever repeated."""

    def __init__(
        self,
        conditioner: DeploymentHandle,
        decoder: DeploymentHandle,
        caller: str,
        observer: EngineMetrics | None = None,
    ):
        self.conditioner, self.decoder, self.caller, self.observer = conditioner, decoder, caller, observer
        self.retries: collections.Counter[str] = collections.Counter()  # stage -> calls made again

    async def prepare(self, request: GenerationRequest, shift: float | None) -> PreparedState:
        return await self._call("conditioner", self.conditioner.prepare, request, shift)

    async def decode(self, handoff: DecodeHandoff, output: str | None) -> GeneratedMedia | EncodedMedia:
        return await self._call("decoder", self.decoder.decode, handoff, output)

    async def _call(self, stage: str, method, *args):
        def again(error: Exception, attempt: int, wait_s: float) -> None:
            logger.warning(
                "the %s stage's replica died under a call (attempt %d of %d, %s: %s); making it again on a live "
                "replica in %.1f s",
                stage,
                attempt,
                STAGE_ATTEMPTS,
                type(error).__name__,
                (str(error).splitlines() or [""])[0],
                wait_s,
            )
            self.retries[stage] += 1
            if self.observer is not None:
                self.observer.on_stage_retry(stage)

        lost: Exception
        try:
            return await retry(lambda: method.remote(*args, self.caller), STAGE_BACKOFF, _replica_lost, again)
        except ray.exceptions.RayTaskError as e:  # first: the stage's own exception, whatever its type
            if not isinstance(e.cause, ProcessPoisoned):
                raise _stage_error(e) from None
            lost = e.cause  # a poisoned replica on every attempt: as if it had died
        except STAGE_REPLICA_LOST as e:  # on every attempt
            lost = e
        logger.error("the %s stage's replica died under this call %d times: giving up", stage, STAGE_ATTEMPTS)
        raise StageUnavailable(
            stage,
            f"the {stage} stage's replica died under this request {STAGE_ATTEMPTS} times in a row "
            f"(last: {type(lost).__name__}); no live {stage} replica finished it",
        ) from lost


def _replica_lost(error: Exception) -> bool:
    """A call to make again: its stage replica failed, not the stage's code (whose exception is a RayTaskError), or
    the replica's device is poisoned (``ProcessPoisoned``: a CUDA-fatal error there; Serve replaces it)."""
    if isinstance(error, ray.exceptions.RayTaskError):
        return isinstance(error.cause, ProcessPoisoned)
    return isinstance(error, STAGE_REPLICA_LOST)


def _stage_error(error: ray.exceptions.RayTaskError) -> Exception:
    """The stage's own exception (a RequestError stays one, as if it had run in process); the wrapper when its
    cause is not an ordinary exception."""
    cause = error.cause
    return cause if isinstance(cause, Exception) else error
