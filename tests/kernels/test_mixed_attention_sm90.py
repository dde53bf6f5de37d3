"""A mixed step's two attention kernels run side by side (`pdl.release` / `pdl.wait`, which Triton's
interpreter does not run): the decode-rows kernel lets the prefill kernel launch before it reads or writes
anything, and the prefill kernel, launched with programmatic dependent launch, waits for it only after its
last store, so that the kernels after the prefill still find both outputs written. Here their sm90 code is
compiled on the CPU and the order of those instructions read from the PTX."""
from __future__ import annotations

import sm90

_COMPILE = sm90.ATTENTION + r'''
import json, re, sys
got = {}
for name in ("decode_rows", "prefill"):
    ptx = compile_attention(name, True, const=dict(PDL=True)).asm["ptx"]
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    def at(pattern, last=False):
        found = [m.start() for m in re.finditer(pattern, body)]
        return (found[-1] if last else found[0]) if found else -1
    got[name] = dict(release=at(r"griddepcontrol\.launch_dependents"), wait=at(r"griddepcontrol\.wait"),
                     first_load=at(r"\bld\.global"), last_store=at(r"\bst\.global", last=True))
print(json.dumps(got))
'''


def test_sm90_decode_rows_release_the_prefill_kernel_which_waits_after_its_stores(sm90_compiler):
    got = sm90_compiler.run(_COMPILE)
    rows, prefill = got["decode_rows"], got["prefill"]
    assert 0 <= rows["release"] < rows["first_load"] and rows["wait"] == -1
    assert prefill["release"] == -1 and 0 <= prefill["last_store"] < prefill["wait"]
