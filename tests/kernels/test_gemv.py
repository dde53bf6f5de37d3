"""Single-token products (`kernels/gemv.py`): every tile against `fused_linear_torch`."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import DEVICE, HALF, _gen, _randn, _tol, gpu
from tokenmill.layers.kernel_config import KernelConfig, RegisterTile, SmemTile, WholeRowTile
from tokenmill.layers.kernels import gemv


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("norm,residual,act,bias", [
    (False, False, None, False), (False, False, None, True), (True, False, None, False),
    (True, True, None, True), (True, True, "silu", False), (True, True, "gelu_pytorch_tanh", False)])
def test_fused_linear_matches_reference(dtype, norm, residual, act, bias):
    gen = _gen(21)
    n, k = 44, 200   # 11 row blocks of 4 over 4 programs: each program loops; k is 7 ragged chunks of 32
    x, w = _randn(1, k, dtype=dtype, gen=gen), _randn(n, k, dtype=dtype, gen=gen) / 8
    kwargs = dict(bias=_randn(n, dtype=dtype, gen=gen) if bias else None,
                  norm_weight=_randn(k, dtype=dtype, gen=gen) if norm else None, eps=1e-5,
                  residual=_randn(1, k, dtype=dtype, gen=gen) if residual else None, act=act)
    ref, ref_res = gemv.fused_linear_torch(x, w, **kwargs)
    out, out_res = gemv.fused_linear(x, w, tile=RegisterTile(4, 32, 4, 1), **kwargs)
    assert out.shape == ((1, n // 2) if act else (1, n))
    torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))
    if not norm:
        assert out_res is None
    elif residual:
        torch.testing.assert_close(out_res, ref_res, rtol=0, atol=0)
    else:
        assert out_res is x


def test_fused_linear_shared_memory_tile_falls_back_where_it_cannot_run():
    # a tile table entry SmemTile for a product in float32 (as correctness checks run the presets):
    # the product runs with the default register tile; asked for explicitly, the tile is refused by name
    gen = _gen(22)
    x, w = _randn(1, 256, gen=gen), _randn(64, 256, gen=gen) / 8
    kernels = KernelConfig(tiles={(64, 256, False): SmemTile(8, 256, 4)}, default_tile=RegisterTile(4, 64, 4, 2))
    out, _ = gemv.fused_linear(x, w, kernels=kernels)
    torch.testing.assert_close(out, gemv.fused_linear_torch(x, w)[0], rtol=_tol(torch.float32),
                               atol=_tol(torch.float32))
    with pytest.raises((ValueError,), match="16-bit|no Gluon"):
        gemv.fused_linear(x, w, tile=SmemTile(8, 256, 4))


@pytest.mark.parametrize("n,k", [(44, 200), (37, 128), (9, 96)])
def test_fused_linear_whole_row_tiles_match_reference(n, k):
    """("whole", ...) tiles: a row block's K columns in one load of a power of two and one of the rest
    (k = 200: 128 + 128 with 56 masked; 128: one load; 96: 64 + 32), the next block's loads issued
    ahead, one or several blocks per program, the last cut short, each with and without a norm,
    residual, bias, SiLU- and GELU-and-mul (gate and up rows) and gathered input row."""
    gen = _gen(24)
    dtype = HALF
    x, w = _randn(1, k, dtype=dtype, gen=gen), _randn(n, k, dtype=dtype, gen=gen) / 8
    norm, res, bias = _randn(k, dtype=dtype, gen=gen), _randn(1, k, dtype=dtype, gen=gen), _randn(n, dtype=dtype, gen=gen)
    cases = [{}, dict(bias=bias), dict(norm_weight=norm, eps=1e-5), dict(norm_weight=norm, eps=1e-5, residual=res, bias=bias),
             dict(norm_weight=norm, eps=1e-5, residual=res, act="silu"),
             dict(norm_weight=norm, eps=1e-5, residual=res, act="gelu_pytorch_tanh")]
    if n % 2:
        del cases[-2:]
    for kwargs in cases:
        ref, ref_res = gemv.fused_linear_torch(x, w, **kwargs)
        for tile in [WholeRowTile(4, 4, 1), WholeRowTile(2, 1, 3), WholeRowTile(16, 4, 1)]:
            out, out_res = gemv.fused_linear(x, w, tile=tile, **kwargs)
            torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))
            if "residual" in kwargs:
                torch.testing.assert_close(out_res, ref_res, rtol=0, atol=0)
            elif "norm_weight" in kwargs:
                assert out_res is x
    table, ids = _randn(5, k, dtype=dtype, gen=gen), torch.tensor([3], dtype=torch.int64, device=DEVICE)
    out, out_res = gemv.fused_linear(table, w, tile=WholeRowTile(4, 4, 1), norm_weight=norm, eps=1e-5, ids=ids)
    ref, _ = gemv.fused_linear_torch(table, w, norm_weight=norm, eps=1e-5, ids=ids)
    torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))
    assert torch.equal(out_res, table[3:4])


def test_fused_linear_whole_row_tiles_name_their_limits():
    x, w = torch.zeros(1, 256, device=DEVICE), torch.zeros(64, 256, device=DEVICE)
    with pytest.raises(ValueError, match="row block of 256 x 256 weights is over the 32768"):
        gemv.fused_linear(x, w, tile=WholeRowTile(256, 4, 1))
    with pytest.raises(ValueError, match="row block of 256 x 256 weights"):   # gate and up rows
        gemv.fused_linear(torch.zeros(1, 256, device=DEVICE), torch.zeros(512, 256, device=DEVICE),
                          tile=WholeRowTile(128, 4, 1), act="silu")
    kernels = KernelConfig(tiles={(64, 256, False): WholeRowTile(256, 4, 1)})   # a table entry falls back
    torch.testing.assert_close(gemv.fused_linear(x, w, kernels=kernels)[0], torch.zeros(1, 64, device=DEVICE))


@pytest.mark.parametrize("silu,bias", [(False, True), (True, False)])
def test_fused_linear_gathers_its_input_from_the_embedding_table(silu, bias):
    # the first product of a step: the input is row ids[0] of the table, returned as the residual too
    gen = _gen(23)
    n, k = 44, 200
    table, w = _randn(9, k, gen=gen), _randn(n, k, gen=gen) / 8
    ids = torch.tensor([6], dtype=torch.int64, device=DEVICE)
    kwargs = dict(bias=_randn(n, gen=gen) if bias else None, norm_weight=_randn(k, gen=gen), eps=1e-5,
                  act="silu" if silu else None)
    out, res = gemv.fused_linear(table, w, tile=RegisterTile(4, 32, 4, 1), ids=ids, **kwargs)
    ref, ref_res = gemv.fused_linear_torch(table, w, ids=ids, **kwargs)
    torch.testing.assert_close(out, ref, rtol=_tol(torch.float32), atol=_tol(torch.float32))
    row = table[6:7].clone()      # the same kernel on the row given: the same sums
    torch.testing.assert_close(out, gemv.fused_linear(row, w, tile=RegisterTile(4, 32, 4, 1), **kwargs)[0], rtol=0, atol=0)
    assert torch.equal(res, table[6:7]) and torch.equal(ref_res, res)
    with pytest.raises(ValueError, match="need a norm, no residual"):
        gemv.fused_linear(table, w, ids=ids)
    with pytest.raises(ValueError, match="ids must be int64"):
        gemv.fused_linear(table, w, ids=ids.int(), **kwargs)

def test_fused_linear_rejects_bad_inputs():
    x, w = torch.zeros(1, 8, device=DEVICE), torch.zeros(6, 8, device=DEVICE)
    with pytest.raises(ValueError, match="M <= 1"):
        gemv.fused_linear(torch.zeros(2, 8, device=DEVICE), w)
    with pytest.raises(ValueError, match="share K"):
        gemv.fused_linear(torch.zeros(1, 7, device=DEVICE), w)
    with pytest.raises(ValueError, match="needs a norm"):
        gemv.fused_linear(x, w, residual=x)
    with pytest.raises(ValueError, match="even number"):
        gemv.fused_linear(x, torch.zeros(5, 8, device=DEVICE), act="silu")
    with pytest.raises(ValueError, match="no bias"):
        gemv.fused_linear(x, w, torch.zeros(6, device=DEVICE), act="silu")

def _check_tile_cases(gemv, x, w, tile, cases):
    # a tile at layer sizes against the reference, for each set of options; the residual out exactly
    for kwargs in cases:
        got, got_res = gemv.fused_linear(x, w, tile=tile, **kwargs)
        ref, ref_res = gemv.fused_linear_torch(x, w, **kwargs)
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
        if "residual" in kwargs:
            torch.testing.assert_close(got_res, ref_res, rtol=0, atol=0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k,tile", [(6144, 2560, WholeRowTile(2, 4, 6)), (6144, 2560, WholeRowTile(4, 4, 4)),
                                      (2570, 4096, WholeRowTile(2, 4, 4)), (1001, 9728, WholeRowTile(2, 8, 1)),
                                      (19458, 2560, WholeRowTile(2, 4, 4))])
def test_gpu_fused_linear_whole_row_tiles(n, k, tile):
    """("whole", ...) tiles at layer sizes against the reference, with and without a norm, residual and
    bias and SiLU-and-mul (even n), the last block cut short (2570, 1001, and 9729 gate
    rows), K of two loads (2560, 9728) or one."""
    gen = _gen(18)
    bf16 = torch.bfloat16
    x, w = _randn(1, k, dtype=bf16, gen=gen), _randn(n, k, dtype=bf16, gen=gen) / 50
    norm, res = 1 + _randn(k, dtype=bf16, gen=gen) / 10, _randn(1, k, dtype=bf16, gen=gen)
    cases = [{}, dict(bias=_randn(n, dtype=bf16, gen=gen)), dict(norm_weight=norm, eps=1e-6, residual=res)]
    if n % 2 == 0:
        cases.append(dict(norm_weight=norm, eps=1e-6, residual=res, act="silu"))
    _check_tile_cases(gemv, x, w, tile, cases)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k,tile", [(3584, 2560, SmemTile(4, 512, 4)), (2560, 4096, SmemTile(8, 1024, 8)),
                                      (1000, 9728, SmemTile(2, 512, 2)), (2570, 2560, SmemTile(8, 256, 4))])
def test_gpu_fused_linear_shared_memory_tiles(n, k, tile):
    """The ("smem", ...) tiles (gemv_smem: whole row blocks copied to shared memory before the wait)
    against the reference, with and without a norm, residual, SiLU-and-mul and bias, including a last
    row block that is cut short (n = 1000 and 2570 are not multiples of the block rows)."""
    gen = _gen(17)
    bf16 = torch.bfloat16
    x, w = _randn(1, k, dtype=bf16, gen=gen), _randn(n, k, dtype=bf16, gen=gen) / 50
    norm, res = 1 + _randn(k, dtype=bf16, gen=gen) / 10, _randn(1, k, dtype=bf16, gen=gen)
    bias = _randn(n, dtype=bf16, gen=gen)
    cases = [{}, dict(bias=bias), dict(norm_weight=norm, eps=1e-6), dict(norm_weight=norm, eps=1e-6, residual=res),
             dict(norm_weight=norm, eps=1e-6, residual=res, act="silu")]
    _check_tile_cases(gemv, x, w, tile, cases)
    with pytest.raises(ValueError, match="shared memory"):
        gemv.fused_linear(x, w, tile=SmemTile(64, 512, 4), act="silu")


@pytest.mark.gpu
@gpu
def test_gpu_fused_linear_chain_in_a_cuda_graph():
    """A decoder layer's four single-token products at qwen3-4b sizes, chained as in a decode step and
    replayed from a CUDA graph (programmatic dependent launch on Hopper): each matches the reference
    computed from the previous product's graph output, so a kernel that read its input before the
    previous one finished would fail here."""
    gen = _gen(15)
    bf16 = torch.bfloat16
    hidden, inter, qkv_n = 2560, 9728, 6144
    w_qkv, w_o = _randn(qkv_n, hidden, dtype=bf16, gen=gen) / 50, _randn(hidden, 4096, dtype=bf16, gen=gen) / 64
    w_gu, w_down = _randn(2 * inter, hidden, dtype=bf16, gen=gen) / 50, _randn(hidden, inter, dtype=bf16, gen=gen) / 99
    n1, n2 = 1 + _randn(hidden, dtype=bf16, gen=gen) / 10, 1 + _randn(hidden, dtype=bf16, gen=gen) / 10
    x, res = _randn(1, hidden, dtype=bf16, gen=gen), _randn(1, hidden, dtype=bf16, gen=gen)

    def layer():
        qkv, r = gemv.fused_linear(x, w_qkv, norm_weight=n1, eps=1e-6, residual=res)
        o, _ = gemv.fused_linear(qkv[:, :4096].contiguous(), w_o)
        h, r2 = gemv.fused_linear(o, w_gu, norm_weight=n2, eps=1e-6, residual=r, act="silu")
        return qkv, r, o, h, r2, gemv.fused_linear(h, w_down)[0]
    layer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layer()
    for _ in range(3):
        x.copy_(_randn(1, hidden, dtype=bf16, gen=gen))
        graph.replay()
        qkv, r, o, h, r2, down = outs
        ref_qkv, ref_r = gemv.fused_linear_torch(x, w_qkv, norm_weight=n1, eps=1e-6, residual=res)
        torch.testing.assert_close(qkv, ref_qkv, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(r, ref_r, rtol=0, atol=0)
        torch.testing.assert_close(o, gemv.fused_linear_torch(qkv[:, :4096], w_o)[0], rtol=2e-2, atol=2e-2)
        ref_h, ref_r2 = gemv.fused_linear_torch(o, w_gu, norm_weight=n2, eps=1e-6, residual=r, act="silu")
        torch.testing.assert_close(h, ref_h, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(r2, ref_r2, rtol=0, atol=0)
        torch.testing.assert_close(down, gemv.fused_linear_torch(h, w_down)[0], rtol=2e-2, atol=2e-2)
