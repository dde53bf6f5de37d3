"""The KV-cache writers and readers with an FP8 (E4M3) cache and non-unit per-layer scales, against the
references of attention.py (`store_kvcache_torch` / `paged_attention_torch` with `kv_scale`).

Readers get a cache quantized by torch, so both sides read the same bytes; stores must give torch's
bytes (round to nearest even, as the GPU's cvt; conftest.py gives the interpreter that rounding), up to
one E4M3 step where k before the division differs by a rounding.
"""
from __future__ import annotations

import pytest
import torch

from kernel_testing import (DEVICE, HALF, HAS_CUDA, _gen, _paged_cache, _prologue_reference, _randn, _tol,
                            fp8_model_tokens, gpu)
from tokenmill.layers.attention import FP8_KV_DTYPE, paged_attention_torch, quantize_kv_torch
from tokenmill.layers.kernel_config import SHIPPED_FP8_DECODE, DecodeAttentionConfig, PrefillAttentionConfig
from tokenmill.layers.kernels import decode_attention as da
from tokenmill.layers.kernels import attention_prologue as ops
from tokenmill.layers.kernels import paged_attention as pa
from tokenmill.layers.rotary import RotaryEmbedding

# K's scale small enough that the largest |k| / scale pass 448 and saturate; V's a plain power of two
KV_SCALE = (0.002, 0.25)


def _scales(k=KV_SCALE[0], v=KV_SCALE[1]):
    return torch.tensor([k, v], dtype=torch.float32, device=DEVICE)


def _fp8_cache(k_cache, v_cache, kv_scale):
    return quantize_kv_torch(k_cache, kv_scale[0]), quantize_kv_torch(v_cache, kv_scale[1])


def _assert_fp8_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within one E4M3 step (1/8 relative, 2^-9 near zero) and mostly equal: k before its division can
    differ from the reference's by one rounding of the input dtype, which moves E4M3 ties."""
    assert out.dtype == ref.dtype == FP8_KV_DTYPE
    o, r = out.float(), ref.float()
    assert not o.isnan().any()
    torch.testing.assert_close(o, r, rtol=0.125, atol=2 ** -9)
    assert (o == r).float().mean() > 0.9


