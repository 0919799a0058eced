"""Conditioner and decoder stage deployments, shared by every H3Replica (issue 27; ``args.stages``).

The builder binds ``H3Conditioner`` and ``H3Decoder`` beside ``H3Replica`` when the deploy args have a
``stages`` section, and passes their handles to every H3Replica. Its engine then hands each request over:
``H3Conditioner.prepare`` returns the request's prepared state (``PreparedState``: host tensors, through the
object store), the denoiser steps it in its packs, and ``H3Decoder.decode`` gets its latents rows
(``DecodeHandoff``) and returns the PNG/MP4 bytes. The client sees one request. A stage's error is the
request's error (a RequestError stays one, an HTTP 400), never retried. A stage replica that dies fails no
request and never the H3Replica: Serve replaces it, and each H3Replica makes the calls it had in flight there
again (``h3serve.deploy.model_server.stage_client.ServeStages``), on another live replica or on the replacement once it
is up, up to ``STAGE_ATTEMPTS`` calls in all, counted in ``h3serve_stage_retries`` by stage. The denoiser holds a
request's finished latents until its decode returns, so a redone decode repeats no denoising; a redone prepare repeats
only the prepare. Every H3Replica's rank 0 then loads none of these models
(``ReplicaSpec.stages`` "remote": the transformer partitions and the tokenizer only), and admission checks
each stage's memory plan beside the denoiser's ranks (``h3serve/pipelines/h3/memory.py``).

Each stage counts what it served per caller (``report``): the calling H3Replica's replica id, and the calls it
is working on now.

A CUDA-fatal error in a stage call (``h3serve.replicas.cuda_faults.fatal``: an illegal address, a device-side assert,
an Xid) is the process's, not the request's: the replica marks itself poisoned, its health check fails from then on
(Serve replaces it), every call it still gets is refused, and the call raises ``ProcessPoisoned``, which each
H3Replica makes again on another replica like a call whose replica died, never a failure of the request's own.
The health check also launches a one-element kernel on the stage's device within a deadline
(``cuda_faults.device_ping``): a wedged or poisoned device fails it even when no call noticed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from ray import serve

from h3serve.deploy.common.args import DeployArgs, StageDeploymentArgs
from h3serve.deploy.common.serve_logging import log_through_serve
from h3serve.pipelines.h3 import (
    DecodeHandoff,
    EncodedMedia,
    GeneratedMedia,
    GenerationRequest,
    H3StageModels,
    PreparedState,
    tiled_decode,
)
from h3serve.pipelines.h3.preview import PreviewMap
from h3serve.replicas.allocator import cuda_allocator_defaults
from h3serve.replicas.cuda_faults import ProcessPoisoned, device_ping, fatal

logger = logging.getLogger(__name__)
HEALTH_PING_S = 2.5  # the health check's kernel deadline: within Serve's health_check_timeout_s (30 s by default)

PEER_GRACE_FLOOR_S = 2.0  # the least a splitting decode waits on a peer's run before decoding it itself


class StageReplica:
    """What both stages share: the models of one role, loaded once, and counters by caller."""

    role = ""

    @classmethod
    def deployment_options(cls, args: DeployArgs) -> dict[str, Any]:
        stage: StageDeploymentArgs = args.stage_deployments()[cls.role]
        return dict(
            name=cls.__name__,
            num_replicas=stage.num_replicas,
            ray_actor_options=stage.ray_actor_options,
            max_ongoing_requests=stage.max_ongoing_requests,
            health_check_period_s=5,
        )

    def __init__(self, checkpoint: str | None, device: str, dtype: str, vae_dtype: str | None = None):
        log_through_serve()
        cuda_allocator_defaults(device)  # a VAE decode's transients vary with the clip as a pack's do
        self.models = H3StageModels.load(
            self.role,
            checkpoint,
            device=device,  # type: ignore[arg-type]
            dtype=dtype,
            vae_dtype=vae_dtype,
        )
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.calls: collections.Counter[str] = collections.Counter()  # caller's replica id -> requests served
        self.failures = 0
        self.ongoing = 0  # calls running now (report() is answered while they run)
        self.poisoned: str | None = None  # a call hit a CUDA-fatal error: why (this process serves nothing more)
        logger.info("%s stage ready (replica %s)", self.role, self.replica_id)

    def report(self) -> dict[str, Any]:
        """This stage replica's id, the requests it served by calling H3Replica, how many failed, and how many
        it is working on now."""
        return {
            "replica_id": self.replica_id,
            "calls": dict(self.calls),
            "failures": self.failures,
            "ongoing": self.ongoing,
            "poisoned": self.poisoned,
        }

    def check_health(self) -> None:
        """Serve's health check: fails once a call poisoned this process, or when the device does not run a tiny
        kernel within ``HEALTH_PING_S``; Serve then replaces the replica."""
        if self.poisoned is not None:
            raise ProcessPoisoned(f"{self.role} stage replica {self.replica_id} is poisoned: {self.poisoned}")
        device_ping(self.models.device, HEALTH_PING_S)

    async def _run(self, caller: str, what: str, fn, *args):
        if self.poisoned is not None:  # until Serve replaces it: the caller makes the call again elsewhere
            raise ProcessPoisoned(f"{self.role} stage replica {self.replica_id} is poisoned: {self.poisoned}")
        self.calls[caller] += 1
        started = time.perf_counter()
        self.ongoing += 1
        try:
            result = await asyncio.to_thread(fn, *args)  # off the event loop: report() and health stay answered
        except Exception as e:
            self.failures += 1
            why = fatal(e)
            if why is not None:  # the device is poisoned, not the request: it runs again on another replica
                self.poisoned = why
                logger.error(
                    "%s for %s hit a CUDA-fatal error: this %s stage replica is poisoned, fails its health check "
                    "and is replaced: %s",
                    what,
                    caller,
                    self.role,
                    why,
                )
                raise ProcessPoisoned(
                    f"{self.role} stage replica {self.replica_id} hit a CUDA-fatal error: {why}"
                ) from None
            logger.warning("%s for %s failed", what, caller, exc_info=True)
            raise
        finally:
            self.ongoing -= 1
        logger.info("%s for %s in %.2f s", what, caller, time.perf_counter() - started)
        return result


class H3Conditioner(StageReplica):
    """Tokenizer, processor, text encoder, VAE encoders and diffusers' blocks before the loop; no transformer."""

    role = "conditioner"

    async def prepare(self, request: GenerationRequest, shift: float | None, caller: str) -> PreparedState:
        return await self._run(caller, "prepare", self.models.prepare, request, shift)

    async def fit_preview(self, caller: str) -> PreviewMap:
        """The video VAE's latent -> RGB preview map, for a denoiser (which holds no VAE) when it loads."""
        return await self._run(caller, "preview map fit", self.models.fit_preview)


