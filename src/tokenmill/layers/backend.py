"""The compute backend: which implementation of each operation the model runs, chosen once when the runner
starts (`make_backend`) and bound to the model (`LlamaForCausalLM.use_backend`). `TorchBackend` is the
PyTorch reference, on any device; `TritonBackend`, on CUDA, runs our kernels (`kernels/`) with the tiles
and blocks of its `KernelConfig`. The model asks its backend; it never branches on the device.

Kernel modules are imported inside the Triton backend's methods, so the reference path never needs a
working Triton, and tests can switch Triton's interpreter on before the first import.
"""
from __future__ import annotations

from functools import partial

import torch

from tokenmill.layers.activation import act_and_mul_torch
from tokenmill.layers.attention import paged_attention_torch, store_kvcache_torch
from tokenmill.layers.attention_metadata import AttentionMetadata
from tokenmill.layers.kernel_config import KernelConfig
from tokenmill.layers.norm import rms_norm_torch
from tokenmill.layers.rotary import apply_rotary_torch
from tokenmill.quant.fp8 import FP8


class TorchBackend:
    """The reference of every operation; the kernels are tested against these."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 into=None):
        """norm(x + residual) * weight, and x + residual when a residual is given (see `rms_norm_torch`).
        `into`: the linear layer the result goes into, if any; a backend may give the result in the form
        that layer's product takes (the Triton backend: an FP8 layer's quantized rows)."""
        out, summed = rms_norm_torch(x, weight, eps, residual)
        return out if residual is None else (out, summed)

    def act_and_mul(self, x: torch.Tensor, act: str, into=None) -> torch.Tensor:
        """act(gate) * up of the packed [gate | up] x, `act` the MLP's activation (`activation.ACTIVATIONS`);
        `into` as for `rms_norm`."""
        return act_and_mul_torch(x, act)

    def qk_norm_rope_store(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           num_heads: int, num_kv_heads: int, head_dim: int,
                           kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The attention prologue from the packed qkv [T, (Hq + 2 Hkv) D]: per-head q/k RMSNorm (weights
        None: none), RoPE at `positions`, K/V stored at `slot_mapping` (quantized with `kv_scale` into an
        FP8 cache, attention.py). Returns q [T, Hq, D]."""
        t = qkv.shape[0]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = q.view(t, num_heads, head_dim)
        k = k.view(t, num_kv_heads, head_dim)
        v = v.view(t, num_kv_heads, head_dim)
        if q_weight is not None:
            q, _ = rms_norm_torch(q.contiguous(), q_weight, eps)
            k, _ = rms_norm_torch(k.contiguous(), k_weight, eps)
        cos, sin = cos_sin[positions].chunk(2, dim=-1)
        q, k = apply_rotary_torch(q, cos, sin), apply_rotary_torch(k, cos, sin)
        store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping, kv_scale)
        return q

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scale: torch.Tensor | None = None, into=None,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q [T, Hq, D] over the paged cache, which already holds this step's K/V, within the layer's sliding
        `window` (`PagedAttention.window`; None: the whole context), its scores soft-capped by `softcap`
        (`PagedAttention.softcap`; None: none). `into`: the layer that takes the output
        next (o_proj), for a backend that writes it in the form that layer reads (the Triton backend: an FP8
        layer's input rows in E4M3 at V's scale, beside an FP8 cache)."""
        return paged_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                     scale, kv_scale, window, softcap)

    def single_token_linear(self, input_ids: torch.Tensor):
        """A `gemv.fused_linear`-like product when a step of these input ids runs its layers as
        single-token kernels (norm folded into the product, the gated activation into gate_up), else None. It
        takes plain weights and FP8 ones (with `weight_scale` and `weight_block`); a 4-bit model never
        asks for it."""
        return None

    def decode_attention(self, input_ids: torch.Tensor, meta: AttentionMetadata):
        """A `decode_attention.fused_decode_attention`-like function when a step's attention runs as one
        kernel from the packed qkv, else None; it takes `into`, `window` and `softcap` as `attend` does."""
        return None

    def w4_linear(self, x: torch.Tensor, layer) -> torch.Tensor:
        """x [T, in] @ W^T (+ bias) for a 4-bit `quantized.W4Linear`: W dequantized from its repacked
        tensors for this call (`quantized.dequantize_w4`), in x's dtype."""
        return torch.nn.functional.linear(x, layer.dequantized().to(x.dtype), layer.bias)

    def fp8_linear(self, x: torch.Tensor, layer) -> torch.Tensor:
        """x [T, in] @ W^T (+ bias) for an `fp8_linear.Fp8Linear`: W dequantized for this call
        (`quant/fp8.dequantize`), in x's dtype."""
        from tokenmill.layers.kernels.fp8_gemm import fp8_linear_torch
        return fp8_linear_torch(x, layer.weight, layer.scale, layer.block, layer.bias)

    def linear_unscaled(self, layer, x: torch.Tensor):
        """`layer(x)` for a product whose result goes next into `rms_norm` beside a residual (o_proj and
        down_proj), `act_and_mul` (gate_up) or `qk_norm_rope_store` (qkv); a backend may give it in a form
        that only those kernels read (the Triton backend: an FP8 layer's product before its scales,
        `quant/fp8.UnscaledRows`, which the next kernel applies)."""
        return layer(x)

    def greedy(self, logits: torch.Tensor, publish: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Each row's argmax (first of equals); `publish` (host, turn): also into row `turn` of the host
        table, as `argmax.greedy` takes it."""
        ids = logits.argmax(-1)
        if publish is not None:
            from tokenmill.layers.kernels.argmax import check_publish
            check_publish(publish, len(ids))
            host, turn = publish
            host[int(turn)][:len(ids)] = ids
        return ids


class TritonBackend(TorchBackend):
    """Our Triton kernels (CUDA; Triton's interpreter runs them on the CPU in tests)."""

    name = "triton"

    def __init__(self, kernels: KernelConfig | None = None):
        self.kernels = kernels or KernelConfig()

    def rms_norm(self, x, weight, eps, residual=None, into=None):
        from tokenmill.layers.kernels import fused_ops
        return fused_ops.rms_norm(x, weight, eps, residual, fp8_group=self._fp8_group(into))

    def act_and_mul(self, x, act, into=None):
        from tokenmill.layers.kernels import fused_ops
        return fused_ops.act_and_mul(x, act, fp8_group=self._fp8_group(into))

    @staticmethod
    def _fp8_layer(layer) -> bool:
        weight = getattr(layer, "weight", None)      # 4-bit layers have none
        return weight is not None and weight.dtype == FP8

    @staticmethod
    def _fp8_group(layer) -> int | None:
        """The columns per scale with which an FP8 layer's product takes its input rows quantized
        (`fp8_gemm.input_group`), so that the kernel writing them quantizes them; else None."""
        if not TritonBackend._fp8_layer(layer):
            return None
        from tokenmill.layers.kernels import fp8_gemm
        return fp8_gemm.input_group(layer.weight.shape, layer.block, layer.weight.device)

    def qk_norm_rope_store(self, *args, **kwargs):
        from tokenmill.layers.kernels import attention_prologue
        return attention_prologue.qk_norm_rope_store(*args, **kwargs)

    def attend(self, q, k_cache, v_cache, meta, scale, kv_scale=None, into=None, window=None, softcap=None):
        from tokenmill.layers.kernels import paged_attention
        return paged_attention.paged_attention(q, k_cache, v_cache, meta, scale, self.kernels.prefill_attention,
                                               kv_scale=kv_scale,
                                               decode_config=self.kernels.decode_attention_for(kv_scale is not None),
                                               out_group=self._out_group(kv_scale, into), window=window,
                                               softcap=softcap)

    @staticmethod
    def _out_group(kv_scale, into) -> int | None:
        """With an FP8 cache, the columns a scale with which an FP8 o_proj takes its input rows: the
        attention kernels write them in E4M3 at V's scale (`attention_common.out_rows`); else None."""
        return None if kv_scale is None or into is None else TritonBackend._fp8_group(into)

    def single_token_linear(self, input_ids):
        from tokenmill.layers.kernels import gemv
        if input_ids.shape[0] > gemv.MAX_ROWS:
            return None
        return partial(gemv.fused_linear, kernels=self.kernels)

    def decode_attention(self, input_ids, meta):
        if not meta.is_pure_decode(input_ids.shape[0]):
            return None
        from tokenmill.layers.kernels import decode_attention
        kernels, out_group = self.kernels, self._out_group

        def attend(*args, kv_scale=None, into=None, window=None, softcap=None, **kwargs):
            return decode_attention.fused_decode_attention(
                *args, kv_scale=kv_scale, config=kernels.decode_attention_for(kv_scale is not None),
                out_group=out_group(kv_scale, into), window=window, softcap=softcap, **kwargs)
        return attend

    def w4_linear(self, x, layer):
        from tokenmill.layers.kernels import w4_gemm
        return w4_gemm.w4_linear(x, layer.qweight, layer.scales, layer.zeros, layer.bias, layer.quant.group_size)

    def fp8_linear(self, x, layer):
        from tokenmill.layers.kernels import fp8_gemm
        return fp8_gemm.fp8_linear(x, layer.weight, layer.scale, layer.block, layer.bias)

    def linear_unscaled(self, layer, x):
        if not TritonBackend._fp8_layer(layer):
            return layer(x)
        from tokenmill.layers.kernels import fp8_gemm
        return fp8_gemm.fp8_linear(x, layer.weight, layer.scale, layer.block, layer.bias, unscaled=True)

    def greedy(self, logits, publish=None):
        from tokenmill.layers.kernels import argmax
        return argmax.greedy(logits, publish=publish)


def make_backend(device: torch.device, kernels: KernelConfig | None = None) -> TorchBackend:
    """Triton on CUDA, the PyTorch reference elsewhere."""
    return TritonBackend(kernels) if device.type == "cuda" else TorchBackend()