def test_quantize_saturates_instead_of_nan():
    x = torch.tensor([1e4, -1e4, 448.0, 3.0, 0.0])
    q = quantize_kv_torch(x, torch.tensor(1.0))
    assert q.float().tolist() == [448.0, -448.0, 448.0, 3.0, 0.0]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,qk_norm", [
    (4, 2, 16, 4, torch.float32, True),
    (5, 1, 32, 1, HALF, False),
])
def test_qk_norm_rope_store_into_fp8_cache(num_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm):
    gen = _gen(41)
    num_tokens, num_blocks = 7, -(-10 // block_size)
    rope = RotaryEmbedding(head_dim, 64, 10000.0).to(DEVICE)
    qkv = 2 * _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[3] = -1
    slots = slots.to(DEVICE)
    weights = [_randn(head_dim, dtype=dtype, gen=gen) if qk_norm else None for _ in range(2)]
    poison = 80.0                 # what untouched slots keep (an E4M3 value)
    caches = [torch.full((num_blocks, block_size, num_kv_heads, head_dim), poison, device=DEVICE).to(FP8_KV_DTYPE)
              for _ in range(4)]
    kv_scale = _scales()
    ref_q = _prologue_reference(qkv, positions, rope.cos_sin, *weights, 1e-6, caches[0], caches[1], slots,
                                num_heads, num_kv_heads, head_dim, kv_scale)
    q = ops.qk_norm_rope_store(qkv, positions, rope.cos_sin, *weights, 1e-6, caches[2], caches[3], slots,
                               num_heads, num_kv_heads, head_dim, kv_scale=kv_scale)
    torch.testing.assert_close(q, ref_q, rtol=_tol(dtype), atol=_tol(dtype))
    _assert_fp8_close(caches[2], caches[0])
    _assert_fp8_close(caches[3], caches[1])
    assert caches[2].float().abs().max() == 448.0          # some k / scale saturated
    written = caches[2].view(-1, num_kv_heads, head_dim)[slots[slots >= 0]]
    assert (written.float() != poison).any()
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    assert torch.all(caches[3].view(-1, num_kv_heads, head_dim)[untouched].float() == poison)


@pytest.mark.parametrize("group,block_size,dtype,window,softcap", [
    (5, 16, torch.float32, None, None), (4, 4, HALF, None, None), (4, 4, HALF, 8, 2.0)])
def test_prefill_attention_over_fp8_cache(group, block_size, dtype, window, softcap):
    """Prefill chunks and decode rows over an FP8 cache, K's scale folded into the scores' (before a soft cap
    and within a sliding window where a layer has them), V's applied to the output."""
    gen = _gen(43)
    num_kv_heads, head_dim = 2, 16
    q_lens, seq_lens = [5, 1, 23, 17], [5, 40, 30, 17]
    k_cache, v_cache, table = _paged_cache(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, gen)
    kv_scale = _scales(0.01, 0.25)
    k8, v8 = _fp8_cache(k_cache, v_cache, kv_scale)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = _randn(sum(q_lens), group * num_kv_heads, head_dim, dtype=dtype, gen=gen)
    ref = paged_attention_torch(q, k8, v8, table, ctx, qsl, 0.3, kv_scale, window=window, softcap=softcap)
    out = pa.paged_prefill_attention(q, k8, v8, table, ctx, qsl, max(q_lens), 0.3,
                                     config=PrefillAttentionConfig(16, 16, 4, 1), kv_scale=kv_scale,
                                     window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))
    # the scales are applied: the same bytes read as if their scale were 1 give another result
    plain = paged_attention_torch(q, k8, v8, table, ctx, qsl, 0.3, _scales(1.0, 1.0), window=window, softcap=softcap)
    assert (plain - ref).abs().max() > 0.1
    if softcap is not None:     # the cap bites on these scores: without it the output moves
        uncapped = paged_attention_torch(q, k8, v8, table, ctx, qsl, 0.3, kv_scale, window=window)
        assert (uncapped - ref).abs().max() > 0.05


