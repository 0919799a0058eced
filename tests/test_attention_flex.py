"""flex_attn: packed varlen through torch's flex_attention, against an fp32 per-document reference."""

import itertools
import math
import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from h3serve.attention import (
    AttentionRequirements,
    BackendUnavailable,
    Platform,
    clear_cache,
    get_backend,
    overrides,
    probe_platform,
    resolve,
)
from h3serve.attention.backends.flex_attn import BLOCK, FlexAttnImpl, document_block_mask

# CPU runs flex_attention eagerly on purpose (opt-in there); its one "use torch.compile" warning is expected.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

VARLEN = AttentionRequirements(packed_varlen=True)
FLEX_LIB = {"torch.nn.attention.flex_attention": torch.__version__}
FLEX = get_backend("flex_attn").make_impl()
SDPA = get_backend("torch_sdpa").make_impl()


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def random_bounds(rng: random.Random, n_docs: int, max_len: int) -> list[int]:
    lengths = [1] + [rng.randint(1, max_len) for _ in range(n_docs - 1)]  # a length-1 document always
    rng.shuffle(lengths)
    return [0] + [sum(lengths[: i + 1]) for i in range(n_docs)]


def reference(q, k, v, bounds_q, bounds_k, scale=None):
    """Plain softmax(QK^T)V per document in fp32; a query document with no keys gives zeros."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    for i in range(len(bounds_q) - 1):
        (q0, q1), (k0, k1) = bounds_q[i : i + 2], bounds_k[i : i + 2]
        if q1 == q0 or k1 == k0:
            continue
        qs, ks, vs = (t.float().transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        out[q0:q1] = (torch.softmax(qs @ ks.transpose(-1, -2) * scale, dim=-1) @ vs).transpose(0, 1)
    return out


def cu(bounds, device="cpu"):
    return torch.tensor(bounds, dtype=torch.int32, device=device)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("n_docs", [1, 4, 9])
def test_flex_varlen_matches_reference_fp32(head_dim, n_docs):
    rng = random.Random(head_dim * 10 + n_docs)
    torch.manual_seed(head_dim * 10 + n_docs)
    bounds = random_bounds(rng, n_docs, 80)
    q, k, v = (torch.randn(bounds[-1], 3, head_dim) for _ in range(3))
    max_seqlen = max(b - a for a, b in itertools.pairwise(bounds))
    out = FLEX.forward_varlen(q, k, v, cu_seqlens=cu(bounds), max_seqlen=max_seqlen)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, reference(q, k, v, bounds, bounds), rtol=1e-5, atol=1e-5)


def test_bf16_on_cpu_is_as_close_as_the_sdpa_loop():
    torch.manual_seed(3)
    bounds = [0, 1, 70, 71, 300]
    q, k, v = (torch.randn(300, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    ref = reference(q, k, v, bounds, bounds)
    out = FLEX.forward_varlen(q, k, v, cu_seqlens=cu(bounds), max_seqlen=229)
    low = SDPA.forward_varlen(q, k, v, cu_seqlens=cu(bounds), max_seqlen=229)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() <= 2 * (low.float() - ref).abs().max() + 1e-5


def test_custom_scale_and_padding_rows_stay_in_their_document():
    """The H3 layout (0, used, total): garbage in the padding segment never reaches the real rows."""
    torch.manual_seed(4)
    used, total = 150, 192
    q, k, v = (torch.randn(total, 2, 32) for _ in range(3))
    impl = FlexAttnImpl(softmax_scale=0.3)
    out = impl.forward_varlen(q, k, v, cu_seqlens=cu([0, used, total]), max_seqlen=used)
    torch.testing.assert_close(out, reference(q, k, v, [0, used, total], [0, used, total], 0.3), rtol=1e-5, atol=1e-5)
    k[used:], v[used:] = 1e4, -1e4
    again = impl.forward_varlen(q, k, v, cu_seqlens=cu([0, used, total]), max_seqlen=used)
    torch.testing.assert_close(again[:used], out[:used], rtol=0, atol=0)


def test_different_k_bounds_are_honoured():
    """Query document i attends to key document i; a document with no keys comes out as zeros, as in torch_sdpa."""
    torch.manual_seed(1)
    bq, bk = [0, 5, 6, 20, 23], [0, 9, 30, 31, 31]
    q, k, v = torch.randn(23, 2, 32), torch.randn(31, 2, 32), torch.randn(31, 2, 32)
    kw = dict(cu_seqlens=cu(bq), max_seqlen=14, cu_seqlens_k=cu(bk), max_seqlen_k=21)
    out = FLEX.forward_varlen(q, k, v, **kw)
    torch.testing.assert_close(out, reference(q, k, v, bq, bk), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, SDPA.forward_varlen(q, k, v, **kw), rtol=1e-5, atol=1e-5)
    assert out[20:].abs().max() == 0


def test_dense_forward_matches_sdpa():
    q, k, v = (torch.randn(2, 33, 4, 48) for _ in range(3))
    torch.testing.assert_close(FLEX.forward(q, k, v), SDPA.forward(q, k, v))


@pytest.mark.parametrize(
    "bounds,rows,match",
    [
        ([0, 4, 10], 12, "end at the tensor's row count 12"),  # rows beyond the last document
        ([0, 4, 12], 10, "end at the tensor's row count 10"),  # documents beyond the rows
        ([1, 4, 10], 10, "start at 0"),
        ([0, 6, 4, 10], 10, "never decrease"),
    ],
)
def test_bad_cu_seqlens_raise_value_error(bounds, rows, match):
    q = torch.randn(rows, 2, 32)
    with pytest.raises(ValueError, match=match):
        FLEX.forward_varlen(q, q, q, cu_seqlens=cu(bounds), max_seqlen=10)


def test_bad_cu_seqlens_dtype_and_k_bounds_raise_value_error():
    q = torch.randn(10, 2, 32)
    with pytest.raises(ValueError, match="int32"):
        FLEX.forward_varlen(q, q, q, cu_seqlens=torch.tensor([0, 10]), max_seqlen=10)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        FLEX.forward_varlen(q, q, q, cu_seqlens=cu([0, 4, 10]), max_seqlen=6, cu_seqlens_k=cu([0, 10]), max_seqlen_k=10)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0"):
        FLEX.forward_varlen(
            q, q, q, cu_seqlens=cu([0, 4, 10]), max_seqlen=6, cu_seqlens_k=cu([0, 4, 9]), max_seqlen_k=5
        )


# --- the block mask and its cache ------------------------------------------------------


def test_block_mask_equals_create_block_mask():
    """Built from tiles, never a [T, T] mask, yet the same partial and full tiles as flex's own builder."""
    bounds = (0, 1, 2 * BLOCK, 2 * BLOCK, 2 * BLOCK + 7, 5 * BLOCK + 3)  # an empty document, whole tiles, a ragged end
    doc = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
    theirs = create_block_mask(lambda b, h, q, k: doc[q] == doc[k], None, None, bounds[-1], bounds[-1], device="cpu")
    mine = document_block_mask(bounds, bounds, bounds[-1], bounds[-1], "cpu")
    torch.testing.assert_close(mine.to_dense(), theirs.to_dense(), rtol=0, atol=0)
    for field in ("kv_num_blocks", "full_kv_num_blocks"):
        torch.testing.assert_close(getattr(mine, field), getattr(theirs, field), rtol=0, atol=0)
    assert mine.full_kv_num_blocks.sum() > 0  # whole tiles inside one document skip mask_mod


