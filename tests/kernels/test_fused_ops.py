"""RMSNorm, SiLU-and-mul and the qkv prologue (`kernels/fused_ops.py`) against their references."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import DEVICE, gpu, HALF, _gen, _prologue_reference, _randn, _tol
from tokenmill.layers.activation import silu_and_mul_torch
from tokenmill.layers.kernels import fused_ops as ops
from tokenmill.layers.norm import rms_norm_torch
from tokenmill.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    gen = _gen(5)
    x = _randn(5, 48, dtype=dtype, gen=gen)
    weight = _randn(48, dtype=dtype, gen=gen)
    residual = _randn(5, 48, dtype=dtype, gen=gen) if with_residual else None
    residual_before = None if residual is None else residual.clone()
    ref, ref_res = rms_norm_torch(x, weight, 1e-5, residual)
    got = ops.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        out, res = got
        torch.testing.assert_close(res, ref_res, rtol=0, atol=0)
        torch.testing.assert_close(residual, residual_before, rtol=0, atol=0)
    else:
        out = got
    torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))


def test_rms_norm_per_head_on_strided_view():
    """Qwen3's q/k norm runs on [T, H, D] views of the packed qkv output."""
    gen = _gen(6)
    qkv = _randn(3, (4 + 2) * 16, gen=gen)
    q = qkv[:, :64].view(3, 4, 16)
    weight = _randn(16, gen=gen)
    ref, _ = rms_norm_torch(q, weight, 1e-6)
    torch.testing.assert_close(ops.rms_norm(q, weight, 1e-6), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_silu_and_mul_matches_reference(dtype):
    gen = _gen(7)
    x = _randn(4, 2 * 40 + 6, dtype=dtype, gen=gen)[:, :80]  # row stride != 2I
    torch.testing.assert_close(ops.silu_and_mul(x), silu_and_mul_torch(x), rtol=_tol(dtype),
                               atol=_tol(dtype))

def _check_prologue(ops, gen, num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                    dtype, qk_norm, max_pos, tol):
    rope = RotaryEmbedding(head_dim, max_pos, 10000.0).to(DEVICE)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn(num_tokens, width + 8, dtype=dtype, gen=gen)[:, 3:3 + width]  # row stride != width
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:2]] = -1
    slots = slots.to(DEVICE)
    q_weight = _randn(head_dim, dtype=dtype, gen=gen) if qk_norm else None
    k_weight = _randn(head_dim, dtype=dtype, gen=gen) if qk_norm else None
    poison = 777.0
    caches = [torch.full((num_blocks, block_size, num_kv_heads, head_dim), poison, dtype=dtype, device=DEVICE)
              for _ in range(4)]
    ref_q = _prologue_reference(qkv, positions, rope.cos_sin, q_weight, k_weight, 1e-6, caches[0],
                                caches[1], slots, num_heads, num_kv_heads, head_dim)
    q = ops.qk_norm_rope_store(qkv, positions, rope.cos_sin, q_weight, k_weight, 1e-6, caches[2],
                               caches[3], slots, num_heads, num_kv_heads, head_dim)
    assert q.shape == (num_tokens, num_heads, head_dim) and q.is_contiguous()
    torch.testing.assert_close(q, ref_q, rtol=tol, atol=tol)
    torch.testing.assert_close(caches[2], caches[0], rtol=tol, atol=tol)
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    for cache in caches[2:]:
        assert torch.all(cache.view(-1, num_kv_heads, head_dim)[untouched] == poison)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,qk_norm", [
    (4, 2, 16, 1, torch.float32, True),
    (4, 2, 32, 4, HALF, True),
    (5, 1, 16, 4, torch.float32, False),
    (5, 1, 32, 1, HALF, False),
    (5, 1, 32, 4, HALF, True),
])
def test_qk_norm_rope_store_matches_reference(num_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm):
    _check_prologue(ops, _gen(9), num_tokens=6, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, block_size=block_size, num_blocks=-(-8 // block_size), dtype=dtype,
                    qk_norm=qk_norm, max_pos=64, tol=_tol(dtype))


def test_qk_norm_rope_store_rejects_bad_inputs():
    rope = RotaryEmbedding(16, 8, 10000.0).to(DEVICE)
    qkv = torch.zeros(3, (4 + 2 * 2) * 16, device=DEVICE)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    weight = torch.ones(16, device=DEVICE)

    def call(qkv=qkv, positions=positions, q_weight=weight, k_weight=weight, k_cache=cache, heads=(4, 2)):
        ops.qk_norm_rope_store(qkv, positions, rope.cos_sin, q_weight, k_weight, 1e-6, k_cache, cache,
                               slots, *heads, 16)

    with pytest.raises(ValueError, match=r"qkv must be \[T, 112\]"):
        call(heads=(3, 2))
    with pytest.raises(ValueError, match=r"unit last stride"):
        call(qkv=torch.zeros(128, 3, device=DEVICE).t())
    with pytest.raises(TypeError, match="unsupported dtype torch.int32"):
        call(qkv=qkv.int())
    with pytest.raises(ValueError, match=r"positions must be int32/int64 \[3\]"):
        call(positions=positions[:2])
    with pytest.raises(ValueError, match="both be given or both be None"):
        call(k_weight=None)
    with pytest.raises(ValueError, match=r"q_weight must be torch.float32 \[16\]"):
        call(q_weight=torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match=r"k_cache must be torch.float32 or torch.float8_e4m3fn \[num_blocks, block_size, 2, 16\]"):
        call(k_cache=cache.half())

@pytest.mark.gpu
@gpu
def test_gpu_fused_ops_realistic():
    gen = _gen(12)
    bf16 = torch.bfloat16
    x, res = _randn(300, 2560, dtype=bf16, gen=gen), _randn(300, 2560, dtype=bf16, gen=gen)
    weight = _randn(2560, dtype=bf16, gen=gen)
    ref, ref_res = rms_norm_torch(x, weight, 1e-5, res)
    out, out_res = ops.rms_norm(x, weight, 1e-5, res)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out_res, ref_res, rtol=0, atol=0)
    up = _randn(300, 2 * 9728, dtype=bf16, gen=gen)
    torch.testing.assert_close(ops.silu_and_mul(up), silu_and_mul_torch(up), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qk_norm", [False, True])
def test_gpu_qk_norm_rope_store_realistic(qk_norm):
    _check_prologue(ops, _gen(14), num_tokens=300, num_heads=32, num_kv_heads=8, head_dim=128,
                    block_size=16, num_blocks=40, dtype=torch.bfloat16, qk_norm=qk_norm, max_pos=4096,
                    tol=2e-2)
