"""The request bodies carry the deployment's limits in their validators: no server, no Ray."""

import pytest
from pydantic import ValidationError

from h3serve.deploy.common.args import RequestLimits
from h3serve.deploy.common.errors import invalid
from h3serve.deploy.ingress.bodies import ImagesBody, VideosBody

LIMITS = RequestLimits(max_pixels=128 * 64, max_seconds=6, max_n=2, max_steps=10, default_steps=8, max_prompt_chars=20)


def validate(model, fields):
    return model.model_validate(fields, context={"limits": LIMITS})


def refusal(model, fields):
    with pytest.raises(ValidationError) as info:
        validate(model, fields)
    error = invalid(info.value)
    assert error.status == 400
    return error.param, error.message


def test_a_body_within_the_limits_becomes_a_generation_with_the_default_steps():
    body = validate(VideosBody, {"prompt": "a red circle", "size": "128x64", "seed": 3, "seconds": 5.5})
    assert body.generation() == dict(prompt="a red circle", width=128, height=64, seed=3, num_inference_steps=8)
    assert body.seconds == 5.5
    assert validate(ImagesBody, {"prompt": "x", "num_inference_steps": 10}).generation()["num_inference_steps"] == 10


@pytest.mark.parametrize(
    "model,fields,param,words",
    [
        (VideosBody, {"prompt": "x" * 21}, "prompt", "is 21 characters; the limit is 20"),
        (VideosBody, {"prompt": " \n "}, "prompt", "must not be blank"),
        (VideosBody, {"prompt": "\ud800"}, "prompt", "lone surrogate"),
        (VideosBody, {"prompt": "x", "size": "256x64"}, "size", "16384 pixels; this server allows 1..8192"),
        (VideosBody, {"prompt": "x", "size": "9" * 5000}, "size", "WIDTHxHEIGHT"),
        (VideosBody, {"prompt": "x", "num_inference_steps": 11}, "num_inference_steps", "limit of 10"),
        (VideosBody, {"prompt": "x", "seconds": 7}, "seconds", "seconds=7 exceeds this server's limit of 6"),
        (ImagesBody, {"prompt": "x", "n": 3}, "n", "n=3 exceeds the limit of 2"),
        (ImagesBody, {"prompt": "x", "response_format": "url"}, "response_format", "'b64_json'"),
    ],
)
def test_a_body_over_a_limit_is_a_400_naming_the_field(model, fields, param, words):
    got_param, message = refusal(model, fields)
    assert got_param == param
    assert words in message


@pytest.mark.parametrize("field", ["input_reference", "last_reference", "references", "seconds", "fps"])
def test_a_field_of_the_video_route_sent_for_an_image_is_a_400_naming_it_not_dropped(field):
    param, message = refusal(ImagesBody, {"prompt": "x", field: "anything"})
    assert param == field
    assert message == f"{field}: is a field of POST /v1/videos; an image is made from the prompt alone"
    # OpenAI's fields that change nothing here are still accepted and unused
    assert validate(ImagesBody, {"prompt": "x", "quality": "hd", "style": "vivid", "user": "u"}).prompt == "x"


def test_limits_come_from_the_deployment_not_from_defaults():
    # validated without the deployment's limits is a programming error, never a silent default
    with pytest.raises(TypeError, match="deployment's limits"):
        VideosBody.model_validate({"prompt": "x"})
    looser = RequestLimits(max_steps=100, default_steps=50)
    body = VideosBody.model_validate({"prompt": "x", "num_inference_steps": 99}, context={"limits": looser})
    assert body.num_inference_steps == 99


def test_seeds_of_n_images_stay_within_the_seed_range():
    """Image i uses seed + i: the largest seed with n=2 is 2**63 - 2, and 2**63 - 1 is a 400 naming seed."""
    top = 2**63 - 1
    assert validate(ImagesBody, {"prompt": "x", "seed": top}).seed == top  # n=1: the largest seed itself
    assert validate(ImagesBody, {"prompt": "x", "seed": top - 1, "n": 2}).n == 2
    param, message = refusal(ImagesBody, {"prompt": "x", "seed": top, "n": 2})
    assert param == "seed"
    assert message == (
        f"seed: must be at most {top - 1} with n=2: image i uses seed + i, and seeds range from 0 to 2**63 - 1 ({top})"
    )
    assert refusal(VideosBody, {"prompt": "x", "seed": 2**63})[0] == "seed"


@pytest.mark.parametrize("model", [ImagesBody, VideosBody])
def test_timeout_s_is_a_positive_number_up_to_max_timeout_s(model):
    assert validate(model, {"prompt": "x"}).timeout_s is None  # the engine's default deadline
    assert validate(model, {"prompt": "x", "timeout_s": 3600}).timeout_s == 3600
    assert validate(model, {"prompt": "x", "timeout_s": "2.5"}).timeout_s == 2.5  # a form field is text
    assert "timeout_s" not in validate(model, {"prompt": "x", "timeout_s": 5}).generation()
    for bad, words in [
        (3600.5, "timeout_s=3600.5 exceeds this server's limit of 3600 seconds"),
        (float("inf"), "exceeds this server's limit of 3600 seconds"),
        (0, "greater than 0"),
        (-1, "greater than 0"),
        ("soon", "valid number"),
    ]:
        param, message = refusal(model, {"prompt": "x", "timeout_s": bad})
        assert param == "timeout_s" and words in message, (bad, message)
    stricter = RequestLimits(max_timeout_s=10)
    with pytest.raises(ValidationError, match="limit of 10 seconds"):
        model.model_validate({"prompt": "x", "timeout_s": 11}, context={"limits": stricter})


