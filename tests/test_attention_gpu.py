"""flash_attn and torch_varlen against the torch_sdpa reference. Needs a CUDA GPU.

Run on a GPU node:  python -m pytest tests/test_attention_gpu.py -q
"""

import random

import pytest
import torch

from h3serve.attention import AttentionRequirements, get_backend, probe_platform

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def packed_inputs(n_docs, head_dim, heads=8, dtype=torch.bfloat16, seed=0):
    rng = random.Random(seed)
    lengths = [1, 63, 64, 65] + [rng.randint(1, 1500) for _ in range(n_docs - 4)]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(bounds[-1], heads, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    return q, k, v, cu, max(lengths)


@pytest.mark.parametrize("backend_name", ["flash_attn", "torch_varlen"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_kernel_matches_sdpa_reference(backend_name, head_dim, dtype):
    backend = get_backend(backend_name)
    available = backend.availability(probe_platform("cuda"), dtype=dtype, head_dim=head_dim)
    if not available:
        pytest.skip(available.reason)
    assert backend.supports_packed_varlen()
    q, k, v, cu, max_len = packed_inputs(12, head_dim, dtype=dtype)
    out = backend.make_impl().forward_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max_len)
    ref = (
        get_backend("torch_sdpa")
        .make_impl()
        .forward_varlen(q.float(), k.float(), v.float(), cu_seqlens=cu, max_seqlen=max_len)
    )
    low = get_backend("torch_sdpa").make_impl().forward_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max_len)
    err = (out.float() - ref).abs().max().item()
    low_err = (low.float() - ref).abs().max().item()
    assert err <= 2 * low_err + 1e-3, (err, low_err)


def test_requirements_agree_with_kernels():
    for name in ("flash_attn", "torch_varlen"):
        assert get_backend(name).unsupported_requirements(AttentionRequirements(packed_varlen=True)) == ()
