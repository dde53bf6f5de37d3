"""RMSNorm, SiLU-and-mul (`kernels/fused_ops.py`) and the qkv prologue (`kernels/attention_prologue.py`) against
their references."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import DEVICE, gpu, HALF, _gen, _prologue_reference, _randn, _tol
from tokenmill.layers.activation import act_and_mul_torch
from tokenmill.layers.kernels import attention_prologue, fused_ops as ops
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


# the interpreter's NumPy warns where the GPU's exp quietly gives inf
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_act_and_mul_matches_reference(dtype, act):
    """SiLU, and GELU's tanh approximation (Gemma 3's), of gates out to +-24: where GELU's sigmoid form
    overflows its exp (gate < -10.4) too."""
    gen = _gen(7)
    x = _randn(4, 2 * 40 + 6, dtype=dtype, gen=gen)[:, :80]  # row stride != 2I
    x[:, :40] = torch.linspace(-24, 24, 160, dtype=dtype, device=x.device).view(4, 40)
    torch.testing.assert_close(ops.act_and_mul(x, act), act_and_mul_torch(x, act), rtol=_tol(dtype),
                               atol=_tol(dtype))

def _same_fp8_rows(got, plain, group):
    """`got` (an `Fp8Rows`) holds what `quantize_rows(plain, group)` gives, to the bit."""
    from tokenmill.layers.kernels.fp8_quantize import quantize_rows
    from tokenmill.quant.fp8 import Fp8Rows
    q, scale = quantize_rows(plain, group)
    assert isinstance(got, Fp8Rows) and got.group == group and got.dtype == plain.dtype
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got.scale, scale)


@pytest.mark.parametrize("group", [48, 32, 16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_with_fp8_output_quantizes_the_rows_it_would_write(group, with_residual):
    """RMSNorm writing FP8 rows for the product after it: the rows of the plain kernel quantized as the
    product would quantize them, per row (48) or per 32 (the last group partial) or 16 columns, five rows
    to a program, the residual sum unchanged."""
    gen = _gen(15)
    x = _randn(5, 48, dtype=HALF, gen=gen) * torch.linspace(0.1, 4.0, 5, device=DEVICE, dtype=HALF)[:, None]
    weight = _randn(48, dtype=HALF, gen=gen)
    residual = _randn(5, 48, dtype=HALF, gen=gen) if with_residual else None
    plain = ops.rms_norm(x, weight, 1e-5, residual)
    fused = ops.rms_norm(x, weight, 1e-5, residual, fp8_group=group)
    if with_residual:
        (plain, plain_res), (fused, fused_res) = plain, fused
        assert torch.equal(fused_res, plain_res)
    _same_fp8_rows(fused, plain, group)


@pytest.mark.parametrize("inter,group", [(40, 40), (40, 16), (1100, 1100), (1100, 128)])
def test_silu_and_mul_with_fp8_output_quantizes_the_values_it_would_write(inter, group):
    """SiLU-and-mul writing FP8 rows for down_proj: the plain kernel's values quantized per row (one
    program a row, 2,048 columns wide for 1,100) or per group of columns (groups across two programs of
    a row, the last partial)."""
    gen = _gen(16)
    x = _randn(3, 2 * inter + 4, dtype=HALF, gen=gen)[:, :2 * inter]  # row stride != 2I
    _same_fp8_rows(ops.act_and_mul(x, fp8_group=group), ops.act_and_mul(x), group)


def test_fp8_output_refuses_groups_it_cannot_form():
    x = _randn(2, 48, dtype=HALF, gen=_gen(17))
    with pytest.raises(ValueError, match="group of 24 columns narrower than the row .48. must be a power of two"):
        ops.rms_norm(x, torch.ones(48, dtype=HALF, device=DEVICE), 1e-5, fp8_group=24)
    with pytest.raises(ValueError, match="FP8 output takes x \\[T, N\\] and a weight of x's dtype"):
        ops.rms_norm(x, torch.ones(48, dtype=torch.float32, device=DEVICE), 1e-5, fp8_group=48)


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
    q = attention_prologue.qk_norm_rope_store(qkv, positions, rope.cos_sin, q_weight, k_weight, 1e-6, caches[2],
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
        attention_prologue.qk_norm_rope_store(qkv, positions, rope.cos_sin, q_weight, k_weight, 1e-6, k_cache, cache,
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
    torch.testing.assert_close(ops.act_and_mul(up), act_and_mul_torch(up), rtol=2e-2, atol=2e-2)
    # with FP8 output for the product after them, per row and per 128 columns, as the decoder asks
    for group in (2560, 128):
        fused, fused_res = ops.rms_norm(x, weight, 1e-5, res, fp8_group=group)
        _same_fp8_rows(fused, out, group)
        assert torch.equal(fused_res, out_res)
    plain = ops.act_and_mul(up)
    for group in (9728, 128):
        _same_fp8_rows(ops.act_and_mul(up, fp8_group=group), plain, group)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qk_norm", [False, True])
def test_gpu_qk_norm_rope_store_realistic(qk_norm):
    _check_prologue(ops, _gen(14), num_tokens=300, num_heads=32, num_kv_heads=8, head_dim=128,
                    block_size=16, num_blocks=40, dtype=torch.bfloat16, qk_norm=qk_norm, max_pos=4096,
                    tol=2e-2)
