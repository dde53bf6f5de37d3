"""The L2 prefetches (`kernels/l2_prefetch.py`) are inline assembly, which Triton's interpreter does not
run; here the sm90 code of decode attention, which issues them, is compiled on the CPU and checked for where
they sit: after the programmatic-dependent-launch wait (so they never compete with the kernel before),
and not at all when switched off. Their results are checked on the GPU (test_kernels.py,
test_gpu_fused_decode_l2_prefetch_changes_nothing)."""
from __future__ import annotations

import pytest
import sm90
import torch

from tokenmill.layers.kernels import l2_prefetch

_COMPILE = sm90.COMPILE + r'''
import json, re, sys
from tokenmill.layers.kernels import decode_attention

def compile_parts(fn, const, types, num_warps):
    parts = compile_sm90(fn, const, types, num_warps).asm["ptx"].split("griddepcontrol.wait")
    return dict(bulk=[len(re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global", p)) for p in parts],
                line=[len(re.findall(r"prefetch\.global\.L2 ", p)) for p in parts])

how, norm_first = json.loads(sys.argv[1])
bf16 = "*bf16"
const = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, NUM_SPLITS=32, GROUP=4, BLOCK_G=16, BLOCK_GR=4, SPLIT_CHUNK=8,
             HEAD_DIM=128, HALF=64, BLOCK_HALF=64, BLOCK_D=128, HAS_NORM=True, PAGE_SIZE=16, BLOCK_N=64,
             MIN_SPLIT_LEN=64, DOT_PRECISION="ieee", PDL=2, PREFETCH=how, PF_LINE=64, THREADS=128,
             NORM_FIRST=norm_first)
types = {**{p: bf16 for p in ("qkv_ptr", "cos_sin_ptr", "q_w_ptr", "k_w_ptr", "k_cache_ptr", "v_cache_ptr",
                              "out_ptr", "pf_ptr")},
         "positions_ptr": "*i64", "slot_ptr": "*i64", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
         "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "counter_ptr": "*i32", "eps": "fp32",
         "scale_log2": "fp32"}
got = compile_parts(decode_attention._fused_decode_kernel, const, types, 4)
print(json.dumps(got))
'''


def _compile(how, norm_first=0):
    return sm90.run(_COMPILE, how, norm_first)


def test_sm90_prefetch_comes_after_the_wait():
    # decode attention has one wait for the splits with positions and one for those without
    off, bulk, lines = _compile(0), _compile(2), _compile(1)
    assert sum(off["bulk"]) == 0 and sum(off["line"]) == 0
    assert bulk["bulk"][0] == 0 and sum(bulk["bulk"]) >= 1 and sum(bulk["line"]) == 0
    assert lines["line"][0] == 0 and sum(lines["line"]) >= 1 and sum(lines["bulk"]) == 0


def test_sm90_attention_reads_its_counter_line_before_the_wait_only_when_asked():
    before = _compile(0, 2)["line"]     # norm weights first, on a GPU
    assert before[0] == 1 and sum(before) == 1
    assert sum(_compile(0, 1)["line"]) == 0
    assert sum(_compile(0, 0)["line"]) == 0


def test_prefetch_ranges():
    w = torch.zeros(2560, 4096, dtype=torch.bfloat16)
    assert l2_prefetch.lines(w, 0.0, 0.125) == (0, 2560 * 4096 * 2 // 128 // 8)
    assert l2_prefetch.line_elems(w) == 64
    assert l2_prefetch.how_on(w, 2) == 0   # no inline assembly off the GPU
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch.lines(w.t(), 0.0, 1.0)
