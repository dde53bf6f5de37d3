"""`gemv_smem` (Gluon) does not run in Triton's interpreter; here its sm90 code is compiled on the CPU
and checked for what the kernel is for: every weight copy (cp.async) issued before the
programmatic-dependent-launch wait, none after, in the shared memory the tile asks for. Its results are
checked on the GPU (test_kernels.py, test_gpu_fused_linear_shared_memory_tiles)."""
from __future__ import annotations

import pytest

from tokenmill.layers.kernels import gemv_smem

_COMPILE = r'''
import json, re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from tokenmill.layers.kernels import gemv_smem
ptrs = ["x_ptr", "res_ptr", "nw_ptr", "w_ptr", "b_ptr", "out_ptr", "res_out_ptr"]
copies = r"cp\.async\.c[ag]\.shared\.global"
got = []
for K, bn, bk, nw, act, norm in json.loads(sys.argv[1]):
    const = dict(K=K, BLOCK_N=bn, BLOCK_K=bk, NORM=norm, RESIDUAL=norm, HAS_BIAS=False, ACT=act, PDL=True,
                 NUM_WARPS=nw)
    sig = {**{p: "*bf16" for p in ptrs}, "eps": "fp32", "n_out": "i32", "w_stride": "i32",
           **{c: "constexpr" for c in const}}
    # as a launch specialises them: 16-byte aligned pointers, a row stride that is a multiple of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i in (*range(7), 9)}
    src = GluonASTSource(fn=gemv_smem._smem_gemv_kernel, signature=sig, constexprs=const, attrs=attrs)
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
    before, after = cc.asm["ptx"].split("griddepcontrol.wait", 1)
    got.append(dict(before=len(re.findall(copies, before)), after=len(re.findall(copies, after)),
                    trigger_first="griddepcontrol.launch_dependents" in before, shared=cc.metadata.shared))
print(json.dumps(got))
'''
_CASES = [
    (2560, 8, 512, 8, 0, False),       # nanbeige4.1-3b o_proj, the shipped shared-memory tile
    (2560, 4, 512, 4, 1, True),        # norm before, SiLU-and-mul after, gate and up rows
    (2560, 4, 512, 4, 2, True),        # the same with GELU (tanh) after: Gemma 3's
]


@pytest.fixture(scope="module")
def compiled(sm90_compiler):
    # every case in one script
    return dict(zip(_CASES, sm90_compiler.run(_COMPILE, *_CASES, timeout=300)))


@pytest.mark.skipif(not gemv_smem.AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize("k,block_n,block_k,warps,act,norm", _CASES)
def test_sm90_code_copies_all_weights_before_the_wait(compiled, k, block_n, block_k, warps, act, norm):
    got = compiled[(k, block_n, block_k, warps, act, norm)]
    rows = block_n * (2 if act else 1)
    # 16-byte copies (8 bf16), each thread's share of the program's rows x K
    assert got["before"] == rows * k // 8 // (32 * warps)
    assert got["after"] == 0
    assert got["trigger_first"]
    assert got["shared"] >= rows * k * 2


def test_tile_checks_name_the_limit():
    import torch

    from tokenmill.layers.kernel_config import SmemTile
    assert gemv_smem.check_tile(2560, 4096, False, torch.bfloat16, SmemTile(8, 1024, 8)) in (
        None, "this Triton has no Gluon")
    if not gemv_smem.AVAILABLE:
        return
    assert "BLOCK_K 1024" in gemv_smem.check_tile(2560, 2560, False, torch.bfloat16, SmemTile(8, 1024, 8))
    assert "shared memory" in gemv_smem.check_tile(19456, 9728, True, torch.bfloat16, SmemTile(8, 512, 8))
    assert "not 16-bit" in gemv_smem.check_tile(2560, 4096, False, torch.float32, SmemTile(8, 1024, 8))
    assert "power of two" in gemv_smem.check_tile(2560, 4096, False, torch.bfloat16, SmemTile(6, 1024, 2))
    assert "BLOCK_K 1280" in gemv_smem.check_tile(19456, 2560, True, torch.bfloat16, SmemTile(4, 1280, 4))
