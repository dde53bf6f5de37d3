"""sm90 code of our kernels, compiled on the CPU for tests that check where instructions sit (which the
interpreter cannot show). Triton reads TRITON_INTERPRET, which the CPU tests set, when it is imported,
so the compiles run in another Python, started without it: `Compiler.run` executes a script there and
returns the JSON that the script prints last. That Python serves a session's scripts in turn (torch,
triton and our kernels imported once, not once a script), each in fresh globals with its arguments in
sys.argv[1]. A script may start with COMPILE, which defines
`compile_sm90(fn, const, types, num_warps, aligned=(), arch=90, **options)`: the kernel compiled for sm90
(or `arch`), its pointers (and the integer arguments named in `aligned`) specialised as a launch
specialises them, 16-byte aligned pointers and multiples of 16; arguments not in `types` are int32. A
script may start with ATTENTION instead, which adds `compile_attention` (see there)."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile

COMPILE = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile_sm90(fn, const, types, num_warps, aligned=(), arch=90, **options):
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, **options})
'''

# The attention kernels as qwen3-4b's heads launch them (32 q over 8 kv heads of 128, 16-slot pages, 64-position
# tiles, no sliding window, no soft cap): `attention_kernels[name]` is (kernel, its constexprs but FP8 and
# WIDEN_ASM), `attention_types(cache)` the argument types with the cache's element type, `attention_aligned` the
# strides a launch specialises; `compile_attention`'s `const` overrides constexprs.
ATTENTION = COMPILE + r'''
from tokenmill.layers.kernels import decode_attention, decode_rows, paged_attention
_heads = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, GROUP=4, BLOCK_G=16, BLOCK_GR=4, HEAD_DIM=128, BLOCK_D=128,
              PAGE_SIZE=16, BLOCK_N=64, MIN_SPLIT_LEN=64, DOT_PRECISION="tf32", OUT_FP8=False, OUT_SCALES=1,
              BLOCK_S=1, WINDOW=0, SOFTCAP=0.0, PDL=False)
attention_kernels = {
    "decode": (decode_attention._fused_decode_kernel,
               dict(_heads, NUM_SPLITS=1, SPLIT_CHUNK=1, HALF=64, BLOCK_HALF=64, HAS_NORM=True, PDL=False,
                    ASK_L2=True)),
    "decode_rows": (decode_rows._decode_rows_kernel, dict(_heads, SPLIT_CHUNK=8)),
    "prefill": (paged_attention._prefill_kernel, dict(_heads, BLOCK_M=64, USE_TILES=True))}
attention_aligned = ("qkv_stride_t", "cs_stride", "q_stride_t", "q_stride_h", "o_stride_t", "o_stride_h",
                     "c_stride_blk", "c_stride_tok", "c_stride_h")

def attention_types(cache, out="*bf16"):
    return {"qkv_ptr": "*bf16", "q_ptr": "*bf16", "q_w_ptr": "*bf16", "k_w_ptr": "*bf16", "out_ptr": out,
            "out_scale_ptr": "*fp32", "cos_sin_ptr": "*fp32", "positions_ptr": "*i64", "slot_ptr": "*i64",
            "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "tiles_ptr": "*i32",
            "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "counter_ptr": "*i32", "eps": "fp32",
            "scale_log2": "fp32", "kv_scale_ptr": "*fp32", "k_cache_ptr": cache, "v_cache_ptr": cache}

def compile_attention(name, fp8, widen_asm=True, const=None, num_warps=4, out_fp8=False, **options):
    # out_fp8: the output in E4M3 at V's scale for an FP8 o_proj (`attention_common.out_rows`)
    fn, shipped = attention_kernels[name]
    const = dict(shipped, FP8=fp8, WIDEN_ASM=widen_asm, **(dict(OUT_FP8=True) if out_fp8 else {}), **(const or {}))
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    types = attention_types("*fp8e4nv" if fp8 else "*bf16", "*fp8e4nv" if out_fp8 else "*bf16")
    return compile_sm90(fn, const, types, num_warps, attention_aligned, **options)
'''


# The compiling Python: a script a line ([script, its JSON arguments]) on stdin, an answer a line on the
# stdout it started with ({"printed": ...} or {"error": traceback}); what the compiler itself writes to
# fd 1 goes to stderr, so that it cannot break into an answer.
_SERVE = r'''
import contextlib, io, json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for line in sys.stdin:
    script, args = json.loads(line)
    sys.argv = ["-c", args]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(script, "<sm90 script>", "exec"), {"__name__": "__main__"})
        answer = {"printed": printed.getvalue()}
    except BaseException:
        answer = {"error": traceback.format_exc()}
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
'''


class Compiler:
    """The compiling Python of a test session (the `sm90_compiler` fixture), started at the first `run` and
    again after a script that timed out or ended it."""

    def __init__(self):
        self._proc = None
        self._log = tempfile.TemporaryFile("w+")

    def run(self, script: str, *args, timeout: int = 600):
        if self._proc is None or self._proc.poll() is not None:
            env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
            self._proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self._proc.stdin.write(json.dumps([script, json.dumps(args)]) + "\n")
        self._proc.stdin.flush()
        if not select.select([self._proc.stdout], [], [], timeout)[0]:
            self._stop(kill=True)
            raise subprocess.TimeoutExpired("sm90 script", timeout)
        line = self._proc.stdout.readline()
        if not line:
            status = self._proc.wait()
            self._stop()
            self._log.seek(0)
            raise AssertionError(f"the compiling Python exited with {status}:\n{self._log.read()[-3000:]}")
        answer = json.loads(line)
        assert "error" not in answer, answer.get("error", "")[-3000:]
        return json.loads(answer["printed"].strip().splitlines()[-1])

    def _stop(self, kill: bool = False) -> None:
        if self._proc is not None:
            if kill:
                self._proc.kill()
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
            self._proc.stdout.close()
            self._proc = None

    def close(self) -> None:
        self._stop()
        self._log.close()
