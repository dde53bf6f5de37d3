"""The W4 GEMV's sm90 code, compiled on the CPU: what its tile layout is for. Every tensor of the main
loop has the same lanes (a thread's quad of words of each row and those words' inputs), so the loop
moves nothing between threads (no shared memory, barrier or shuffle), and it spends one FMA per weight
and x row plus two per (quad, row) for the group's scale and zero. Results are checked by
test_w4_kernels.py."""
from __future__ import annotations

import pytest
import sm90

_COMPILE = sm90.COMPILE + r'''
import json, re, sys
from tokenmill.layers.kernels import w4_gemm
types = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": "*bf16", "out_ptr": "*bf16"}
got = []
for K, bn, bw, nw, rows in json.loads(sys.argv[1]):
    const = dict(K=K, GROUPS=K // 128, GROUP=128, ROWS=rows, BLOCK_N=bn, BLOCK_W=bw, HAS_BIAS=False, PDL=True)
    ptx = compile_sm90(w4_gemm._w4_gemv_kernel, const, types, nw, aligned=("x_stride", "out_stride")).asm["ptx"]
    lines = ptx.splitlines()
    labels = {m.group(1): n for n, l in enumerate(lines) if (m := re.match(r"(\$L__BB\d+_\d+):", l))}
    loops = [(labels[m.group(1)], n) for n, l in enumerate(lines)
             if (m := re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", l)) and labels.get(m.group(1), n) < n]
    a, b = max(loops, key=lambda ab: ab[1] - ab[0])
    body = "\n".join(lines[a:b])
    got.append({k: body.count(k) for k in ("bar.sync", "shared", "shfl", "fma.rn.f32")})
print(json.dumps(got))
'''
_CASES = [(2560, 8, 128, 1, 1), (2560, 8, 128, 1, 4), (9728, 4, 256, 2, 1)]     # qkv M=1 and 4, down


@pytest.fixture(scope="module")
def compiled(sm90_compiler):
    return dict(zip(_CASES, sm90_compiler.run(_COMPILE, *_CASES, timeout=300)))


@pytest.mark.parametrize("k,block_n,block_w,warps,rows", _CASES)
def test_gemv_loop_keeps_data_in_its_threads(compiled, k, block_n, block_w, warps, rows):
    got = compiled[(k, block_n, block_w, warps, rows)]
    assert got["bar.sync"] == got["shared"] == got["shfl"] == 0
    weights = block_n * block_w * 8 // (32 * warps)          # a thread's weights a chunk
    quads = block_n * block_w // 4 // (32 * warps)
    assert rows * weights <= got["fma.rn.f32"] <= rows * (weights + 2 * quads) + 8
