"""Capability-derived admission: one test per behaviour of the selector."""

import functools
import json

import pytest
import torch

from h3serve.attention import (
    AdmissionError,
    AttentionBackend,
    AttentionImpl,
    AttentionRequirements,
    BackendUnavailable,
    Platform,
    Resolution,
    UnknownBackendError,
    backend_names,
    clear_cache,
    get_backend,
    overrides,
    probe_platform,
    resolve,
    selector_calls,
)
from h3serve.attention.backends.torch_sdpa import TorchSDPAImpl

VARLEN = AttentionRequirements(packed_varlen=True)
H100 = Platform.cuda((9, 0), {"flash_attn": "2.8.3", "torch.nn.attention.varlen": "2.13.0"}, device_name="H100")


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def test_explicit_sage_attn_with_packed_varlen_fails_closed():
    with pytest.raises(
        AdmissionError, match="Attention backend 'sage_attn' does not implement packed varlen attention"
    ) as e:
        resolve(VARLEN, "sage_attn", H100, model="h3-full")
    assert "h3-full" in str(e.value)
    assert e.value.reason == "incapable" and e.value.missing == ("packed_varlen",)
    assert not isinstance(e.value, BackendUnavailable)


def test_explicit_sage_attn_without_requirement_resolves():
    platform = Platform.cuda((9, 0), {"sageattention": "2.1"})
    resolution = resolve(AttentionRequirements(), "sage_attn", platform)
    assert resolution.backend == "sage_attn" and resolution.chosen_by == "explicit"


def test_auto_on_cpu_gives_torch_sdpa():
    resolution = resolve(VARLEN, "auto", Platform.cpu(), model="h3-tiny")
    assert resolution.backend == "torch_sdpa" and resolution.chosen_by == "auto"


def test_auto_on_a_probed_cpu_node_gives_torch_sdpa():
    if torch.cuda.is_available():
        pytest.skip("this node has a GPU")
    platform = probe_platform()
    assert platform.device_type == "cpu" and platform.source == "probed"
    assert resolve(VARLEN, "auto", platform).backend == "torch_sdpa"


def test_auto_on_cuda_prefers_flash_attn_then_torch_varlen_then_sdpa():
    assert resolve(VARLEN, "auto", H100).backend == "flash_attn"
    no_fa = Platform.cuda((9, 0), {"torch.nn.attention.varlen": "2.13.0"})
    resolution = resolve(VARLEN, "auto", no_fa, dtype="bfloat16")
    assert resolution.backend == "torch_varlen"
    assert [(r.backend, r.kind) for r in resolution.rejected] == [("flash_attn", "unavailable")]
    bare = Platform.cuda((7, 5), {})
    resolution = resolve(VARLEN, "auto", bare, dtype="float16")
    assert resolution.backend == "torch_sdpa"
    assert [r.backend for r in resolution.rejected] == ["flash_attn", "torch_varlen"]


def test_auto_never_picks_a_backend_the_platform_cannot_run():
    # fp32 rules out both flash kernels even though they are installed
    resolution = resolve(VARLEN, "auto", H100, dtype="float32")
    assert resolution.backend == "torch_sdpa"
    assert all(r.kind == "unavailable" and "float32" in r.reason for r in resolution.rejected)


def test_auto_with_no_candidate_lists_every_candidate_and_why(monkeypatch):
    # take torch_sdpa out of CUDA auto selection; head_dim 512 is beyond both flash kernels
    monkeypatch.setattr(type(get_backend("torch_sdpa")), "auto_rank", {"cpu": 0})
    platform = Platform.cuda((9, 0), {"flash_attn": "2.8"})
    with pytest.raises(AdmissionError) as e:
        resolve(VARLEN, "auto", platform, model="h3", head_dim=512)
    message = str(e.value)
    assert e.value.reason == "no_candidate"
    assert "flash_attn: unavailable" in message and "head_dim <= 256" in message
    assert "torch_varlen: unavailable" in message and "torch.nn.attention.varlen" in message


def test_flash_attn_on_cpu_platform_raises_backend_unavailable():
    with pytest.raises(BackendUnavailable, match="flash_attn") as e:
        resolve(VARLEN, "flash_attn", Platform.cpu(), model="h3-tiny")
    assert e.value.reason == "unavailable"
    assert not isinstance(e.value, AdmissionError)


def test_capable_but_not_installed_is_reported_as_unavailable_not_incapable():
    with pytest.raises(BackendUnavailable, match="not installed"):
        resolve(VARLEN, "flash_attn", Platform.cuda((9, 0), {}))
    with pytest.raises(BackendUnavailable, match="compute capability >= 8.0"):
        resolve(VARLEN, "fa", Platform.cuda((7, 5), {"flash_attn": "2.8"}))
    with pytest.raises(BackendUnavailable, match="head_dim <= 256"):
        resolve(VARLEN, "fa", H100, head_dim=320)
    with pytest.raises(BackendUnavailable, match="float32"):
        resolve(VARLEN, "fa", H100, dtype=torch.float32)


def test_unknown_name_lists_the_valid_names():
    with pytest.raises(UnknownBackendError) as e:
        resolve(VARLEN, "flashinfer", H100)
    assert isinstance(e.value, ValueError)
    for name in ("auto", "flash_attn", "torch_sdpa", "torch_varlen", "sage_attn"):
        assert name in str(e.value)
    assert "'flashinfer'" in str(e.value)


@pytest.mark.parametrize(
    "name,expected",
    [
        ("FA", "flash_attn"),
        ("Flash-Attn", "flash_attn"),
        ("sdpa", "torch_sdpa"),
        ("SAGE", "sage_attn"),
        ("Torch_SDPA", "torch_sdpa"),
        (" auto ", None),
    ],
)
def test_names_are_case_insensitive_with_aliases(name, expected):
    if expected is None:
        assert resolve(VARLEN, name, Platform.cpu()).backend == "torch_sdpa"
    else:
        assert get_backend(name).name == expected


