"""A clip's video decode split by whole tiles, blended by diffusers' own code: the serial decode's frames, bit for bit.

In process: the tiles decoded in separate runs equal diffusers' ``vae.decode`` on the default canvas (temporal chunks)
and on canvases of several spatial tiles, fp32 and bf16. On a real Ray cluster: an ``H3Decoder`` deployment of two
replicas splits a clip between them (each decodes a share) and its frames and audio equal the serial decode's.
"""

import numpy as np
import pytest
import torch
from ray import serve

from h3serve.deploy.common.args import DeployArgs, StagesArgs
from h3serve.deploy.model_server.stage_deployments import H3Decoder
from h3serve.pipelines.h3 import GenerationRequest, H3StageModels, tiled_decode
from h3serve.replicas import ReplicaSpec


def two_way(vae):
    """A TileRunner that decodes the tiles in two separate runs, as two replicas would."""
    return lambda tiles: [t for run in tiled_decode.split(tiles, 2) for t in tiled_decode.decode_tiles(vae, run)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("latent_shape", "tiles"),
    [
        ((1, 8, 37, 4, 8), 7),  # the default 128x64 5 s clip: one spatial tile, 7 temporal chunks
        ((1, 8, 12, 20, 20), 8),  # 320x320: 2x2 spatial tiles, 2 chunks
        ((1, 8, 7, 20, 28), 4),  # 448x320: 2x2 tiles of unequal overlaps, 1 chunk
    ],
)
def test_tiles_decoded_apart_blend_to_diffusers_decode_bit_for_bit(vaes, dtype, latent_shape, tiles):
    vae = vaes[dtype]
    latents = torch.randn(latent_shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        serial = vae.decode(latents, return_dict=False)[0]
    assert len(tiled_decode.tiles_of(vae, tiled_decode.latents_for_decoder(vae, latents))) == tiles
    split = tiled_decode.decode(vae, latents, two_way(vae))
    assert split.dtype == serial.dtype and split.shape == serial.shape
    assert torch.equal(split, serial)


def test_a_wrong_decoded_tile_is_refused_not_blended(vaes):
    vae = vaes[torch.float32]
    latents = torch.randn(1, 8, 12, 4, 8)
    with pytest.raises(ValueError, match="came back"):
        tiled_decode.decode(vae, latents, lambda tiles: tiled_decode.decode_tiles(vae, tiles[1:]))
    with pytest.raises(ValueError, match="the blend expects"):
        tiled_decode.decode(
            vae, latents, lambda tiles: [torch.zeros(1, 3, 1, 16, 16), *tiled_decode.decode_tiles(vae, tiles[1:])]
        )


def test_split_keeps_the_order_and_balances():
    runs = tiled_decode.split(list(range(7)), 3)
    assert runs == [[0, 1, 2], [3, 4], [5, 6]]
    assert tiled_decode.split([1], 2) == [[1], []]


@pytest.fixture(scope="module")
def handoff(tiny_pipeline):
    state = tiny_pipeline.prepare(GenerationRequest(prompt="a red circle moving left", num_inference_steps=2, seed=4))
    while not state.done:
        tiny_pipeline.step([state])
    return tiny_pipeline.decode_handoff(state)


@pytest.fixture(scope="module")
def decoder(tiny_checkpoint):
    return H3StageModels.load("decoder", tiny_checkpoint)


def test_a_stage_decode_with_its_tiles_split_and_the_audio_beside_equals_the_serial_one(decoder, handoff):
    serial = decoder.decode(handoff)
    split = decoder.decode(handoff, decode_tiles=two_way(decoder.stages.after.vae))
    assert np.array_equal(split.frames, serial.frames)
    assert np.array_equal(split.audio, serial.audio)
    assert split.sample_rate == serial.sample_rate


def test_the_split_follows_the_decoder_replicas_unless_turned_off():
    assert StagesArgs.model_validate({"decoder": {"num_replicas": 3}}).decode_split() == 3
    assert StagesArgs.model_validate({"decoder": {"num_replicas": 3}, "parallel_decode": False}).decode_split() == 1
    assert StagesArgs().decode_split() == 1


@pytest.mark.ray
@pytest.mark.slow
def test_two_decoder_replicas_split_a_clip_and_make_the_serial_frames_bit_for_bit(
    ray_cluster, tiny_checkpoint, decoder, handoff
):
    """Two replicas of one slot each: one decode splits over both; two decodes at once (each replica busy with its
    own, each waiting on the other's slot) take their runs back and still make the serial frames."""
    args = DeployArgs(checkpoint=str(tiny_checkpoint), stages={"decoder": {"num_replicas": 2}})
    options = H3Decoder.deployment_options(args)
    options.update(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=1)
    app = serve.deployment(H3Decoder, **options).bind(str(tiny_checkpoint), "cpu", "float32", "float32", 2)
    name = "decode-split"
    handle = serve.run(app, name=name, route_prefix=None)
    serial = decoder.decode(handoff)  # this process: one torch thread, as each replica
    try:
        media = handle.decode.remote(handoff, None, "test").result(timeout_s=120)
        assert np.array_equal(media.frames, serial.frames)  # bit for bit
        assert np.array_equal(media.audio, serial.audio)
        tiles = reports(handle)
        assert sorted(tiles.values(), key=str) == [{"for_peers": 3}, {"own": 4}]  # 7 tiles: 4 here, 3 on the peer

        both = [handle.decode.remote(handoff, None, f"test-{i}") for i in range(2)]
        for media in [call.result(timeout_s=120) for call in both]:
            assert np.array_equal(media.frames, serial.frames)
        after = reports(handle)
        assert sum(t.get("own", 0) for t in after.values()) == 4 * 3
        assert sum(t.get("for_peers", 0) + t.get("taken_back", 0) for t in after.values()) >= 3 * 3
    finally:
        serve.delete(name)


def reports(handle) -> dict[str, dict[str, int]]:
    """Each replica's tile counts, by replica id (asked until both answered)."""
    seen: dict[str, dict[str, int]] = {}
    for _ in range(40):
        report = handle.report.remote().result(timeout_s=30)
        seen[report["replica_id"]] = report["tiles"]
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only {len(seen)} replica(s) answered")


@pytest.mark.ray
def test_a_replicas_own_ranks_split_its_decode_and_make_the_serial_frames_bit_for_bit(ray_cluster, tiny_checkpoint):
    """No decoder stage: with ``decode_on_ranks`` an sp=2 replica's worker also holds the video VAE and decodes a share
    of rank 0's clip tiles (7 tiles: 4 on rank 0, 3 on the worker), through the engine too; the frames and audio equal
    rank 0's serial decode bit for bit."""
    import asyncio

    from h3serve.replicas import Engine, WorkerGroup
    from tests.test_replicas import spec

    torch.set_num_threads(1)  # as the worker (one CPU's share): the same kernels, so the same bits (conftest restores)
    group = WorkerGroup.create(spec(2, tiny_checkpoint).model_copy(update={"decode_on_ranks": True}))
    try:
        pipeline = group.pipeline
        request = GenerationRequest(prompt="a red circle moving left", num_inference_steps=2, seed=4)
        state = pipeline.prepare(request)
        while not state.done:
            pipeline.step([state])
        serial = pipeline.decode(state)
        assert group.tiles_decoded == {}  # no runner given: rank 0 alone
        split = pipeline.decode(state, group.tile_runner())
        assert group.tiles_decoded == {"own": 4, "workers": 3}
        assert np.array_equal(split.frames, serial.frames)  # bit for bit
        assert np.array_equal(split.audio, serial.audio) and split.sample_rate == serial.sample_rate

        async def served():
            engine = Engine(group)
            try:
                return await engine.generate(request)
            finally:
                await engine.close()

        media = asyncio.run(served())
        assert group.tiles_decoded == {"own": 8, "workers": 6}  # the engine's decode was split as well
        assert np.array_equal(media.frames, serial.frames)
    finally:
        group.shutdown()


def test_decode_on_ranks_needs_the_vae_on_rank0():
    from tests.test_replicas import RESOLUTION

    with pytest.raises(ValueError, match="decode_on_ranks splits rank 0's own decode"):
        ReplicaSpec(
            resolution=RESOLUTION,
            checkpoint=None,
            model_name="x",
            num_heads=4,
            head_dim=32,
            num_layers=4,
            hidden_size=96,
            sp_degree=2,
            stages="remote",
            decode_on_ranks=True,
        )


def test_decode_on_ranks_is_refused_where_nothing_splits_and_the_workers_plan_hold_the_vae(tiny_checkpoint):
    from pydantic import ValidationError

    from h3serve.pipelines.h3.memory import memory_plan

    for fields in ({}, {"sp_degree": 2, "stages": {}}):  # one rank; or a decoder stage decodes
        with pytest.raises(ValidationError, match="decode_on_ranks splits rank 0's decode over its SP workers"):
            DeployArgs(decode_on_ranks=True, **fields)
    assert DeployArgs(decode_on_ranks=True, sp_degree=2).decode_on_ranks
    plan = memory_plan(
        model="tiny", checkpoint=str(tiny_checkpoint), dtype="float32", sp_degree=2, max_rows=1024, decode_on_ranks=True
    )
    rank0, workers = plan.ranks
    assert set(workers.weights) == {"transformer", "vae"} and workers.weights["vae"] == rank0.weights["vae"]