def test_block_mask_is_cached_per_layout():
    document_block_mask.cache_clear()
    q = torch.randn(40, 2, 32)
    for _ in range(3):
        FLEX.forward_varlen(q, q, q, cu_seqlens=cu([0, 10, 40]), max_seqlen=30)
    assert document_block_mask.cache_info().misses == 1 and document_block_mask.cache_info().hits == 2
    first = document_block_mask((0, 10, 40), (0, 10, 40), 40, 40, "cpu")
    FLEX.forward_varlen(q, q, q, cu_seqlens=cu([0, 11, 40]), max_seqlen=29)  # same rows, other documents
    FLEX.forward_varlen(
        q, q, q, cu_seqlens=cu([0, 10, 40]), max_seqlen=30, cu_seqlens_k=cu([0, 20, 40]), max_seqlen_k=20
    )  # same q layout, other key bounds
    assert document_block_mask.cache_info().misses == 3
    assert document_block_mask((0, 11, 40), (0, 11, 40), 40, 40, "cpu") is not first
    assert document_block_mask((0, 10, 40), (0, 10, 40), 40, 40, "cpu") is first


# --- admission ----------------------------------------------------------------------------


def test_capability_is_derived_from_the_code():
    backend = get_backend("flex_attn")
    assert overrides(FlexAttnImpl, "forward_varlen") and backend.supports_packed_varlen()
    assert backend.unsupported_requirements(VARLEN) == ()


