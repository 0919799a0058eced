"""Remix and extend over real HTTP against the session's `h3serve serve` (``served_apps._derived_apps``: tenants alpha
and beta, one request in the pack at a time). A derived clip is compared frame for frame with the request it stands
for sent to POST /v1/videos: extend is FL2VA from the source's last frame (decoded here with PyAV from the source's
MP4, independently of the server), remix the source's seed and settings with the new prompt."""

import asyncio
import io
import os
import subprocess

import av
import numpy as np
import pytest
from PIL import Image

from tests.harness import H3SERVE, client, error_of, wait_video
from tests.served_apps import DERIVED_KEYS

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
P = "/derived"


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer {DERIVED_KEYS[tenant]}"}


@pytest.fixture(scope="module")
def server(served):
    with served.module(__name__) as app:
        yield app


def completed(http, response, tenant: str = "alpha") -> dict:
    assert response.status_code == 200, response.text
    job = wait_video(http, response.json()["id"], headers=auth(tenant), prefix=P)
    assert job["status"] == "completed", job
    return job


def frames(http, video_id: str, tenant: str = "alpha") -> np.ndarray:
    """The clip's frames, [N, H, W, 3] uint8, as PyAV decodes its MP4."""
    mp4 = http.get(f"{P}/v1/videos/{video_id}/content", headers=auth(tenant))
    assert mp4.status_code == 200, mp4.text
    with av.open(io.BytesIO(mp4.content)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def png(frame: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def source(server):
    """alpha's completed clip (seed 7, 2 steps) every test derives from."""
    with client(server.root) as http:
        body = {"prompt": "a red circle drifts left", "seed": 7, "num_inference_steps": 2}
        return completed(http, http.post(f"{P}/v1/videos", json=body, headers=auth("alpha")))


def test_extend_is_fl2va_from_the_source_last_frame_and_links_its_source(server, source):
    with client(server.root) as http:
        response = http.post(
            f"{P}/v1/videos/{source['id']}/extend", json={"prompt": "it bounces"}, headers=auth("alpha")
        )
        assert response.json()["extended_from_video_id"] == source["id"]
        extension = completed(http, response)
        assert extension["extended_from_video_id"] == source["id"] and extension["prompt"] == "it bounces"
        assert (extension["size"], extension["seconds"]) == (source["size"], source["seconds"])
        last = frames(http, source["id"])[-1]  # [H, W, 3]
        height, width, _ = last.shape
        direct = {"prompt": "it bounces", "seed": 7, "num_inference_steps": 2, "size": f"{width}x{height}"}
        files = {"input_reference": ("last.png", png(last), "image/png")}
        fl2va = http.post(
            f"{P}/v1/videos", data={k: str(v) for k, v in direct.items()}, files=files, headers=auth("alpha")
        )
        fl2va = completed(http, fl2va)
        ours, theirs = frames(http, extension["id"]), frames(http, fl2va["id"])
        assert ours.shape == theirs.shape and ours.shape[1:] == last.shape
        assert np.array_equal(ours, theirs)  # the same request: FL2VA from exactly the source's decoded last frame
        # and a keyframe matters here: the same prompt from another first frame is another clip
        other = {"input_reference": ("other.png", png(255 - last), "image/png")}
        shifted = http.post(
            f"{P}/v1/videos", data={k: str(v) for k, v in direct.items()}, files=other, headers=auth("alpha")
        )
        assert not np.array_equal(frames(http, completed(http, shifted)["id"]), ours)


def test_extend_with_join_serves_the_source_and_the_extension_as_one_mp4(server, source):
    """``join: true``: ``?variant=joined`` is the source's frames then the extension's after its first (which repeats
    the source's last), within one more H.264 encode's loss, as long as both together, with their sound; a clip not
    asked with join has none (404 naming the variant)."""
    with client(server.root) as http:
        body = {"prompt": "and it rolls on", "join": True}
        response = http.post(f"{P}/v1/videos/{source['id']}/extend", json=body, headers=auth("alpha"))
        extension = completed(http, response)
        assert extension["join"] is True and extension["extended_from_video_id"] == source["id"]
        joined = http.get(f"{P}/v1/videos/{extension['id']}/content?variant=joined", headers=auth("alpha"))
        assert joined.status_code == 200 and joined.headers["content-type"] == "video/mp4" and joined.headers["etag"]
        before, after = frames(http, source["id"]), frames(http, extension["id"])
        with av.open(io.BytesIO(joined.content)) as container:
            fps = container.streams.video[0].average_rate
            got = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
            container.seek(0)
            rate = container.streams.audio[0].codec_context.sample_rate
            samples = sum(f.samples for f in container.decode(audio=0))
        want = np.concatenate([before, after[1:]])  # [N_s + N_e - 1, H, W, 3]
        assert got.shape == want.shape
        psnr = 10 * np.log10(255**2 / np.mean((got.astype(np.float64) - want) ** 2))
        assert psnr > 30, psnr  # one more encode at the served CRF; another clip's frames would be far below
        seconds = len(want) / fps
        assert abs(samples / rate - seconds) < 1024 / rate + 1e-9  # the sound as long as the frames (AAC frames)
        ranged = http.get(
            f"{P}/v1/videos/{extension['id']}/content?variant=joined", headers={"Range": "bytes=10-", **auth("alpha")}
        )
        assert ranged.status_code == 206 and ranged.content == joined.content[10:]
        none = http.get(f"{P}/v1/videos/{source['id']}/content?variant=joined", headers=auth("alpha"))
        assert error_of(none, 404)["param"] == "variant"


def test_remix_keeps_the_seed_and_settings_and_changes_the_prompt(server, source):
    with client(server.root) as http:
        key = {"Idempotency-Key": "remix-once", **auth("alpha")}
        response = http.post(f"{P}/v1/videos/{source['id']}/remix", json={"prompt": "a blue square"}, headers=key)
        remix = completed(http, response)
        again = http.post(f"{P}/v1/videos/{source['id']}/remix", json={"prompt": "a blue square"}, headers=key)
        assert again.status_code == 200 and again.json()["id"] == remix["id"]  # a retry: the same job
        assert remix["remixed_from_video_id"] == source["id"] and remix["prompt"] == "a blue square"
        assert (remix["size"], remix["seconds"], remix["model"]) == (source["size"], source["seconds"], source["model"])
        got = http.get(f"{P}/v1/videos/{remix['id']}", headers=auth("alpha")).json()
        assert got["remixed_from_video_id"] == source["id"]
        direct = {"prompt": "a blue square", "seed": 7, "num_inference_steps": 2}
        plain = completed(http, http.post(f"{P}/v1/videos", json=direct, headers=auth("alpha")))
        ours = frames(http, remix["id"])
        assert np.array_equal(ours, frames(http, plain["id"]))  # the source's seed and settings
        assert not np.array_equal(ours, frames(http, source["id"]))  # the new prompt


def test_unknown_another_tenants_unfinished_sources_and_fixed_fields_are_refused(server, source):
    with client(server.root) as http:
        for action in ("remix", "extend"):
            body = {"prompt": "again"}
            unknown = http.post(f"{P}/v1/videos/video_{'0' * 32}/{action}", json=body, headers=auth("alpha"))
            assert error_of(unknown, 404)["param"] == "video_id"
            # beta may not see alpha's job: a 404 as for none
            theirs = http.post(f"{P}/v1/videos/{source['id']}/{action}", json=body, headers=auth("beta"))
            assert error_of(theirs, 404)["param"] == "video_id"
            fixed = http.post(
                f"{P}/v1/videos/{source['id']}/{action}", json={**body, "size": "64x64"}, headers=auth("alpha")
            )
            assert error_of(fixed, 400)["param"] == "size"
        seeded = http.post(
            f"{P}/v1/videos/{source['id']}/remix", json={"prompt": "x", "seed": 3}, headers=auth("alpha")
        )
        assert error_of(seeded, 400)["param"] == "seed"
        long = {"prompt": "a slow one", "num_inference_steps": 50}
        running = http.post(f"{P}/v1/videos", json=long, headers=auth("alpha")).json()["id"]
        try:
            for action in ("remix", "extend"):
                early = http.post(f"{P}/v1/videos/{running}/{action}", json={"prompt": "x"}, headers=auth("alpha"))
                error = error_of(early, 409)
                assert error["param"] == "video_id" and "only a completed video" in error["message"]
        finally:
            http.post(f"{P}/v1/videos/{running}/cancel", headers=auth("alpha"))


def test_the_openapi_document_lists_both_routes_with_their_bodies(server):
    with client(server.root) as http:
        doc = http.get(f"{P}/openapi.json", headers=auth("alpha")).json()
    extend = doc["paths"]["/v1/videos/{video_id}/extend"]["post"]
    schema = extend["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["properties"]) == {
        "prompt",
        "seconds",
        "seed",
        "num_inference_steps",
        "join",
        "priority",
        "timeout_s",
        "webhook",
    }
    assert schema["required"] == ["prompt"]
    remix = doc["paths"]["/v1/videos/{video_id}/remix"]["post"]
    assert set(remix["requestBody"]["content"]["application/json"]["schema"]["properties"]) == {
        "prompt",
        "priority",
        "timeout_s",
        "webhook",
    }
    assert any(p["name"] == "Idempotency-Key" for p in remix["parameters"])
    assert "remixed_from_video_id" in doc["components"]["schemas"]["Video"]["properties"]


def test_the_client_and_the_cli_remix_and_extend(server, source, tmp_path):
    from h3serve.client import AsyncH3Client, H3Client

    with H3Client(server.url, api_key=DERIVED_KEYS["alpha"]) as api:
        remix = api.remix_video(source["id"], {"prompt": "a green star"})
        assert remix["remixed_from_video_id"] == source["id"]
        assert api.wait_video(remix["id"], timeout_s=180)["status"] == "completed"

    async def extend() -> dict:
        async with AsyncH3Client(server.url, api_key=DERIVED_KEYS["alpha"]) as api:
            return await api.extend_video(remix["id"], {"prompt": "it fades", "seed": 3})

    extension = asyncio.run(extend())
    assert extension["extended_from_video_id"] == remix["id"]
    out = tmp_path / "more.mp4"
    env = {**os.environ, "H3SERVE_SERVER": server.url, "H3SERVE_API_KEY": DERIVED_KEYS["alpha"]}
    run = subprocess.run(
        [*H3SERVE, "video", "extend", source["id"], "--prompt", "and again", "--watch", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    video_id = run.stdout.strip()
    with client(server.root) as http:
        job = http.get(f"{P}/v1/videos/{video_id}", headers=auth("alpha")).json()
        assert job["extended_from_video_id"] == source["id"] and job["status"] == "completed"
        assert np.array_equal(frames(http, video_id), np.stack(list(decode(out))))
    refused = subprocess.run(
        [*H3SERVE, "video", "remix", f"video_{'0' * 32}", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert refused.returncode == 1 and "HTTP 404" in refused.stderr and "(video_id)" in refused.stderr, refused


def decode(path):
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            yield frame.to_ndarray(format="rgb24")
