"""Decode attention asks L2 for its split counter's line (inline assembly, which Triton's interpreter does
not run) before the programmatic-dependent-launch wait, beside its other reads of what no kernel of the
pass writes, so that no HBM read of the counter is left between the wait and the merge. Here its sm90
code is compiled on the CPU and the ask is counted on each side of the wait (off the GPU, ASK_L2 is
off: the interpreter has no inline assembly)."""
from __future__ import annotations

import sm90

_COMPILE = sm90.ATTENTION + r'''
import json, re, sys
ask_l2, = json.loads(sys.argv[1])
compiled = compile_attention("decode", False, const=dict(NUM_SPLITS=32, SPLIT_CHUNK=8, PDL=True, ASK_L2=ask_l2))
parts = compiled.asm["ptx"].split("griddepcontrol.wait")
print(json.dumps([len(re.findall(r"prefetch\.global\.L2 ", p)) for p in parts]))
'''


def test_sm90_attention_asks_l2_for_its_counter_line_before_the_wait(sm90_compiler):
    before, after = sm90_compiler.run(_COMPILE, True)
    assert before == 1 and after == 0
