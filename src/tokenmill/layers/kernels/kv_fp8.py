"""An FP8 KV cache's values in the attention kernels: K and V stored as E4M3 of value / the layer's scale
(`quantize_kv`, the prologue and the one-kernel decode), the layer's (K, V) scales (`load_kv_scales`), q as
the products with E4M3 tiles take it (`fp8_kv_operand`) and V's tile widened for p @ V (`fp8_v_tile`,
`widen_e4m3`). The cache's dtype and scales are defined in attention.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.layers.kernels.fused_ops import FP8_MAX


@triton.jit
def quantize_kv(x, scale, FP8: tl.constexpr):
    # with FP8: x / scale clamped to E4M3's range, then rounded to it (the cast alone may give NaN);
    # else x unchanged
    if FP8:
        y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)
        return y.to(tl.float8e4nv)
    else:
        return x


@triton.jit
def fp8_kv_operand(x, FP8: tl.constexpr):
    # q for the products with an FP8 cache's K/V: float16 when q is bfloat16. E4M3 widens to float16 in
    # one instruction per two values and to bfloat16 only through float16 and a second conversion per
    # value, which left the loops instruction-bound; float16 holds E4M3 exactly, and q (clamped into its
    # range) and p in [0, 1] with more mantissa bits than bfloat16. Without FP8, or in float16 or
    # float32, x unchanged.
    if FP8 and x.dtype == tl.bfloat16:
        return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    else:
        return x


@triton.jit
def widen_e4m3(x):
    # an E4M3 tile -> float16 (exact) by the conversion instruction, in inline assembly marked impure:
    # Triton traces a product's operands back through element-wise ops, and one that reaches 8-bit values
    # gives every operand of the product, and of the products sharing them (q, P), 4-wide k packs that
    # 16-bit HMMA operands do not have natively (moves, q reloaded, P through shared memory each tile);
    # the trace does not cross this op. GPU only (the interpreter runs no assembly).
    return tl.inline_asm_elementwise(
        "{.reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi;}",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def fp8_v_tile(v, dtype: tl.constexpr, FP8: tl.constexpr, WIDEN_ASM: tl.constexpr):
    # a V tile for p @ V in the operand dtype; from an FP8 cache unscaled (V's scale multiplies the
    # output) and widened by `widen_e4m3` where WIDEN_ASM (compiled for a GPU) and the operand is float16
    # (a float32 model takes the plain conversion). Widened in registers without the assembly, the
    # product reads V from shared memory a byte at a time, about 75% more instructions per tile than the
    # bf16 kernels spend.
    if FP8 and WIDEN_ASM and dtype == tl.float16:
        return widen_e4m3(v)
    else:
        return v.to(dtype)


@triton.jit
def load_kv_scales(kv_scale_ptr, FP8: tl.constexpr):
    # the layer's (K, V) scales of an FP8 cache; 1.0 for a cache in the model dtype
    if FP8:
        return tl.load(kv_scale_ptr), tl.load(kv_scale_ptr + 1)
    else:
        return 1.0, 1.0