def _check_fp8_rows(rows, plain: torch.Tensor, v_scale: float, group: int) -> None:
    """An attention output written for an FP8 product (`attention_common.out_rows`): E4M3 at V's scale,
    each row's scales V's, against the plain output of the same kernel (float32, V's scale a power of
    two: the same values, so the same codes)."""
    from tokenmill.quant.fp8 import Fp8Rows
    assert isinstance(rows, Fp8Rows) and rows.group == group and rows.dtype == plain.dtype
    t, width = plain.shape[0], plain.shape[1] * plain.shape[2]
    assert rows.q.shape == (t, width) and rows.q.dtype == FP8_KV_DTYPE
    assert rows.scale.shape == (t, -(-width // group)) and torch.all(rows.scale == v_scale)
    want = quantize_kv_torch(plain.reshape(t, width), torch.tensor(v_scale, device=DEVICE))
    assert torch.equal(rows.q.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("group,num_splits", [(None, None), (16, 3)])
def test_attention_output_for_an_fp8_product(group, num_splits):
    """With `out_group`, the prefill and decode-rows kernels (one split a decode row, and three merged)
    and the one-kernel decode (one program a sequence, and four splits merged) write the output in E4M3
    at V's scale for an FP8 o_proj (one scale a row, and one per 16 columns), the codes of the plain
    output divided by V's scale."""
    gen = _gen(53)
    num_kv_heads, head_dim, heads = 2, 16, 4
    width = heads * head_dim
    q_lens, seq_lens = [5, 1, 23, 1], [5, 40, 30, 17]
    k_cache, v_cache, table = _paged_cache(seq_lens, 4, num_kv_heads, head_dim, torch.float32, gen)
    kv_scale = _scales(0.01, 0.25)
    k8, v8 = _fp8_cache(k_cache, v_cache, kv_scale)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = _randn(sum(q_lens), heads, head_dim, gen=gen)
    args = (q, k8, v8, table, ctx, qsl, max(q_lens), 0.3)
    kw = dict(config=PrefillAttentionConfig(16, 16, 4, 1), kv_scale=kv_scale, num_splits=num_splits or 1,
              decode_config=DecodeAttentionConfig(16, min_split_len=16))
    plain = pa.paged_prefill_attention(*args, **kw)
    _check_fp8_rows(pa.paged_prefill_attention(*args, **kw, out_group=group or width), plain, 0.25, group or width)
    with pytest.raises(ValueError, match="needs an FP8 KV cache"):
        pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, max(q_lens), 0.3, out_group=width)

    decode_lens = [1, 37, 0, 70, 16]
    batch = len(decode_lens)
    k_cache, v_cache, table = _paged_cache(decode_lens, 4, num_kv_heads, head_dim, torch.float32, gen)
    k8, v8 = _fp8_cache(k_cache, v_cache, kv_scale)
    ctx = torch.tensor(decode_lens, dtype=torch.int32, device=DEVICE)
    positions = (ctx - 1).clamp(min=0).long()
    pages = table.long().gather(1, (positions // 4)[:, None])[:, 0]
    slots = torch.where(ctx > 0, pages * 4 + positions % 4, -1)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0).to(DEVICE)
    qkv = _randn(batch, (heads + 2 * num_kv_heads) * head_dim, gen=gen)
    dargs = (qkv, positions, rope.cos_sin, None, None, 1e-6, k8, v8, slots, table, ctx, head_dim ** -0.5, heads,
             num_kv_heads, head_dim)
    dkw = dict(num_splits=4 if num_splits else 1, config=DecodeAttentionConfig(16, min_split_len=16),
               kv_scale=kv_scale)
    plain = da.fused_decode_attention(*dargs, **dkw)
    rows = da.fused_decode_attention(*dargs, **dkw, out_group=group or width)   # stores the same new k, v again
    _check_fp8_rows(rows, plain, 0.25, group or width)
    assert torch.all(rows.q[2].float() == 0)        # the padded slot (context 0)


def _check_fused_decode_fp8(gen, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm,
                            num_splits, config, tol, out_group=None):
    batch = len(seq_lens)
    k_cache, v_cache, table = _paged_cache(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, gen)
    kv_scale = _scales(0.02, 0.25)
    k8, v8 = _fp8_cache(k_cache, v_cache, kv_scale)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    positions = (ctx - 1).clamp(min=0).long()
    pages = table.long().gather(1, (positions // block_size)[:, None])[:, 0]
    slots = torch.where(ctx > 0, pages * block_size + positions % block_size, -1)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0).to(DEVICE)
    qkv = _randn(batch, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    weights = [_randn(head_dim, dtype=dtype, gen=gen) if qk_norm else None for _ in range(2)]
    ref_k, ref_v = k8.clone(), v8.clone()
    q = _prologue_reference(qkv, positions, rope.cos_sin, *weights, 1e-6, ref_k, ref_v, slots, num_heads,
                            num_kv_heads, head_dim, kv_scale)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_torch(q, ref_k, ref_v, table, ctx, qsl, head_dim ** -0.5, kv_scale)
    out = da.fused_decode_attention(qkv, positions, rope.cos_sin, *weights, 1e-6, k8, v8, slots, table, ctx,
                                    head_dim ** -0.5, num_heads, num_kv_heads, head_dim, num_splits=num_splits,
                                    config=config, kv_scale=kv_scale)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    _assert_fp8_close(k8, ref_k)
    _assert_fp8_close(v8, ref_v)
    if out_group is not None:       # the output for an FP8 o_proj: E4M3 at V's scale (the new k, v stored again)
        rows = da.fused_decode_attention(qkv, positions, rope.cos_sin, *weights, 1e-6, k8, v8, slots, table, ctx,
                                         head_dim ** -0.5, num_heads, num_kv_heads, head_dim, num_splits=num_splits,
                                         config=config, kv_scale=kv_scale, out_group=out_group)
        assert torch.all(rows.scale == kv_scale[1])
        torch.testing.assert_close(rows.q.float().view_as(ref) * kv_scale[1], ref.float(), rtol=1 / 16, atol=tol)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_fused_decode_attention_over_fp8_cache(num_splits):
    # one program per sequence, and several splits merged in the kernel; a padded slot (context 0)
    _check_fused_decode_fp8(_gen(47), [1, 37, 0, 70, 16], 4, 2, 16, 4, torch.float32, True, num_splits,
                            DecodeAttentionConfig(16, min_split_len=16), 1e-4)


def test_fp8_cache_needs_its_scales():
    k_cache, v_cache, table = _paged_cache([8], 4, 1, 16, torch.float32, _gen(5))
    k8, v8 = _fp8_cache(k_cache, v_cache, _scales())
    qsl = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([8], dtype=torch.int32, device=DEVICE)
    q = _randn(8, 2, 16)
    with pytest.raises(ValueError, match="needs kv_scale"):
        pa.paged_prefill_attention(q, k8, v8, table, ctx, qsl, 8, 0.3)
    with pytest.raises(ValueError, match="kv_scale is for an torch.float8_e4m3fn cache"):
        pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, 8, 0.3, kv_scale=_scales())


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the engine runs these kernels over its FP8 cache itself "
                                      "(tests/test_kv_fp8.py::test_gpu_fp8_cache_with_cuda_graphs)")
def test_engine_fp8_cache_through_the_kernels(qwen3_dir):
    """The engine with an FP8 cache whose attention runs the Triton prologue, prefill kernel and one-kernel
    decode (interpreted on the CPU) gives the tokens of the torch reference over the same FP8 cache."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.backend import TorchBackend

    class Kernels(TorchBackend):
        def qk_norm_rope_store(self, *args, **kwargs):
            return ops.qk_norm_rope_store(*args, **kwargs)

        def attend(self, q, k_cache, v_cache, meta, scale, kv_scale=None, into=None, window=None, softcap=None):
            return pa.paged_attention(q, k_cache, v_cache, meta, scale, kv_scale=kv_scale, window=window,
                                      softcap=softcap)

        def decode_attention(self, input_ids, meta):
            if not meta.is_pure_decode(input_ids.shape[0]):
                return None
            return lambda *args, into=None, **kwargs: da.fused_decode_attention(*args, **kwargs)

    prompts = [[5, 9, 31, 7, 200, 3, 3, 41, 9, 4], [12], [7, 7, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def run(backend=None):
        llm = LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, kv_cache_dtype="fp8")
        assert llm.engine.runner.kv_cache.dtype == FP8_KV_DTYPE
        if backend is not None:
            llm.engine.runner.model.use_backend(backend)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert run(Kernels()) == run()


@pytest.mark.skipif(HAS_CUDA, reason="a CPU engine on the interpreter's kernels; a CUDA host compiles them for the GPU")
def test_fp8_model_takes_o_proj_input_from_the_attention_kernels(tmp_path, save_tiny_model):
    """FP8 weights and an FP8 cache on the Triton backend: o_proj takes its input rows in E4M3 at V's
    scale (the engine's 1.0) from the attention kernels, the prefill step's and the one-kernel decode's,
    and the greedy tokens and log-probs equal those of the plain kernels' output quantized at that scale
    by torch before o_proj."""
    from tokenmill.layers.backend import TritonBackend
    from tokenmill.quant.fp8 import Fp8Rows
    path = str(tmp_path / "plain")
    save_tiny_model(path, "qwen3", hidden_size=256, intermediate_size=384, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, num_hidden_layers=1)
    taken = []

    def o_proj(layer) -> bool:
        return layer.in_features == 256 and layer.out_features == 256       # down_proj takes 384

    class Kernels(TritonBackend):
        def linear_unscaled(self, layer, x):
            if o_proj(layer):
                taken.append(isinstance(x, Fp8Rows) and bool(torch.all(x.scale == 1.0)))
            return super().linear_unscaled(layer, x)

    class QuantizedByTorch(TritonBackend):
        _out_group = staticmethod(lambda kv_scale, into: None)

        def linear_unscaled(self, layer, x):
            if o_proj(layer):
                taken.append(isinstance(x, Fp8Rows))
                one = torch.ones(x.shape[0], 1)
                x = Fp8Rows(quantize_kv_torch(x, one[0, 0]), one, x.shape[1], x.dtype)
            return super().linear_unscaled(layer, x)

    def run(backend):      # the engine's FP8 cache has scales of 1.0, which QuantizedByTorch assumes
        return fp8_model_tokens(path, backend, 20, kv_cache_dtype="fp8", enforce_eager=True)
    by_torch = run(QuantizedByTorch())
    assert taken and not any(taken)
    taken.clear()
    assert run(Kernels()) == by_torch
    assert len(taken) == 2 and all(taken)          # the prefill step and a decode step


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (20, 4)])
def test_gpu_fp8_cache_realistic(num_q_heads, num_kv_heads):
    gen = _gen(53)
    bf16 = torch.bfloat16
    # 33 sequences fill an H200's 132 SMs with (sequence, kv head) programs: split in a few, the shipped
    # launch takes its one-warp tiles (`filled`)
    _check_fused_decode_fp8(gen, torch.randint(1, 2100, (33,), generator=gen).tolist(), num_q_heads, num_kv_heads,
                            128, 16, bf16, num_q_heads == 32, None, SHIPPED_FP8_DECODE, 2e-2, out_group=128)
    _check_fused_decode_fp8(gen, [1500], num_q_heads, num_kv_heads, 128, 16, bf16, True, None, SHIPPED_FP8_DECODE, 2e-2)
    # one split: the shipped launch for an FP8 cache takes its narrower tiles (`one_split`)
    _check_fused_decode_fp8(gen, torch.randint(1, 2100, (33,), generator=gen).tolist(), num_q_heads, num_kv_heads,
                            128, 16, bf16, True, 1, SHIPPED_FP8_DECODE, 2e-2, out_group=num_q_heads * 128)
    q_lens, seq_lens = [300, 1, 64, 700], [1300, 900, 64, 700]
    k_cache, v_cache, table = _paged_cache(seq_lens, 16, num_kv_heads, 128, torch.float32, gen)
    kv_scale = _scales(0.05, 0.25)
    k8, v8 = _fp8_cache(k_cache, v_cache, kv_scale)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = _randn(sum(q_lens), num_q_heads, 128, dtype=bf16, gen=gen)
    ref = paged_attention_torch(q, k8, v8, table, ctx, qsl, 128 ** -0.5, kv_scale)
    out = pa.paged_prefill_attention(q, k8, v8, table, ctx, qsl, max(q_lens), 128 ** -0.5, kv_scale=kv_scale)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    # the output for an FP8 o_proj (one scale a row, and Qwen's 128-column blocks): E4M3 at V's scale
    for group in (num_q_heads * 128, 128):
        rows = pa.paged_prefill_attention(q, k8, v8, table, ctx, qsl, max(q_lens), 128 ** -0.5, kv_scale=kv_scale,
                                          out_group=group)
        assert torch.all(rows.scale == 0.25)
        torch.testing.assert_close(rows.q.float().view_as(ref) * 0.25, ref.float(), rtol=1 / 16, atol=2e-2)
    rope = RotaryEmbedding(128, 4096, 1e6).to(DEVICE)
    qkv = 4 * _randn(64, (num_q_heads + 2 * num_kv_heads) * 128, dtype=bf16, gen=gen)
    slots = torch.randperm(k8.shape[0] * 16, generator=gen)[:64].to(DEVICE)
    caches = [torch.zeros_like(k8) for _ in range(4)]
    _prologue_reference(qkv, slots % 4096, rope.cos_sin, None, None, 1e-6, caches[0], caches[1], slots,
                        num_q_heads, num_kv_heads, 128, kv_scale)
    ops.qk_norm_rope_store(qkv, slots % 4096, rope.cos_sin, None, None, 1e-6, caches[2], caches[3], slots,
                           num_q_heads, num_kv_heads, 128, kv_scale=kv_scale)
    _assert_fp8_close(caches[2], caches[0])
    _assert_fp8_close(caches[3], caches[1])