def test_capability_is_derived_from_the_code_not_the_name():
    assert {n for n in backend_names() if get_backend(n).supports_packed_varlen()} == {
        "flash_attn",
        "flex_attn",
        "torch_sdpa",
        "torch_varlen",
    }
    assert get_backend("sage_attn").unsupported_requirements(VARLEN) == ("packed_varlen",)
    assert get_backend("flash_attn").unsupported_requirements(VARLEN) == ()
    assert get_backend("sage_attn").unsupported_requirements(AttentionRequirements()) == ()


# --- override detection: aliases and wrappers still count -----------------------------


def _packed(self, q, k, v, *, cu_seqlens, max_seqlen, cu_seqlens_k=None, max_seqlen_k=None):
    return TorchSDPAImpl.forward_varlen(self, q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


def timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class AliasedImpl(AttentionImpl):
    forward_varlen = _packed  # an override assigned as an alias


class WrappedImpl(AttentionImpl):
    @timed
    def forward_varlen(self, q, k, v, **kw):
        return _packed(self, q, k, v, **kw)


class InheritsOverride(WrappedImpl):
    pass


class WrapsTheBase(AttentionImpl):
    # decorating the base method is not an override: it still raises NotImplementedError
    forward_varlen = timed(AttentionImpl.forward_varlen)


class DenseOnly(AttentionImpl):
    def forward(self, q, k, v):
        return q


def make_backend(impl):
    return type(f"{impl.__name__}Backend", (AttentionBackend,), {"name": impl.__name__, "impl_cls": impl})()


@pytest.mark.parametrize(
    "impl,capable",
    [
        (AliasedImpl, True),
        (WrappedImpl, True),
        (InheritsOverride, True),
        (WrapsTheBase, False),
        (DenseOnly, False),
        (AttentionImpl, False),
    ],
)
def test_override_detection(impl, capable):
    assert overrides(impl, "forward_varlen") is capable
    assert make_backend(impl).supports_packed_varlen() is capable


def test_aliased_and_wrapped_overrides_really_run():
    q = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    for impl in (AliasedImpl(), WrappedImpl()):
        torch.testing.assert_close(
            impl.forward_varlen(q, q, q, cu_seqlens=cu, max_seqlen=5),
            TorchSDPAImpl().forward_varlen(q, q, q, cu_seqlens=cu, max_seqlen=5),
        )


def test_base_forward_varlen_names_the_class():
    with pytest.raises(NotImplementedError, match="DenseOnly"):
        DenseOnly().forward_varlen(
            torch.zeros(1, 1, 1),
            torch.zeros(1, 1, 1),
            torch.zeros(1, 1, 1),
            cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
            max_seqlen=1,
        )


def test_a_new_requirement_is_unsupported_unless_a_backend_says_so():
    """Adding a requirement touches only the backends that can meet it."""
    import dataclasses

    Extended = dataclasses.make_dataclass(
        "Extended",
        [("sliding_window", bool, dataclasses.field(default=False))],
        bases=(AttentionRequirements,),
        frozen=True,
    )

    class WindowedBackend(type(get_backend("torch_sdpa"))):
        def supports_sliding_window(self):
            return True

    req = Extended(packed_varlen=True, sliding_window=True)
    assert get_backend("torch_sdpa").unsupported_requirements(req) == ("sliding_window",)
    assert WindowedBackend().unsupported_requirements(req) == ()


# --- the Resolution and the cache --------------------------------------------------


def test_resolution_records_the_decision_and_round_trips_as_json():
    no_fa = Platform.cuda((9, 0), {"torch.nn.attention.varlen": "2.13.0"})
    resolution = resolve(VARLEN, "auto", no_fa, model="h3-full", dtype="bfloat16", head_dim=128)
    data = json.loads(resolution.model_dump_json())
    assert data["backend"] == "torch_varlen" and data["chosen_by"] == "auto"
    assert data["rejected"][0]["backend"] == "flash_attn"
    assert Resolution.model_validate_json(resolution.model_dump_json()) == resolution
    assert "torch_varlen" in resolution.describe() and "flash_attn" in resolution.describe()


def test_platform_round_trips_as_json():
    assert Platform.model_validate_json(H100.model_dump_json()) == H100
    probed = probe_platform()
    assert Platform.model_validate_json(probed.model_dump_json()) == probed


def test_resolution_is_cached_and_the_cache_can_be_cleared():
    first = resolve(VARLEN, "auto", Platform.cpu(), model="m")
    calls = selector_calls()
    assert resolve(VARLEN, "auto", Platform.cpu(), model="m") is first
    assert selector_calls() == calls + 1
    clear_cache()
    again = resolve(VARLEN, "auto", Platform.cpu(), model="m")
    assert again == first and again is not first
    # a different platform is a different key
    assert resolve(VARLEN, "auto", H100, model="m").backend == "flash_attn"


def test_the_sage_attn_error_is_not_cached_into_a_success():
    for _ in range(2):
        with pytest.raises(AdmissionError):
            resolve(VARLEN, "sage", H100)


def test_availability_lists_every_reason_not_only_the_first():
    available = get_backend("flash_attn").availability(Platform.cpu(), dtype=torch.float32, head_dim=512)
    assert not available
    assert len(available.reasons) == 4, available.reasons  # device, library, dtype, head size
    for words in ("runs on cuda, not cpu", "'flash_attn', which is not installed", "not float32", "head_dim <= 256"):
        assert words in available.reason
    assert get_backend("torch_sdpa").availability(Platform.cpu()).reasons == ()
