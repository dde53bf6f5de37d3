"""The FP8-weight kernels (`kernels/fp8_gemm.py`) against their dequantizing torch references: the few-row
W8A16 product (per-channel and 128x128 block scales, partial blocks, bias) and the per-token activation
quantization under the interpreter on the CPU; on the GPU also the W8A8 `_scaled_mm` path, the qwen3-4b
shapes, and an FP8 model under CUDA graphs."""
from __future__ import annotations

import pytest
import torch

from tokenmill.quant import fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def layer(n: int, k: int, block, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    q, s = fp8.quantize(w, block)
    b = torch.randn(n, generator=g) if bias else None
    to = lambda t: None if t is None else t.to(DEVICE)
    return to(q), to(s), block or (1, k), to(b)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("block,bias", [(None, False), ((128, 128), True)])
def test_few_row_product_equals_the_reference(rows, block, bias):
    from tokenmill.layers.kernels.fp8_gemm import fp8_gemv, fp8_linear_torch
    q, s, blk, b = layer(136, 200, block, bias)              # partial blocks along both dims
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = fp8_linear_torch(x, q, s, blk, b)
    torch.testing.assert_close(fp8_gemv(x, q, s, blk, b), want, atol=1e-4, rtol=1e-4)
    if DEVICE == "cuda":
        xb = x.bfloat16()
        torch.testing.assert_close(fp8_gemv(xb, q, s, blk, b.bfloat16() if bias else None).float(),
                                   fp8_linear_torch(x, q, s, blk, b), atol=3e-2, rtol=2e-2)


def test_few_row_product_refuses_more_rows_and_misfit_scales():
    from tokenmill.layers.kernels.fp8_gemm import FEW_ROWS, fp8_gemv
    q, s, blk, _ = layer(64, 64, None, False)
    with pytest.raises(ValueError, match=f"at most {FEW_ROWS} rows"):
        fp8_gemv(torch.zeros(FEW_ROWS + 1, 64, device=DEVICE), q, s, blk)
    with pytest.raises(ValueError, match=r"scale .* does not fit weight \(64, 64\) with block \(128, 128\)"):
        fp8_gemv(torch.zeros(1, 64, device=DEVICE), q, s, (128, 128))


def test_per_token_quantization_equals_the_reference():
    from tokenmill.layers.kernels.fp8_gemm import quantize_rows, quantize_rows_torch
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(2)).to(DEVICE) * torch.tensor(
        [1e-3, 1.0, 30.0, 0.0, 5.0], device=DEVICE)[:, None]           # a zero row too
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rows_torch(x)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=1e-6)
    assert q.dtype == torch.float8_e4m3fn and (q.float() - q_ref.float()).abs().max() == 0
    assert ((q.float() * s - x).abs() <= x.abs() * 2.0 ** -4 + s * 2.0 ** -9).all()


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 4, 8, 64, 300])
@pytest.mark.parametrize("n,k,block", [(6144, 2560, None), (2560, 9728, None), (19456, 2560, None),
                                       (6144, 2560, (128, 128)), (2560, 9728, (128, 128))])
def test_gpu_fp8_linear_on_qwen3_4b_shapes(rows, n, k, block):
    """Every path of `fp8_linear` against the dequantized float32 product: W8A16 within bf16 rounding; the
    W8A8 path within the activations' FP8 rounding (checked against the product of the quantized
    activations, and loosely against the unrounded one)."""
    from tokenmill.layers.kernels.fp8_gemm import FEW_ROWS, fp8_linear, quantize_rows_torch
    q, s, blk, _ = layer(n, k, block, False)
    x = torch.randn(rows, k, device="cuda").bfloat16()
    got = fp8_linear(x, q, s, blk).float()
    w = fp8.dequantize(q, s, blk)
    exact = x.float() @ w.t()
    scale = exact.abs().mean()
    if rows <= FEW_ROWS or block is not None:
        assert (got - exact).abs().max() / scale < 0.05
    else:
        xq, xs = quantize_rows_torch(x)
        w8a8 = (xq.float() * xs) @ w.t()
        assert (got - w8a8).abs().max() / scale < 0.05
        assert (got - exact).abs().mean() / scale < 0.1


@gpu
@needs_cuda
def test_gpu_fp8_model_under_cuda_graphs(tmp_path, save_tiny_model):
    """A plain tiny model quantized at load on the GPU: greedy tokens through the decode graphs equal the
    eager ones, and the teacher-forced log-probs stay close to the CPU's dequantizing reference."""
    from tokenmill import LLM, SamplingParams
    from test_real_model import engine_logprobs
    path = str(tmp_path / "plain")
    save_tiny_model(path, "qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64)
    prompts = [[(5 * i + 7 * j) % 500 for j in range(n)] for i, n in enumerate([3, 20, 41, 9])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    config = dict(quantization="fp8", max_num_seqs=4, num_kv_blocks=64, dtype="bfloat16")
    graphs = LLM(path, device="cuda", **config)
    assert graphs.engine.runner.graphs
    eager = LLM(path, device="cuda", enforce_eager=True, **config)
    assert [o.outputs[0].token_ids for o in graphs.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    ids = [(7 * i + 3) % 500 for i in range(40)]
    ours = engine_logprobs(graphs, ids).float().cpu()
    ref = engine_logprobs(LLM(path, device="cpu", quantization="fp8", num_kv_blocks=8), ids)
    assert (ours - ref).abs().mean() < 0.1
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
