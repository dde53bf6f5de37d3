"""sm90 code of our kernels, compiled on the CPU for tests that check where instructions sit (which the
interpreter cannot show). Triton reads TRITON_INTERPRET, which the CPU tests set, when it is imported,
so each compile runs in a fresh interpreter without it: `run` executes a script there and returns the
JSON that the script prints last. A script may start with COMPILE, which defines
`compile_sm90(fn, const, types, num_warps, aligned=())`: the kernel compiled for sm90, its pointers (and
the integer arguments named in `aligned`) specialised as a launch specialises them, 16-byte aligned
pointers and multiples of 16; arguments not in `types` are int32."""
from __future__ import annotations

import json
import os
import subprocess
import sys

COMPILE = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile_sm90(fn, const, types, num_warps, aligned=()):
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
'''


def run(script: str, *args, timeout: int = 600):
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(args)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
