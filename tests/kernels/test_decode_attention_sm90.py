"""Decode attention asks L2 for its split counter's line (inline assembly, which Triton's interpreter does
not run) before the programmatic-dependent-launch wait, beside its other reads of what no kernel of the
pass writes, so that no HBM read of the counter is left between the wait and the merge. Here its sm90
code is compiled on the CPU and the ask is counted on each side of the wait (off the GPU, ASK_L2 is
off: the interpreter has no inline assembly)."""
from __future__ import annotations

import sm90

_COMPILE = sm90.COMPILE + r'''
import json, re, sys
from tokenmill.layers.kernels import decode_attention

ask_l2, = json.loads(sys.argv[1])
const = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, NUM_SPLITS=32, GROUP=4, BLOCK_G=16, BLOCK_GR=4, SPLIT_CHUNK=8,
             HEAD_DIM=128, HALF=64, BLOCK_HALF=64, BLOCK_D=128, HAS_NORM=True, PAGE_SIZE=16, BLOCK_N=64,
             MIN_SPLIT_LEN=64, DOT_PRECISION="ieee", FP8=False, PDL=True, ASK_L2=ask_l2)
types = {**{p: "*bf16" for p in ("qkv_ptr", "cos_sin_ptr", "q_w_ptr", "k_w_ptr", "k_cache_ptr", "v_cache_ptr",
                                 "out_ptr")},
         "positions_ptr": "*i64", "slot_ptr": "*i64", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
         "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "counter_ptr": "*i32", "kv_scale_ptr": "*fp32", "eps": "fp32",
         "scale_log2": "fp32"}
parts = compile_sm90(decode_attention._fused_decode_kernel, const, types, 4).asm["ptx"].split("griddepcontrol.wait")
print(json.dumps([len(re.findall(r"prefetch\.global\.L2 ", p)) for p in parts]))
'''


def test_sm90_attention_asks_l2_for_its_counter_line_before_the_wait():
    before, after = sm90.run(_COMPILE, True)
    assert before == 1 and after == 0
