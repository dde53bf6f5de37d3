"""W4A16 kernels (`kernels/w4_gemm.py`) against the dequantized reference, on weights written in the
checkpoint layouts by our quantizer (AWQ GEMM and GPTQ) and repacked as the layer repacks them.

- The repack keeps every value: `dequantize_w4` of the repacked tensors equals `w4.dequantize` of the
  checkpoint's, bit for bit.
- The GEMV (1-4 rows) equals x @ W^T (+ bias) with W from `dequantize_w4`, for group sizes 32/64/128, a
  partial last GPTQ group, row counts and N not multiples of the blocks, chunks that span groups and a
  last chunk cut short.
- `dequantize` (the path above 4 rows) writes `dequantize_w4(...).to(dtype)` bit for bit, and the
  product of more rows equals x @ W^T with W so rounded.
- `gpu`: qwen3-4b's products at M = 1, 4, 16, 256 in bfloat16; two layers inside one CUDA graph.
"""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from kernel_testing import DEVICE, HALF, gpu
from tokenmill.layers.quantized import dequantize_w4, repack_w4
from tokenmill.quant import w4
from tokenmill.quant.formats import W4Config
from tokenmill.quant.quantize import quantize_awq, quantize_gptq


@lru_cache(maxsize=8)
def _layer(method: str, n: int, k: int, group: int, seed: int, sym: bool = False, fmt: str = "gptq"):
    """A random [n, k] weight through the quantizer, repacked: (qweight, scales, zeros) on DEVICE and the
    checkpoint-layout reference W [n, k] (float32, on the CPU). Cached: the gpu tests share layers."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    if method == "awq":
        parts, cfg = quantize_awq(w, group), W4Config("awq", group)
    else:
        parts = quantize_gptq(w, group, sym=sym, checkpoint_format=fmt)
        cfg = W4Config("gptq", group, sym=sym, zero_offset=1 if fmt == "gptq" else 0)
    ref = w4.dequantize(parts["qweight"], parts["qzeros"], parts["scales"], cfg, k).t()
    packed = repack_w4(parts["qweight"], parts["qzeros"], parts["scales"], cfg, k)
    return tuple(t.to(DEVICE) for t in packed), ref


@pytest.mark.parametrize("method,k,group,sym,fmt", [
    ("awq", 256, 128, False, "gptq"), ("awq", 192, 64, False, "gptq"), ("gptq", 80, 32, True, "gptq"),
    ("gptq", 160, 64, False, "gptq"), ("gptq", 96, 32, False, "gptq_v2")])
def test_repack_keeps_every_value(method, k, group, sym, fmt):
    (qweight, scales, zeros), ref = _layer(method, 24, k, group, 1, sym, fmt)
    assert qweight.shape == (24, k // 8) and qweight.dtype == torch.int32
    assert scales.shape == zeros.shape == (24, -(-k // group))
    assert torch.equal(dequantize_w4(qweight, scales, zeros, group).cpu(), ref.t())


def _reference(x, qweight, scales, zeros, bias, group, round_weight):
    # float32 x @ W^T (+ bias); `round_weight`: W rounded to x's dtype first, as the GEMM (and the
    # torch backend) multiply it
    w = dequantize_w4(qweight, scales, zeros, group)
    if round_weight:
        w = w.to(x.dtype).float()
    y = x.float() @ w.t()
    return y + bias.float() if bias is not None else y


def _close(out, ref, dtype):
    assert out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


# (method, M, N, K, group, bias, sym/format): N = 40 is not a multiple of the row blocks; K = 80 with
# group 32 is GPTQ's partial last group and ends in a partial quad of words; a chunk of 128 words
# spans many groups, and K = 2560 takes three chunks, the last cut short
CASES = [("awq", 1, 40, 2560, 128, False, {}), ("awq", 3, 48, 192, 64, True, {}),
         ("gptq", 2, 40, 80, 32, False, dict(sym=True)), ("gptq", 4, 24, 160, 32, True, dict(fmt="gptq_v2"))]


@pytest.mark.parametrize("method,m,n,k,group,bias,opts", CASES)
def test_gemv_matches_dequantized_reference(method, m, n, k, group, bias, opts):
    from tokenmill.layers.kernels import w4_gemm
    (qweight, scales, zeros), _ = _layer(method, n, k, group, 2, **opts)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=gen).to(HALF).to(DEVICE)
    b = (torch.randn(n, generator=gen) * 0.1).to(HALF).to(DEVICE) if bias else None
    out = w4_gemm.w4_linear(x, qweight, scales, zeros, b, group, tile=w4_gemm.W4GemvTile(8, 128, 1))
    assert out.shape == (m, n)
    _close(out.cpu(), _reference(x, qweight, scales, zeros, b, group, False).cpu(), HALF)


@pytest.mark.parametrize("method,n,k,group,opts", [
    ("awq", 40, 2048, 128, {}), ("gptq", 48, 80, 32, dict(sym=False)), ("gptq", 24, 160, 64, dict(fmt="gptq_v2")),
    ("awq", 8, 192, 64, {})])
def test_dequantize_equals_the_reference_bit_for_bit(method, n, k, group, opts):
    # K = 2048 spans two column blocks; 80 and 160 (GPTQ partial groups) and 192 cut one short; N = 40
    # and 24 are not multiples of the row block
    from tokenmill.layers.kernels import w4_gemm
    (qweight, scales, zeros), _ = _layer(method, n, k, group, 4, **opts)
    ref = dequantize_w4(qweight, scales, zeros, group)
    for dtype in (HALF, torch.float32):
        w = w4_gemm.dequantize(qweight, scales, zeros, group, dtype)
        assert w.dtype == dtype and w.shape == (n, k)
        assert torch.equal(w, ref.to(dtype))


@pytest.mark.parametrize("method,m,n,k,group,bias,opts", [
    ("awq", 5, 40, 256, 128, True, {}), ("gptq", 19, 48, 80, 32, False, dict(sym=False))])
def test_more_rows_multiply_the_dequantized_weight(method, m, n, k, group, bias, opts):
    from tokenmill.layers.kernels import w4_gemm
    (qweight, scales, zeros), _ = _layer(method, n, k, group, 4, **opts)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=gen).to(HALF).to(DEVICE)
    b = (torch.randn(n, generator=gen) * 0.1).to(HALF).to(DEVICE) if bias else None
    out = w4_gemm.w4_linear(x, qweight, scales, zeros, b, group)
    _close(out.cpu(), _reference(x, qweight, scales, zeros, b, group, True).cpu(), HALF)


def test_float32_rows_and_shipped_tiles():
    # float32 inputs (as correctness runs use) through both kernels with the tiles w4_linear picks
    from tokenmill.layers.kernels import w4_gemm
    (qweight, scales, zeros), _ = _layer("awq", 32, 128, 32, 6)
    gen = torch.Generator().manual_seed(7)
    for m in (1, 6):
        # magnitudes from 1e-6 to 1e4: the GEMV's scaled subnormal products keep them all
        x = (torch.randn(m, 128, generator=gen) * 10.0 ** (torch.rand(m, 128, generator=gen) * 10 - 6)).to(DEVICE)
        out = w4_gemm.w4_linear(x, qweight, scales, zeros, None, 32)
        _close(out.cpu(), _reference(x, qweight, scales, zeros, None, 32, False).cpu(), torch.float32)


def test_shape_errors_name_the_tensor():
    from tokenmill.layers.kernels import w4_gemm
    (qweight, scales, zeros), _ = _layer("awq", 16, 64, 32, 8)
    x = torch.zeros(1, 64, dtype=HALF, device=DEVICE)
    with pytest.raises(ValueError, match="x must be"):
        w4_gemm.w4_linear(x[:, :32], qweight, scales, zeros, None, 32)
    with pytest.raises(ValueError, match="zeros"):
        w4_gemm.w4_linear(x, qweight, scales, zeros.to(torch.int32), None, 32)
    with pytest.raises(TypeError, match="no tile"):
        w4_gemm.w4_linear(x.expand(5, 64), qweight, scales, zeros, None, 32, tile=w4_gemm.W4GemvTile(8, 128, 1))


QWEN3_4B = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)]     # qkv, o, gate_up, down


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", QWEN3_4B)
@pytest.mark.parametrize("m", [1, 4, 16, 256])
def test_qwen3_4b_shapes_on_gpu(n, k, m):
    from tokenmill.layers.kernels import w4_gemm
    (qweight, scales, zeros), _ = _layer("awq", n, k, 128, 9)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    ref = _reference(x, qweight, scales, zeros, None, 128, m > w4_gemm.GEMV_ROWS)
    _close(w4_gemm.w4_linear(x, qweight, scales, zeros, None, 128), ref, torch.bfloat16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 64])
def test_gptq_with_bias_in_a_cuda_graph(m):
    # two layers in one graph: above GEMV_ROWS each dequantizes into a scratch of the graph's pool
    from tokenmill.layers.kernels import w4_gemm
    layers = [_layer("gptq", 1024, 2560, 128, 11, sym=True)[0], _layer("awq", 2048, 2560, 128, 13)[0]]
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(m, 2560, generator=gen).to(torch.bfloat16).cuda()
    biases = [torch.randn(n, generator=gen).to(torch.bfloat16).cuda() for n in (1024, 2048)]
    for layer, b in zip(layers, biases):
        w4_gemm.w4_linear(x, *layer, b, 128)        # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [w4_gemm.w4_linear(x, *layer, b, 128) for layer, b in zip(layers, biases)]
    x.copy_(torch.randn(m, 2560, generator=gen).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    for out, layer, b in zip(outs, layers, biases):
        _close(out, _reference(x, *layer, b, 128, m > w4_gemm.GEMV_ROWS), torch.bfloat16)


def test_gemv_tile_rule_at_one_row(monkeypatch):
    """On a GPU of 132 SMs (an H200): at one row, o_proj-like products (K < 8192, under three 8-row programs
    an SM) take 4 rows a program, qwen3-4b's qkv and down and nanbeige4.1-3b's qkv 8, nanbeige4.1-3b's down
    its measured 4 (`ONE_ROW_TILES`); four input rows keep the few-row rule (two warps of 128-word chunks),
    and the long-K rule for nanbeige4.1-3b's down."""
    from tokenmill.layers.kernels import w4_gemm
    monkeypatch.setattr(w4_gemm, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    rows = {shape: w4_gemm.gemv_tile(*shape, 1, cuda).block_n
            for shape in [(2560, 4096), (2560, 2560), (6144, 2560), (3584, 2560), (2560, 9728), (2560, 10496)]}
    assert rows == {(2560, 4096): 4, (2560, 2560): 4, (6144, 2560): 8, (3584, 2560): 8, (2560, 9728): 8,
                    (2560, 10496): 4}
    assert w4_gemm.gemv_tile(2560, 4096, 4, cuda) == w4_gemm.W4GemvTile(4, 256, 2)
    assert w4_gemm.gemv_tile(2560, 10496, 4, cuda) == w4_gemm.W4GemvTile(8, 512, 4)