def test_priority_is_an_integer_in_range_from_json_or_the_text_of_one_from_a_form():
    assert validate(ImagesBody, {"prompt": "x"}).priority == 0
    assert validate(VideosBody, {"prompt": "x", "priority": -10}).priority == -10
    form = VideosBody.model_validate({"prompt": "x", "priority": " +7 "}, context={"limits": LIMITS, "form": True})
    assert form.priority == 7
    for value in (11, -11, "7", 7.0, True, None, "9" * 40):  # JSON text, floats and bools are not integers
        param, message = refusal(VideosBody, {"prompt": "x", "priority": value})
        assert param == "priority" and "must be an integer from -10 to 10" in message, (value, message)
    for text in ("11", "high", "1.5", "0x3"):
        with pytest.raises(ValidationError) as info:
            VideosBody.model_validate({"prompt": "x", "priority": text}, context={"limits": LIMITS, "form": True})
        assert invalid(info.value).param == "priority", text


def test_keyframes_and_image_references_are_checked_on_their_header_and_named_by_the_api_field():
    """A decompression bomb and a truncated PNG never reach a job: a 400 naming the field the client set."""
    import base64

    from tests.harness import bomb_png, truncated_png

    bomb, truncated = bomb_png(), truncated_png()
    assert len(bomb) < 200_000  # small on the wire: only its header says 32000x32000
    assert refusal(VideosBody, {"prompt": "x", "input_reference": bomb}) == (
        "input_reference",
        "input_reference: is too large to decode: Image size (1024000000 pixels) exceeds limit of 178956970 pixels, "
        "could be decompression bomb DOS attack.; images may have at most 16777216 pixels",
    )
    param, message = refusal(VideosBody, {"prompt": "x", "last_reference": truncated})
    assert param == "last_reference" and message.startswith("last_reference: is not a decodable image")
    ok = base64.b64decode(  # a 1x1 PNG: within every bound, decodable
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    )
    references = [{"kind": "image", "data": ok}, {"kind": "audio", "data": wav(1.0)}]
    assert validate(VideosBody, {"prompt": "x", "input_reference": ok, "references": references}).input_reference == ok
    references.append({"kind": "image", "data": truncated})
    param, message = refusal(VideosBody, {"prompt": "x", "references": references})
    assert param == "references[2]" and "not a decodable image" in message
    # the deployment's own bound, below the replicas'
    small = RequestLimits(max_image_pixels=63 * 64)
    with pytest.raises(ValidationError) as info:
        VideosBody.model_validate({"prompt": "x", "input_reference": truncated}, context={"limits": small})
    assert invalid(info.value).message == "input_reference: is 64x64 pixels; images may have at most 4032 pixels"
    with pytest.raises(ValidationError, match="less than or equal to 16777216"):
        RequestLimits(max_image_pixels=4097 * 4096)


def mp4(seconds: float, fps: int = 8, size: tuple[int, int] = (32, 32), codec: str = "libx264") -> bytes:
    """A real video file, written by PyAV: ``seconds`` at ``fps`` of ``size`` frames."""
    import io

    import av
    import numpy as np

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        for i in range(round(seconds * fps)):
            frame = np.full((size[1], size[0], 3), i % 256, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return out.getvalue()


def wav(seconds: float, rate: int = 16000) -> bytes:
    """A real stereo WAV, written by PyAV."""
    import io

    import av
    import numpy as np

    out = io.BytesIO()
    with av.open(out, mode="w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=rate, layout="stereo")
        samples = np.zeros((1, round(seconds * rate) * 2), dtype=np.int16)  # packed s16: channels interleaved
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="stereo")
        frame.sample_rate = rate
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return out.getvalue()


REFERENCE_LIMITS = LIMITS.model_copy(
    update=dict(
        max_references=3,
        max_reference_seconds=2.0,
        max_reference_frames=20,
        max_reference_pixels=64 * 64,
        max_reference_sample_rate=24000,
    )
)


def reference_refusal(references: list[dict]) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as info:
        VideosBody.model_validate({"prompt": "x", "references": references}, context={"limits": REFERENCE_LIMITS})
    error = invalid(info.value)
    assert error.status == 400
    return error.param, error.message


def test_video_and_audio_references_are_bounded_on_their_container_metadata_and_counted():
    """Real files written by PyAV, probed without decoding: within the bounds they pass; too long, too many frames,
    too large, a high sample rate, a codec not allowed, a file that is no media, too many references: a 400 naming
    the field."""
    fine = [{"kind": "video", "data": mp4(1.0)}, {"kind": "audio", "data": wav(1.5)}]
    body = VideosBody.model_validate({"prompt": "x", "references": fine}, context={"limits": REFERENCE_LIMITS})
    assert [r.kind for r in body.references] == ["video", "audio"]
    cases = [
        ({"kind": "video", "data": mp4(3.0)}, "is 3.0 s long; references may be at most 2 s"),
        ({"kind": "video", "data": mp4(1.0, fps=24)}, "has 24 frames; video references may have at most 20"),
        ({"kind": "video", "data": mp4(0.5, size=(128, 64))}, "is 128x64 pixels"),
        ({"kind": "video", "data": mp4(0.2, fps=25, codec="mpeg1video")}, "is mpeg1video; video references may be"),
        ({"kind": "audio", "data": wav(2.5)}, "is 2.5 s long"),
        ({"kind": "audio", "data": wav(0.5, rate=48000)}, "is sampled at 48000 Hz"),
        ({"kind": "audio", "data": mp4(0.5)}, "holds no audio stream"),
        ({"kind": "video", "data": b"not a video at all" * 100}, "is not a video file PyAV can open"),
    ]
    for bad, words in cases:
        param, message = reference_refusal([fine[0], bad])
        assert param == "references[1]" and words in message, (param, message)
    param, message = reference_refusal(fine * 2)
    assert param == "references" and "holds 4; a request may send at most 3" in message
