"""The FP8-cache decode kernels' sm90 code, compiled on the CPU: what `fused_ops.widen_e4m3` is for. Triton
gives a product's operands 4-wide k packs when one of them traces back to 8-bit values; V widened by the
assembly (which the trace does not cross) leaves the p @ V product of the one-kernel decode and of a mixed
step's decode rows with 16-bit operands (kWidth = 2), as a bf16 cache has them. The plain conversion, the
control, leaves every operand 4-wide. Results are checked by test_decode_attention.py, test_kv_fp8.py and
test_paged_attention.py (on the GPU, the assembly itself)."""
from __future__ import annotations

import pytest
import sm90

_COMPILE = sm90.COMPILE + r'''
import json, re, sys
from tokenmill.layers.kernels import decode_attention, paged_attention
heads = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, GROUP=4, BLOCK_G=16, BLOCK_GR=4, HEAD_DIM=128, BLOCK_D=128,
             PAGE_SIZE=16, BLOCK_N=64, MIN_SPLIT_LEN=64, DOT_PRECISION="tf32", FP8=True)
types = {"qkv_ptr": "*bf16", "q_ptr": "*bf16", "q_w_ptr": "*bf16", "k_w_ptr": "*bf16", "out_ptr": "*bf16",
         "cos_sin_ptr": "*fp32", "positions_ptr": "*i64", "slot_ptr": "*i64", "block_tables_ptr": "*i32",
         "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
         "counter_ptr": "*i32", "eps": "fp32", "scale_log2": "fp32", "k_cache_ptr": "*fp8e4nv",
         "v_cache_ptr": "*fp8e4nv", "kv_scale_ptr": "*fp32"}
kernels = {"decode": (decode_attention._fused_decode_kernel,
                      dict(heads, NUM_SPLITS=1, SPLIT_CHUNK=1, HALF=64, BLOCK_HALF=64, HAS_NORM=True, PDL=False,
                           ASK_L2=True)),
           "decode_rows": (paged_attention._decode_rows_kernel, dict(heads, SPLIT_CHUNK=8))}
got = []
for name, asm in json.loads(sys.argv[1]):
    fn, const = kernels[name]
    ttgir = compile_sm90(fn, dict(const, WIDEN_ASM=asm), types, 4).asm["ttgir"]
    got.append(sorted(set(re.findall(r"opIdx = (\d), parent = #mma\w*, kWidth = (\d)", ttgir))))
print(json.dumps(got))
'''
_CASES = [("decode", True), ("decode_rows", True), ("decode", False)]


@pytest.fixture(scope="module")
def operands():
    return {case: {tuple(map(int, o)) for o in got}
            for case, got in zip(_CASES, sm90.run(_COMPILE, *_CASES, timeout=300))}


@pytest.mark.parametrize("kernel", ["decode", "decode_rows"])
def test_v_widened_by_assembly_gives_16_bit_operands(operands, kernel):
    # (opIdx, kWidth): p and V, the operands of p @ V, 2-wide (q @ K^T keeps K's 8-bit packing)
    assert (1, 2) in operands[(kernel, True)]
    assert (0, 2) in operands[(kernel, True)]


def test_plain_conversion_packs_every_operand_4_wide(operands):
    assert operands[("decode", False)] == {(0, 4), (1, 4)}
