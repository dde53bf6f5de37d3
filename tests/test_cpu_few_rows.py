"""The decoder's `Linear` on the CPU: 2-8 rows of a weight larger than the caches are taken as W x^T (MKL's
x W^T runs up to twice as long there), everything else through F.linear; the same values either way."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tokenmill.layers.quantized import Linear


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.linear = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.linear += func is F.linear
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows,out_features,in_features,bias,transposed", [
    (1, 8192, 576, False, False),      # one row: a GEMV already reads W once
    (2, 8192, 576, True, True),        # 4.7M weights, 2-4 rows
    (4, 8192, 576, False, True),
    (8, 8192, 576, False, False),      # 8 rows of 4.7M: x W^T is as fast
    (8, 32768, 576, True, True),       # 18.9M weights, up to 8 rows
    (16, 32768, 576, False, False),    # a batch: sgemm's own blocking wins
    (4, 1536, 576, False, False),      # a weight that fits the caches
])
def test_few_rows_of_a_large_weight_take_w_x_transposed(rows, out_features, in_features, bias, transposed):
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=bias)
    x = torch.randn(rows, in_features)
    with torch.no_grad(), _Calls() as calls:
        y = layer(x)
    assert calls.linear == (0 if transposed else 1)
    assert y.shape == (rows, out_features) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_keep_f_linear():
    layer = Linear(576, 8192, bias=False).to(torch.bfloat16)
    with torch.no_grad(), _Calls() as calls:
        layer(torch.randn(4, 576, dtype=torch.bfloat16))
    assert calls.linear == 1
