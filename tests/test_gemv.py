"""The few-row GEMV kernel against F.linear (and silu_and_mul), under Triton's interpreter on the CPU
and compiled on a GPU; the model's linear layers take it only for small CUDA batches."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_kernels import DEVICE, HALF, HAS_CUDA, _gen, _kernels, _randn, gpu

from tokenmill.layers.activation import silu_and_mul_torch


def _gemv_module():
    _kernels()                       # sets up the interpreter on the CPU
    from tokenmill.layers.kernels import gemv
    return gemv


def _reference(x, weight, bias=None, silu_mul=False):
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return silu_and_mul_torch(out.float()).to(x.dtype) if silu_mul else out


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(37, 64), (64, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_gemv_matches_linear(rows, n, k, dtype):
    gemv = _gemv_module()
    gen = _gen(rows * 100 + n + k)
    x = _randn(rows, k, dtype=dtype, gen=gen)
    weight = _randn(n, k, dtype=dtype, gen=gen) / k ** 0.5
    bias = _randn(n, dtype=dtype, gen=gen)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for b in (None, bias):
        out = gemv.gemv(x, weight, b, config={"block_n": 4, "block_k": 32})
        torch.testing.assert_close(out, _reference(x, weight, b), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [1, 5])
def test_gemv_silu_mul_on_strided_rows(rows):
    """Packed [gate | up] weight, x a column slice of a wider tensor (row stride != K)."""
    gemv = _gemv_module()
    gen = _gen(7)
    wide = _randn(rows, 80, gen=gen)
    x = wide[:, 8:72]
    weight = _randn(2 * 24, 64, gen=gen) / 8
    out = gemv.gemv(x, weight, silu_mul=True, config={"block_n": 8, "block_k": 64})
    assert out.shape == (rows, 24)
    torch.testing.assert_close(out, _reference(x, weight, silu_mul=True), rtol=1e-4, atol=1e-4)


def test_gemv_rejects_bad_inputs():
    gemv = _gemv_module()
    x = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="MAX_ROWS"):
        gemv.gemv(torch.zeros(gemv.MAX_ROWS + 1, 16, device=DEVICE), torch.zeros(4, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        gemv.gemv(x, torch.zeros(4, 8, device=DEVICE))
    with pytest.raises(TypeError, match="dtype"):
        gemv.gemv(x, torch.zeros(4, 16, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="even N"):
        gemv.gemv(x, torch.zeros(5, 16, device=DEVICE), silu_mul=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("n,k,silu", [(6144, 2560, False), (2560, 9728, False), (19456, 2560, True),
                                      (151936, 2560, False)])
def test_gpu_gemv_realistic(rows, n, k, silu):
    gemv = _gemv_module()
    gen = _gen(rows + n)
    x = _randn(rows, k, dtype=torch.bfloat16, gen=gen)
    weight = _randn(n, k, dtype=torch.bfloat16, gen=gen) / k ** 0.5
    out = gemv.gemv(x, weight, silu_mul=silu)
    ref = _reference(x, weight, silu_mul=silu)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 1e-2


def test_linear_layers_take_gemv_only_for_small_cuda_batches(monkeypatch):
    """The dispatch rule, checked without a GPU: CPU tensors and large batches use F.linear."""
    from tokenmill.layers import linear
    calls = []
    monkeypatch.setattr(linear, "_gemv", lambda *a, **kw: calls.append(a[0].shape) or F.linear(a[0], a[1], a[2]))
    layer = linear.Linear(16, 8, bias=False)
    x = torch.randn(2, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    assert calls == []                                   # CPU: never the kernel
    monkeypatch.setattr(linear, "_use_gemv", lambda x, w: x.shape[0] <= 8)
    layer(x)
    layer(torch.randn(9, 16))
    assert calls == [(2, 16)]