class H3Decoder(StageReplica):
    """Both VAE decoders, diffusers' blocks after the loop and the PNG/MP4 encoding; no transformer.

    With ``decode_split`` > 1 (``stages.parallel_decode`` and several replicas) a clip's video decode is split by
    whole tiles (every temporal chunk's spatial tiles, ``h3serve.pipelines.h3.tiled_decode``) into ``decode_split``
    runs: this replica decodes the first, the others go to this deployment's replicas through its own handle (Serve
    routes each to the less busy of two it samples: an idle peer over this busy replica), and diffusers' own blend
    joins them, the same frames bit for bit. The audio decoder runs beside them here. A run a peer has not returned
    by the time this replica's own run took again (the peer is busy with a decode of its own, perhaps waiting on this
    one) is cancelled and decoded here, as is a run whose peer failed: two splitting decodes never wait on each
    other, a busy pool decodes as it would serially plus that wait, and a lost peer costs a clip no frame.
    """

    role = "decoder"

    def __init__(
        self,
        checkpoint: str | None,
        device: str,
        dtype: str,
        vae_dtype: str | None = None,
        decode_split: int = 1,
    ):
        super().__init__(checkpoint, device, dtype, vae_dtype)
        self.decode_split = decode_split
        # tiles decoded, by whose clip: "own", "for_peers" (runs peers sent), "taken_back" (runs no peer returned)
        self.tiles_decoded: collections.Counter[str] = collections.Counter()
        self._peers: Any = None  # this deployment's handle, once a decode splits

    def report(self) -> dict[str, Any]:
        return {**super().report(), "tiles": dict(self.tiles_decoded)}

    async def decode(self, handoff: DecodeHandoff, output: str | None, caller: str) -> GeneratedMedia | EncodedMedia:
        if self.decode_split < 2:
            return await self._run(caller, "decode", self.models.decode, handoff, output)
        what = f"decode split {self.decode_split} ways"
        return await self._run(caller, what, self.models.decode, handoff, output, self._split_runner())

    async def decode_tiles(self, tiles: list, caller: str) -> list:
        """A run of another replica's clip tiles (``H3StageModels.decode_tiles``)."""
        decoded = await self._run(caller, f"{len(tiles)} tiles", self.models.decode_tiles, tiles)
        self.tiles_decoded["for_peers"] += len(tiles)
        return decoded

    def _split_runner(self):
        """A ``TileRunner`` for one decode (it runs on the decode's thread): the first run of tiles here, the
        others through this deployment's handle, all at once."""
        if self._peers is None:
            context = serve.get_replica_context()
            self._peers = serve.get_deployment_handle(context.deployment, app_name=context.app_name)

        def run_tiles(tiles: list) -> list:
            own, *others = tiled_decode.split(tiles, self.decode_split)
            calls = [(run, self._peers.decode_tiles.remote(run, self.replica_id)) for run in others if run]
            started = time.perf_counter()
            decoded = self.models.decode_tiles(own)
            self.tiles_decoded["own"] += len(own)
            # a peer that took its run at once is done by about then (the floor: a call's own latency on tiny clips)
            deadline = time.perf_counter() + max(time.perf_counter() - started, PEER_GRACE_FLOOR_S)
            for run, call in calls:  # each a DeploymentResponse: waiting blocks this thread, not the event loop
                try:
                    decoded.extend(call.result(timeout_s=max(deadline - time.perf_counter(), 0.0)))
                    continue
                except TimeoutError:
                    call.cancel()
                    why = "was not back in time"
                except Exception as e:  # the peer died under it, or failed: its tiles are decoded here all the same
                    why = f"failed ({type(e).__name__}: {e})"
                logger.info("a peer's run of %d tiles %s: decoding them here", len(run), why)
                decoded.extend(self.models.decode_tiles(run))
                self.tiles_decoded["taken_back"] += len(run)
            return decoded

        return run_tiles
