"""`gemv_tma` (Gluon, Hopper TMA) does not run in Triton's interpreter; here its sm90 code is compiled
on the CPU and checked for what the kernel is for: the first STAGES tiles' copies (two per tile with
SiLU-and-mul) issued before the programmatic-dependent-launch wait, one refill per tile after it, and
the ring in shared memory; and the split of the tiles into equal runs. Its results are checked on the
GPU (test_kernels.py, test_gpu_fused_linear_shared_memory_tiles and the chain in a CUDA graph)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenmill.layers.kernels import gemv_tma

_COMPILE = r'''
import json, re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from tokenmill.layers.kernels import gemv_tma
K, bn, stages, nw, silu, norm = json.loads(sys.argv[1])
ptrs = ["x_ptr", "res_ptr", "nw_ptr", "b_ptr", "out_ptr", "res_out_ptr"]
const = dict(K=K, BLOCK_N=bn, STAGES=stages, MAX_PIECES=7, NORM=norm, RESIDUAL=norm, HAS_BIAS=False, SILU=silu,
             PDL=2, NUM_WARPS=nw)
desc = (f"tensordesc<bf16[{bn}, 64],NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, "
        "transposed=False, fp4_padded=False, cga_layout=[])>")
sig = {"w_desc": desc, **{p: "*bf16" for p in ptrs}, "part_ptr": "*fp32", "counter_ptr": "*i32", "eps": "fp32",
       "n_out": "i32", **{c: "constexpr" for c in const}}
attrs = {(i,): [["tt.divisibility", 16]] for i in range(1, 9)}   # 16-byte aligned pointers, as launched
src = GluonASTSource(fn=gemv_tma._tma_gemv_kernel, signature=sig, constexprs=const, attrs=attrs)
cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
before, after = cc.asm["ptx"].split("griddepcontrol.wait", 1)
copies = r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global"
print(json.dumps(dict(before=len(re.findall(copies, before)), after=len(re.findall(copies, after)),
                      trigger_first="griddepcontrol.launch_dependents" in before, shared=cc.metadata.shared)))
'''


@pytest.mark.skipif(not gemv_tma.AVAILABLE, reason="this Triton has no Gluon Hopper module")
@pytest.mark.parametrize("k,block_n,stages,warps,silu,norm", [
    (2560, 256, 3, 8, False, True),      # qwen3-4b qkv: norm and residual before
    (2560, 128, 3, 8, True, True),       # gate_up: gate and up rows, SiLU-and-mul after
    (9728, 128, 4, 8, False, False),     # down_proj
])
def test_sm90_code_issues_the_first_stages_before_the_wait(k, block_n, stages, warps, silu, norm):
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps([k, block_n, stages, warps, silu, norm])],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    per_tile = 2 if silu else 1
    assert got["before"] == stages * per_tile      # the prologue, unrolled
    assert got["after"] == per_tile                # the refill in the loop
    assert got["trigger_first"]
    assert got["shared"] >= stages * per_tile * block_n * 64 * 2


def test_tile_checks_name_the_limit():
    bf16 = torch.bfloat16
    if not gemv_tma.AVAILABLE:
        assert "no Gluon" in gemv_tma.check_tile(2560, 4096, False, bf16, ("tma", 128, 3, 8))
        return
    assert gemv_tma.check_tile(6144, 2560, False, bf16, ("tma", 256, 3, 8)) is None
    assert gemv_tma.check_tile(19456, 2560, True, bf16, ("tma", 256, 3, 8)) is None
    assert "K 2570" in gemv_tma.check_tile(2560, 2570, False, bf16, ("tma", 128, 3, 8))
    assert "not 16-bit" in gemv_tma.check_tile(2560, 4096, False, torch.float32, ("tma", 128, 3, 8))
    assert "BLOCK_N 16" in gemv_tma.check_tile(2560, 4096, False, bf16, ("tma", 16, 3, 8))
    assert "shared memory" in gemv_tma.check_tile(19456, 2560, True, bf16, ("tma", 256, 4, 8))
    assert "shared memory" in gemv_tma.check_tile(2560, 4096, False, bf16, ("tma", 256, 4, 8, 2))
    odd_rows = torch.zeros(4, 2564, dtype=bf16)[:, :2560]      # a row stride of 5,128 bytes: no TMA
    assert gemv_tma.check_tile(4, 2560, False, bf16, ("tma", 32, 3, 8)) is None
    assert "16-byte" in gemv_tma.check_tile(4, 2560, False, bf16, ("tma", 32, 3, 8), odd_rows)


@pytest.mark.parametrize("blocks,num_kb,programs", [(24, 40, 132), (10, 152, 132), (76, 40, 132), (3, 8, 24),
                                                    (160, 4, 132)])
def test_runs_split_the_tiles_evenly_and_pieces_count_their_programs(blocks, num_kb, programs):
    # the kernel's split of tiles into runs, replayed on the host: runs differ by at most one tile, every
    # tile has one owner, and a row block's pieces are its owners, at most max_pieces of them
    tiles = blocks * num_kb
    runs = [(p * tiles // programs, (p + 1) * tiles // programs) for p in range(programs)]
    assert max(b - a for a, b in runs) - min(b - a for a, b in runs) <= 1
    owners = [gemv_tma._owner(t, tiles, programs) for t in range(tiles)]
    assert all(runs[o][0] <= t < runs[o][1] for t, o in enumerate(owners))
    pieces = [len(set(owners[rb * num_kb:(rb + 1) * num_kb])) for rb in range(blocks)]
    assert max(pieces) == gemv_tma.max_pieces(blocks, num_kb, programs)
