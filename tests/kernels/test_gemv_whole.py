"""The whole-row tiles of `gemv_whole` (`WholeRowTile`) exist to put a row block's whole rows in flight in one
round trip, the first block's before the programmatic-dependent-launch wait. The interpreter checks their
results (test_kernels.py) but not where the loads sit; here the sm90 code is compiled on the CPU and its
weight loads (`ld.global.cg`: past L1) are counted on each side of the wait."""
from __future__ import annotations

import pytest
import sm90

_COMPILE = sm90.COMPILE + r'''
import json, re, sys
from tokenmill.layers.kernels import gemv_whole
types = {**{p: "*bf16" for p in ("x_ptr", "res_ptr", "nw_ptr", "w_ptr", "b_ptr", "out_ptr", "res_out_ptr")},
         "ids_ptr": "*i64", "s_ptr": "*fp32", "eps": "fp32"}
weights = r"ld\.global\.cg\.v4"
got = []
for K, bn, nw, norm, silu in json.loads(sys.argv[1]):
    bk, bk2 = gemv_whole.whole_blocks(K)
    const = dict(K=K, BLOCK_N=bn, BLOCK_K=bk, BLOCK_K2=bk2, NORM=norm, RESIDUAL=norm, HAS_BIAS=False,
                 ACT=int(silu), GATHER=False, PDL=True, SCALE=gemv_whole.NO_SCALE, SCALE_BN=1, SCALE_BK=1, ASM=True)
    cc = compile_sm90(gemv_whole._gemv_whole_kernel, const, types, nw, aligned=("w_stride",))
    before, after = cc.asm["ptx"].split("griddepcontrol.wait", 1)
    got.append(dict(before=len(re.findall(weights, before)), after=len(re.findall(weights, after)),
                    other_loads_before=len(re.findall(r"ld\.global(?!\.cg)", before)),
                    stores_before=len(re.findall(r"st\.global", before))))
print(json.dumps(got))
'''
_TILES = [
    (2560, 2, 4, True),      # qkv: 2048 + 512 columns, the norm after the wait
    (4096, 2, 4, False),     # o_proj: one load
]


@pytest.fixture(scope="module")
def compiled(sm90_compiler):
    # each tile without and with SiLU-and-mul, all in one script
    cases = [(*tile, silu) for tile in _TILES for silu in (False, True)]
    return dict(zip(cases, sm90_compiler.run(_COMPILE, *cases, timeout=300)))


@pytest.mark.parametrize("k,block_n,warps,norm", _TILES)
def test_sm90_whole_rows_load_before_the_wait_and_one_block_ahead(compiled, k, block_n, warps, norm):
    got = compiled[(k, block_n, warps, norm, False)]
    # 16-byte loads (8 bf16): each thread's share of the block's rows x K, all before the wait
    assert got["before"] == block_n * k // 8 // (32 * warps)
    assert got["after"] == got["before"]        # in the loop: the next block's, once
    assert got["other_loads_before"] == 0 and got["stores_before"] == 0   # no input read, nothing written
    gate_up = compiled[(k, block_n, warps, norm, True)]
    assert gate_up["before"] == gate_up["after"] == 2 * got["before"]   # the up rows come with the gate rows


_COMPILE_FP8 = sm90.COMPILE + r'''
import json, re, sys
from tokenmill.layers.kernels import gemv_whole
types = {**{p: "*bf16" for p in ("x_ptr", "res_ptr", "nw_ptr", "b_ptr", "out_ptr", "res_out_ptr")},
         "w_ptr": "*i32", "ids_ptr": "*i64", "s_ptr": "*fp32", "eps": "fp32"}
got = []
for K, bn, nw, scale in json.loads(sys.argv[1]):
    bk, bk2 = gemv_whole.whole_blocks(K)
    const = dict(K=K, BLOCK_N=bn, BLOCK_K=bk, BLOCK_K2=max(bk2, 8), NORM=True, RESIDUAL=True, HAS_BIAS=False,
                 ACT=0, GATHER=False, PDL=True, SCALE=scale, SCALE_BN=128 if scale == gemv_whole.BLOCK_SCALE else 1,
                 SCALE_BK=128 if scale == gemv_whole.BLOCK_SCALE else 1, ASM=True)
    ptx = compile_sm90(gemv_whole._gemv_whole_kernel, const, types, nw, aligned=("w_stride",)).asm["ptx"]
    before, after = ptx.split("griddepcontrol.wait", 1)
    got.append(dict(before=len(re.findall(r"ld\.global\.cg\.v2\.b32", before)),
                    widen=len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", after)),
                    fma=len(re.findall(r"fma\.rn\.f16x2", after)), mul=len(re.findall(r"mul\.rn\.f16x2", after)),
                    f32_widen=len(re.findall(r"cvt\.f32\.f16", after))))
print(json.dumps(got))
'''


@pytest.mark.parametrize("scale", ["row", "block"])
def test_sm90_fp8_whole_rows_multiply_float16_pairs(sm90_compiler, scale):
    """qwen3-4b's FP8 qkv (K = 2560, four rows a block): each thread's words (pairs of int32, eight weights)
    are requested before the wait, and every eight weights cost two `cvt.f16x2.e4m3x2` and four float16-pair
    products, with two float16 -> float32 conversions for their sum (once in the inline assembly)."""
    from tokenmill.layers.kernels import gemv_whole
    mode = gemv_whole.ROW_SCALE if scale == "row" else gemv_whole.BLOCK_SCALE
    got, = sm90_compiler.run(_COMPILE_FP8, (2560, 4, 4, mode), timeout=300)
    assert got["before"] == 4 * 2560 // 8 // (32 * 4)          # 8-byte loads of 8 FP8 weights
    # per thread and row block: 4 rows x 320 eight-column steps over 128 threads, one assembly block each
    steps = 4 * 2560 // 8 // 128
    assert (got["mul"], got["fma"], got["widen"], got["f32_widen"]) == (steps, 3 * steps, 4 * steps, 2 * steps)
