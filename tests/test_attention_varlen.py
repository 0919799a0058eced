"""Varlen correctness of torch_sdpa against an fp32 per-document reference (flash-attn test style)."""

import itertools
import math
import random

import pytest
import torch

from h3serve.attention import get_backend

SDPA = get_backend("torch_sdpa").make_impl()


def random_bounds(rng: random.Random, n_docs: int, max_len: int) -> list[int]:
    lengths = [1] + [rng.randint(1, max_len) for _ in range(n_docs - 1)]  # length 1 always present
    rng.shuffle(lengths)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return bounds


def naive_varlen(q, k, v, bounds_q, bounds_k, upcast: bool):
    """Explicit softmax(QK^T)V per document; ``upcast`` gives the fp32 reference."""
    dtype = torch.float32 if upcast else q.dtype
    out = torch.zeros(q.shape, dtype=dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for i in range(len(bounds_q) - 1):
        qs = q[bounds_q[i] : bounds_q[i + 1]].to(dtype).transpose(0, 1)
        ks = k[bounds_k[i] : bounds_k[i + 1]].to(dtype).transpose(0, 1)
        vs = v[bounds_k[i] : bounds_k[i + 1]].to(dtype).transpose(0, 1)
        attn = torch.softmax((qs @ ks.transpose(-1, -2)) * scale, dim=-1)
        out[bounds_q[i] : bounds_q[i + 1]] = (attn @ vs).transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [32, 40, 59, 64, 96, 128])
@pytest.mark.parametrize("n_docs", [1, 3, 7])
def test_sdpa_varlen_matches_reference(dtype, head_dim, n_docs):
    rng = random.Random(head_dim * 100 + n_docs)
    torch.manual_seed(head_dim * 100 + n_docs)
    bounds = random_bounds(rng, n_docs, 97)
    T, H = bounds[-1], 3
    q, k, v = (torch.randn(T, H, head_dim, dtype=dtype) for _ in range(3))
    cu = torch.tensor(bounds, dtype=torch.int32)
    out = SDPA.forward_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max(b - a for a, b in itertools.pairwise(bounds)))
    assert out.shape == q.shape and out.dtype == dtype
    ref = naive_varlen(q, k, v, bounds, bounds, upcast=True)
    naive = naive_varlen(q, k, v, bounds, bounds, upcast=False)
    err = (out.float() - ref).abs().max().item()
    naive_err = (naive.float() - ref).abs().max().item()
    # flash-attn's criterion: at most twice the error of a naive kernel in the same precision
    assert err <= 2 * naive_err + 1e-5, (err, naive_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_trailing_padding_layout(dtype):
    """The H3 layout (0, used, total): the padding tail is its own document and never leaks into ``used``."""
    torch.manual_seed(0)
    used, total, H, D = 150, 192, 4, 64
    q, k, v = (torch.randn(total, H, D, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, used, total], dtype=torch.int32)
    out = SDPA.forward_varlen(q, k, v, cu_seqlens=cu, max_seqlen=used)
    ref = naive_varlen(q, k, v, [0, used, total], [0, used, total], upcast=True)
    naive = naive_varlen(q, k, v, [0, used, total], [0, used, total], upcast=False)
    assert (out.float() - ref).abs().max() <= 2 * (naive.float() - ref).abs().max() + 1e-5
    # garbage in the padding rows changes nothing in the real rows
    k2, v2 = k.clone(), v.clone()
    k2[used:] = 1e4
    v2[used:] = -1e4
    out2 = SDPA.forward_varlen(q, k2, v2, cu_seqlens=cu, max_seqlen=used)
    torch.testing.assert_close(out2[:used], out[:used], rtol=0, atol=0)


def test_different_k_bounds_are_honoured():
    """Cross-attention style: doc i's queries attend to doc i's keys, with K bounds != Q bounds."""
    torch.manual_seed(1)
    bq, bk = [0, 5, 6, 20], [0, 9, 30, 31]
    H, D = 2, 32
    q = torch.randn(bq[-1], H, D)
    k, v = torch.randn(bk[-1], H, D), torch.randn(bk[-1], H, D)
    out = SDPA.forward_varlen(
        q,
        k,
        v,
        cu_seqlens=torch.tensor(bq, dtype=torch.int32),
        max_seqlen=14,
        cu_seqlens_k=torch.tensor(bk, dtype=torch.int32),
        max_seqlen_k=21,
    )
    ref = naive_varlen(q, k, v, bq, bk, upcast=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # and it is not what the Q bounds would have given
    wrong = naive_varlen(q, k, v, bq, bq, upcast=True)
    assert (out - wrong).abs().max() > 1e-2


def test_mismatched_k_bounds_are_rejected():
    q = torch.randn(10, 2, 32)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        SDPA.forward_varlen(
            q,
            q,
            q,
            cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32),
            max_seqlen=6,
            cu_seqlens_k=torch.tensor([0, 10], dtype=torch.int32),
            max_seqlen_k=10,
        )
    with pytest.raises(ValueError, match="k has 12 rows"):
        SDPA.forward_varlen(
            q,
            torch.randn(12, 2, 32),
            torch.randn(12, 2, 32),
            cu_seqlens=torch.tensor([0, 10], dtype=torch.int32),
            max_seqlen=10,
        )


def test_bad_cu_seqlens_dtype_is_rejected():
    q = torch.randn(10, 2, 32)
    with pytest.raises(ValueError, match="int32"):
        SDPA.forward_varlen(q, q, q, cu_seqlens=torch.tensor([0, 10]), max_seqlen=10)


def test_dense_forward_matches_varlen_single_document():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 33, 4, 48) for _ in range(3))
    dense = SDPA.forward(q, k, v)
    packed = SDPA.forward_varlen(q[0], k[0], v[0], cu_seqlens=torch.tensor([0, 33], dtype=torch.int32), max_seqlen=33)
    torch.testing.assert_close(dense[0], packed, rtol=1e-5, atol=1e-6)


def test_bounds_reach_the_host_once_per_pack_not_once_per_layer():
    impl = get_backend("torch_sdpa").make_impl()
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    first = impl.host_bounds(cu)
    assert first == [0, 3, 7] and impl.host_bounds(cu) is first  # the same tensor: no second sync
    other = torch.tensor([0, 2, 7], dtype=torch.int32)
    assert impl.host_bounds(other) == [0, 2, 7]  # a new pack's bounds are read afresh