@pytest.mark.parametrize("name", ["flex_attn", "flex", "Flex-Attention", "FLEX_ATTN"])
def test_resolvable_by_name_and_alias(name):
    assert get_backend(name).name == "flex_attn"
    resolution = resolve(VARLEN, name, Platform.cpu(kernel_libraries=FLEX_LIB), dtype="float32", head_dim=128)
    assert resolution.backend == "flex_attn" and resolution.chosen_by == "explicit"


def test_probed_cpu_node_can_run_it_and_auto_still_gives_torch_sdpa():
    platform = probe_platform("cpu")
    assert resolve(VARLEN, "flex", platform).backend == "flex_attn"
    assert resolve(VARLEN, "auto", platform).backend == "torch_sdpa"


def test_availability_is_declared():
    with pytest.raises(BackendUnavailable, match="not installed"):
        resolve(VARLEN, "flex", Platform.cpu())  # an assumed platform must list torch's flex_attention module
    with pytest.raises(BackendUnavailable, match="head_dim <= 256"):
        resolve(VARLEN, "flex", Platform.cpu(kernel_libraries=FLEX_LIB), head_dim=512)
    with pytest.raises(BackendUnavailable, match="compute capability >= 8.0"):
        resolve(VARLEN, "flex", Platform.cuda((7, 5), FLEX_LIB))


def test_declared_cuda_order_keeps_torch_sdpa_ahead_until_measured():
    resolution = resolve(VARLEN, "auto", Platform.cuda((9, 0), FLEX_LIB), dtype="bfloat16")
    assert resolution.backend == "torch_sdpa" and resolution.order == "declared"


# --- GPU: compiled flex_attention ---------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_compiled_flex_matches_sdpa_reference_on_gpu(head_dim, dtype):
    available = get_backend("flex_attn").availability(probe_platform("cuda"), dtype=dtype, head_dim=head_dim)
    if not available:
        pytest.skip(available.reason)
    rng = random.Random(head_dim)
    bounds = [0]
    for n in [1, 63, 64, 65, 128, 129] + [rng.randint(1, 1500) for _ in range(6)]:
        bounds.append(bounds[-1] + n)
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    q, k, v = (torch.randn(bounds[-1], 8, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    kw = dict(cu_seqlens=cu(bounds, "cuda"), max_seqlen=max(b - a for a, b in itertools.pairwise(bounds)))
    out = FLEX.forward_varlen(q, k, v, **kw)
    ref = SDPA.forward_varlen(q.float(), k.float(), v.float(), **kw)
    low = SDPA.forward_varlen(q, k, v, **kw)
    err, low_err = (out.float() - ref).abs().max().item(), (low.float() - ref).abs().max().item()
    assert out.dtype == dtype and err <= 2 * low_err + 1e-3, (err, low_err)
