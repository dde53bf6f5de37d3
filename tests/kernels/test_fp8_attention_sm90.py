"""The FP8-cache decode kernels' sm90 code, compiled on the CPU: what `kv_fp8.widen_e4m3` is for. Triton
gives a product's operands 4-wide k packs when one of them traces back to 8-bit values; V widened by the
assembly (which the trace does not cross) leaves the p @ V product of the one-kernel decode and of a mixed
step's decode rows with 16-bit operands (kWidth = 2), as a bf16 cache has them. The plain conversion, the
control, leaves every operand 4-wide. Results are checked by test_decode_attention.py, test_kv_fp8.py and
test_paged_attention.py (on the GPU, the assembly itself)."""
from __future__ import annotations

import pytest
import sm90

_COMPILE = sm90.ATTENTION + r'''
import json, re, sys
got = []
for name, asm in json.loads(sys.argv[1]):
    ttgir = compile_attention(name, True, widen_asm=asm).asm["ttgir"]
    got.append(sorted(set(re.findall(r"opIdx = (\d), parent = #mma\w*, kWidth = (\d)", ttgir))))
print(json.dumps(got))
'''
_CASES = [("decode", True), ("decode_rows", True), ("decode", False)]


@pytest.fixture(scope="module")
def operands(sm90_compiler):
    return {case: {tuple(map(int, o)) for o in got}
            for case, got in zip(_CASES, sm90_compiler.run(_COMPILE, *_CASES, timeout=300))}


@pytest.mark.parametrize("kernel", ["decode", "decode_rows"])
def test_v_widened_by_assembly_gives_16_bit_operands(operands, kernel):
    # (opIdx, kWidth): p and V, the operands of p @ V, 2-wide (q @ K^T keeps K's 8-bit packing)
    assert (1, 2) in operands[(kernel, True)]
    assert (0, 2) in operands[(kernel, True)]


def test_plain_conversion_packs_every_operand_4_wide(operands):
    assert operands[("decode", False)] == {(0, 4), (1, 4)}


_COMPILE_OUT = sm90.ATTENTION + r'''
import json, re, sys
got = []
for name, out_fp8 in json.loads(sys.argv[1]):
    ptx = compile_attention(name, True, out_fp8=out_fp8).asm["ptx"]
    got.append(len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)))
print(json.dumps(got))
'''


def test_attention_output_for_an_fp8_o_proj_compiles_to_e4m3_stores(sm90_compiler):
    """The three attention kernels compile for sm90 with their output in E4M3 at V's scale (what an FP8
    o_proj takes beside an FP8 cache): float32 to E4M3 conversions appear, which the plain (bf16) output
    has none of (the cache's new K and V are quantized by the prologue kernel or, in the one-kernel decode,
    in both variants)."""
    cases = [(name, out) for name in ("decode", "decode_rows", "prefill") for out in (False, True)]
    got = dict(zip(cases, sm90_compiler.run(_COMPILE_OUT, *cases, timeout=600)))
    for name in ("decode", "decode_rows", "prefill"):
        assert got[(name, True)] > got[(name, False)], (name, got)
