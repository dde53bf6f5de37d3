"""What a kernel boundary costs in a decode step's chain, on the GPU machine, against handing work over
inside one kernel.

1. A chain of N launches of a kernel that does nothing but wait for the one before (`pdl.enter`) and
   bump one counter, captured in one CUDA graph: us per launch, without programmatic dependent launch
   and with mode 2, for 1 to 8 programs per SM a launch.
2. The same N hand-overs inside one kernel: program p waits (polling, acquire) until program p - 1 has
   bumped a counter (release), so each hand-over is one flag seen by another SM: us per hand-over.

Usage: python scripts/device/pdl_boundary.py [--n 400]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from tokenmill.layers.kernels import pdl


@triton.jit
def _link(counter_ptr, PDL: tl.constexpr):
    pdl.enter(PDL)
    if tl.program_id(0) == 0:
        tl.store(counter_ptr, tl.load(counter_ptr) + 1)


@triton.jit
def _relay(flags_ptr):
    # program p waits for flag p - 1, then raises its own
    p = tl.program_id(0)
    if p > 0:
        while tl.atomic_add(flags_ptr + p - 1, 0, sem="acquire", scope="gpu") == 0:
            pass
    tl.atomic_xchg(flags_ptr + p, 1, sem="release", scope="gpu")


def main() -> None:
    from gemv_bench import graph_us, write_rows    # scripts/device/, the script's own folder

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    rows = []
    for programs in (1, sms, 2 * sms, 4 * sms, 8 * sms):
        for mode in (0, 2):
            us = graph_us(lambda: [_link[(programs,)](counter, PDL=mode, launch_pdl=mode > 0)
                                   for _ in range(args.n)]) / args.n
            rows.append(dict(what="kernel boundary", programs=programs, pdl=mode, us=us))
    # the relay's programs must all be resident at once (one per SM at most here), so no program waits on
    # one that cannot start
    flags = torch.zeros(sms, dtype=torch.int32, device=dev)

    def relay():
        flags.zero_()
        _relay[(sms,)](flags)
    base = graph_us(lambda: flags.zero_())
    rows.append(dict(what="hand-over inside one kernel", programs=sms, pdl=None,
                     us=(graph_us(relay) - base) / (sms - 1)))
    for r in rows:
        print(json.dumps(r))
    write_rows(args.out, "pdl_boundary", rows, ["what", "programs", "PDL mode", "us each"],
               lambda r: [r["what"], str(r["programs"]), str(r["pdl"]), f"{r['us']:.2f}"])


if __name__ == "__main__":
    main()
