"""Compiles the shipped kernels of a source tree for sm90 on the CPU (no GPU) and writes their PTX and SASS
(normalised: parameters named by argument, constant-bank offsets masked) to a JSON file. The kernels and
specialisations are those the qwen3-4b and nanbeige4.1-3b presets launch in bf16; constexprs a tree's kernel
does not take are dropped, so older trees compile too. compare.py diffs two such files.

  git archive <commit> src | tar x -C /tmp/old && python lab/sm90_compare/dump.py /tmp/old /tmp/old.json
  python lab/sm90_compare/dump.py . /tmp/new.json && python lab/sm90_compare/compare.py /tmp/old.json /tmp/new.json
"""
import json, os, re, sys
root, out = sys.argv[1], sys.argv[2]
only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
sys.path.insert(0, os.path.join(root, "src"))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.disasm import get_sass
import importlib
pdl = importlib.import_module("tokenmill.layers.kernels.pdl")
PDL_ON = 2 if hasattr(pdl, "MODE") else True

BF = "*bf16"
def comp(fn, const, types, num_warps, num_stages=None, aligned=(), gluon=False):
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    if "PDL" in const:
        const["PDL"] = PDL_ON
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n in aligned}
    opts = {"num_warps": num_warps}
    if num_stages is not None:
        opts["num_stages"] = num_stages
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource
        src = GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    else:
        src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    params = [n for n in fn.arg_names if sig[n] != "constexpr"]
    ptx = cc.asm["ptx"]
    name = cc.metadata.name
    # parameter names by argument name, not index (removed dead parameters shift the indices)
    def pname(m):
        i = int(m.group(1))
        return f"PARAM[{params[i]}]" if i < len(params) else f"PARAM[scratch{i - len(params)}]"
    ptx = re.sub(re.escape(name) + r"_param_(\d+)", pname, ptx)
    ptx = "\n".join(l for l in ptx.splitlines() if not l.strip().startswith(".param") and not l.startswith("//"))
    import subprocess, tempfile
    from triton import knobs
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cc.asm["cubin"]); f.flush()
        raw = subprocess.check_output([knobs.nvidia.cuobjdump.path, "-sass", f.name]).decode()
    lines = [re.sub(r"/\*\s*0x[0-9a-f]+\s*\*/", "", l).strip() for l in raw.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", l)]
    sass = "\n".join(re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][P]", l) for l in lines)
    return dict(ptx=ptx, sass=sass, n_sass=sass.count("\n") + 1, shared=cc.metadata.shared)

from tokenmill.layers.kernels import gemv, decode_attention, fused_ops, argmax, paged_attention, staging
try:
    from tokenmill.layers.kernels import gemv_smem
except ImportError:
    gemv_smem = None
try:        # the attention prologue left fused_ops.py for a module of its own
    from tokenmill.layers.kernels import attention_prologue as prologue_module
except ImportError:
    prologue_module = fused_ops
try:  # the whole-row kernel in a module of its own, else (older trees) in gemv
    from tokenmill.layers.kernels import gemv_whole
except ImportError:
    gemv_whole = gemv
try:  # the decode-rows kernel in a module of its own, else (older trees) in paged_attention, if anywhere
    from tokenmill.layers.kernels import decode_rows as rows_module
except ImportError:
    rows_module = paged_attention
gt = {**{p: BF for p in ("x_ptr", "res_ptr", "nw_ptr", "w_ptr", "b_ptr", "out_ptr", "res_out_ptr")},
      "ids_ptr": "*i64", "eps": "fp32"}
def whole(K, bn, nw, norm, res, silu, gather):
    bk = 1 << (K.bit_length() - 1)
    bk2 = triton.next_power_of_2(K - bk) if K > bk else 1
    return comp(gemv_whole._gemv_whole_kernel, dict(K=K, BLOCK_N=bn, BLOCK_K=bk, BLOCK_K2=bk2, NORM=norm, RESIDUAL=res,
                HAS_BIAS=False, SILU=silu, ACT=int(silu), GATHER=gather, AHEAD=True, HINT=2, PDL=2, ASM=True, SCALE=0, SCALE_BN=1, SCALE_BK=1), gt, nw, aligned=("w_stride",))
def plain(K, bn, bk, nw, norm, res, silu, gather):
    return comp(gemv._gemv_kernel, dict(K=K, BLOCK_N=bn, BLOCK_K=bk, NORM=norm, RESIDUAL=res, HAS_BIAS=False,
                SILU=silu, ACT=int(silu), GATHER=gather, ROW_SUMS=False, STAGES=1, HINT=0, PDL=2, SCALE=0, SCALE_BN=1, SCALE_BK=1), gt, nw, aligned=("w_stride",))
def smem(K, bn, bk, nw):
    return comp(gemv_smem._smem_gemv_kernel, dict(K=K, BLOCK_N=bn, BLOCK_K=bk, NORM=False, RESIDUAL=False,
                HAS_BIAS=False, SILU=False, ACT=0, PDL=2, NUM_WARPS=nw), gt, nw, aligned=("w_stride",), gluon=True)
dt = {**{p: BF for p in ("qkv_ptr", "cos_sin_ptr", "q_w_ptr", "k_w_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "pf_ptr")},
      "cos_sin_ptr": "*fp32", "positions_ptr": "*i64", "slot_ptr": "*i64", "block_tables_ptr": "*i32",
      "context_lens_ptr": "*i32", "seq_lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
      "counter_ptr": "*i32", "eps": "fp32", "scale_log2": "fp32", "out_scale_ptr": "*fp32"}
def fused(hq, hkv, norm, splits, stages):
    g = hq // hkv
    return comp(decode_attention._fused_decode_kernel, dict(
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, NUM_SPLITS=splits, GROUP=g, BLOCK_G=max(16, triton.next_power_of_2(g)),
        BLOCK_GR=triton.next_power_of_2(g), SPLIT_CHUNK=min(8, triton.next_power_of_2(splits)), HEAD_DIM=128,
        HALF=64, BLOCK_HALF=64, BLOCK_D=128, HAS_NORM=norm, PAGE_SIZE=16, BLOCK_N=64, MIN_SPLIT_LEN=64,
        DOT_PRECISION="tf32", PDL=2, PREFETCH=0, PF_LINE=1, THREADS=128, NORM_FIRST=2, ASK_L2=True, FP8=False,
        WIDEN_ASM=True, OUT_FP8=False, OUT_SCALES=1, BLOCK_S=1, WINDOW=0, SOFTCAP=0.0),
        dt, 4, stages, aligned=("qkv_stride_t", "cs_stride", "c_stride_blk", "c_stride_tok"))
K = {}
K["whole_qwen_qkv_gather"] = lambda: whole(2560, 2, 4, True, False, False, True)
K["whole_qwen_qkv"] = lambda: whole(2560, 2, 4, True, True, False, False)
K["whole_qwen_o"] = lambda: whole(4096, 2, 4, False, False, False, False)
K["whole_gate_up"] = lambda: whole(2560, 1, 4, True, True, True, False)
K["whole_qwen_down"] = lambda: whole(9728, 1, 16, False, False, False, False)
K["whole_nb_down"] = lambda: whole(10496, 1, 16, False, False, False, False)
K["plain_default_norm"] = lambda: plain(2560, 4, 1024, 4, True, True, False, False)
K["plain_default_silu"] = lambda: plain(1024, 4, 1024, 4, True, True, True, False)
K["plain_default_gather"] = lambda: plain(1024, 4, 1024, 4, True, False, False, True)
K["plain_default_down"] = lambda: plain(3072, 4, 1024, 4, False, False, False, False)
if gemv_smem is not None:
    K["smem_nb_o"] = lambda: smem(2560, 8, 512, 8)
K["fused_qwen_b1"] = lambda: fused(32, 8, True, 32, 1)
K["fused_qwen_b8"] = lambda: fused(32, 8, True, 5, 2)
K["fused_qwen_b64"] = lambda: fused(32, 8, True, 1, 2)
K["fused_nb_b1"] = lambda: fused(20, 4, False, 32, 1)
K["rms_norm"] = lambda: comp(fused_ops._rms_norm_kernel, dict(N=2560, BLOCK_R=1, BLOCK_N=4096, HAS_RESIDUAL=True,
                             FP8_GROUP=0, UNSCALED=False, PDL=2), {"x_ptr": BF, "res_ptr": BF, "w_ptr": BF, "out_ptr": BF,
                             "res_out_ptr": BF, "s_ptr": "*fp32", "rs_ptr": "*fp32", "cs_ptr": "*fp32", "eps": "fp32"}, 8)
# SiLU-and-mul: ACT 1 of the activation kernel, else (older trees) the SiLU-only kernel
act_kernel = getattr(fused_ops, "_act_and_mul_kernel", None) or getattr(fused_ops, "_silu_and_mul_kernel")
K["silu"] = lambda: comp(act_kernel, dict(I=9728, BLOCK=1024, FP8_GROUP=0, PDL=2, ACT=1),
                         {"x_ptr": BF, "out_ptr": BF, "s_ptr": "*fp32"}, 4, aligned=("x_stride_t",))
K["qk_prologue"] = lambda: comp(prologue_module._qk_norm_rope_store_kernel, dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, BLOCK_HQ=32,
                         BLOCK_HKV=8, HALF=64, BLOCK_HALF=64, HAS_NORM=True, PDL=2, FP8=False, UNSCALED=False,
                         DTYPE=triton.language.bfloat16),
                         {**dt, "q_ptr": BF}, 8, aligned=("qkv_stride_t", "cs_stride"))
K["argmax"] = lambda: comp(argmax._argmax_kernel, dict(SPLITS=38, BLOCK=4096, BLOCK_S=64, PUBLISH=True, PDL=2),
                           {"logits_ptr": BF, "out_ptr": "*i64", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32",
                            "counter_ptr": "*i32", "host_ptr": "*i64", "turn_ptr": "*i32"}, 4, aligned=("stride",))
pa_aligned = ("q_stride_t", "q_stride_h", "o_stride_t", "o_stride_h", "c_stride_blk", "c_stride_tok", "c_stride_h")
def pa_types(fp8):
    cache = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "kv_scale_ptr": "*fp32"} if fp8 else {}
    return {**dt, "q_ptr": BF, "query_start_loc_ptr": "*i32", "tiles_ptr": "*i32", "kv_scale_ptr": "*i32", **cache}
def prefill(fp8):
    return comp(paged_attention._prefill_kernel, dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, BLOCK_M=64,
                BLOCK_N=64, DOT_PRECISION="tf32", USE_TILES=True, FP8=fp8, WIDEN_ASM=True, OUT_FP8=False, OUT_SCALES=1,
                BLOCK_S=1),
                pa_types(fp8), 4, 2, aligned=pa_aligned)
def decode_rows(fp8):
    return comp(rows_module._decode_rows_kernel, dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, SPLIT_CHUNK=8, GROUP=4,
                BLOCK_G=16, BLOCK_GR=4, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, BLOCK_N=64, MIN_SPLIT_LEN=64,
                DOT_PRECISION="tf32", FP8=fp8, WIDEN_ASM=True, OUT_FP8=False, OUT_SCALES=1, BLOCK_S=1),
                pa_types(fp8), 4, 2, aligned=pa_aligned)
K["prefill"] = lambda: prefill(False)
K["prefill_fp8"] = lambda: prefill(True)
if hasattr(rows_module, "_decode_rows_kernel"):
    K["decode_rows"] = lambda: decode_rows(False)
    K["decode_rows_fp8"] = lambda: decode_rows(True)
K["stage"] = lambda: comp(staging._stage_kernel, dict(HAS_PREV=True, BLOCK=1024),
                          {"src_words": "*i32", "dst_words": "*i32", "src_ids": "*i64", "dst_ids": "*i64", "prev_ptr": "*i64"}, 4)
res = {}
for name, f in K.items():
    if only and name not in only:
        continue
    res[name] = f()
    print(name, res[name]["n_sass"], flush=True)
json.dump(res, open(out, "w"))
