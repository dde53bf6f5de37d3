"""One decoder for Llama (Nanbeige), Qwen2, Qwen3, SmolLM3, Granite, Phi-3, Gemma 2 and Gemma 3: features are explicit
flags of `ModelConfig`, Granite's scalars and Gemma's norm offsets and embedding scale folded into the weights at load
(`LlamaForCausalLM.fold_multipliers`), Phi-3's partial rotary in the RoPE table and the order of q's and k's rows
(`rotary.rotary_order`), Gemma's four norms a layer (`post_norms`), Gemma 2's soft caps of the attention scores
(`PagedAttention.softcap`) and of the logits (`compute_logits`), and Gemma 3's sliding layers' own RoPE table.

Weights are packed: q/k/v in one `qkv_proj`, gate/up in one `gate_up_proj` (see `packed_modules`; Phi-3's
checkpoints store them so, `fill.checkpoint_layout`).
The forward pass works on a flat batch of T tokens from many sequences; attention reaches the KV
cache through `AttentionMetadata`. Built with a `TensorParallel`, each module holds its rank's slice
(`layers/parallel.py` says which) and joins the slices with all-reduces after o_proj and down_proj, in
the embedding and an all-gather of the logits.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.layers.attention import PagedAttention
from tokenmill.layers.attention_metadata import AttentionMetadata
from tokenmill.layers.backend import TorchBackend
from tokenmill.layers.fp8_linear import Fp8Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.parallel import TensorParallel
from tokenmill.layers.quantized import Linear, W4Linear, linear
from tokenmill.layers.rotary import NoRotaryEmbedding, RotaryEmbedding
from tokenmill.quant.fp8 import Fp8Rows
from tokenmill.quant.formats import W4Config


def _weights(layer: nn.Module) -> dict:
    """A linear layer's tensors as the single-token products take them: the weight and bias, and an FP8
    layer's block scales."""
    if isinstance(layer, Fp8Linear):
        return dict(weight=layer.weight, bias=layer.bias, weight_scale=layer.scale, weight_block=layer.block)
    return dict(weight=layer.weight, bias=layer.bias)


def _scale_output(layer: nn.Module, factor: float) -> None:
    """Multiplies a linear layer's output by `factor` (o_proj and down_proj carry no bias): a plain weight,
    or a quantized layer's scales (W is its stored values times their scale, an FP8 layer's float32, a
    4-bit layer's fp16, zero points apart)."""
    (layer.scale if isinstance(layer, Fp8Linear) else layer.scales if isinstance(layer, W4Linear)
     else layer.weight).mul_(factor)


def _ranks(tp: TensorParallel | None) -> int:
    return 1 if tp is None else tp.size


class Attention(nn.Module):
    """`window`: the layer's sliding window (`ModelConfig.window`; None: it attends over the whole context)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel | None = None,
                 window: int | None = None):
        super().__init__()
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads // _ranks(tp), cfg.num_key_value_heads // _ranks(tp), cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, cfg.quantization)
        self.o_proj = linear(self.q_size, cfg.hidden_size, False, cfg.quantization)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, cfg.attention_scale, window,
                                   cfg.attn_logit_softcapping)
        self.backend = TorchBackend()
        self.tp = tp
        self.post_norm = cfg.post_norms

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                decode_attention=None):
        """The attention block's output, for the RMSNorm after it (in the backend's `linear_unscaled` form
        where that norm adds the residual, without tensor parallelism; else a tensor, after the all-reduce)."""
        # the one-kernel decode reads the scaled product (with cuBLASLt's unscaled one before it, qwen3-4b's decode
        # graphs of 96-192 sequences took 1.02-1.05x the time: docs/BENCHMARKS.md); the prologue of the other steps
        # applies the scales
        qkv = self.qkv_proj(x) if decode_attention is not None else self.backend.linear_unscaled(self.qkv_proj, x)
        attended = self.attend_qkv(positions, qkv, meta, decode_attention, into=self.o_proj)
        if self.tp is None:
            return self.o_proj(attended) if self.post_norm else self.backend.linear_unscaled(self.o_proj, attended)
        return self.tp.all_reduce(self.o_proj(attended))

    def attend_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata,
                   decode_attention=None, into=None) -> torch.Tensor | Fp8Rows:
        """Packed qkv projection [T, (Hq + 2 Hkv) D] -> attention output [T, Hq D], before o_proj; without
        `decode_attention`, qkv may come in the backend's `linear_unscaled` form.
        `decode_attention` (from the backend's `decode_attention`): the whole of it in that one kernel.
        `into` (o_proj, where its product takes the output as it is): the output in the form the backend
        writes for it (`TorchBackend.attend`); the single-token products read it as a tensor."""
        T = qkv.shape[0]
        qk_norm = ((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm
                   else (None, None, 0.0))
        if decode_attention is not None:
            out = decode_attention(qkv, positions, self.rotary.cos_sin, *qk_norm, self.attn.k_cache,
                                   self.attn.v_cache, meta.slot_mapping, meta.block_tables,
                                   meta.seq_lens, self.attn.scale, self.num_heads, self.num_kv_heads,
                                   self.head_dim, kv_scale=self.attn.kv_scale, into=into, window=self.attn.window,
                                   softcap=self.attn.softcap)
        else:
            # q/k norm, RoPE and the KV-cache store (one kernel on CUDA); attention then reads K/V from the
            # cache
            q = self.backend.qk_norm_rope_store(qkv, positions, self.rotary.cos_sin, *qk_norm, self.attn.k_cache,
                                                self.attn.v_cache, meta.slot_mapping, self.num_heads,
                                                self.num_kv_heads, self.head_dim, kv_scale=self.attn.kv_scale)
            out = self.backend.attend(q, self.attn.k_cache, self.attn.v_cache, meta, self.attn.scale,
                                      kv_scale=self.attn.kv_scale, into=into, window=self.attn.window,
                                      softcap=self.attn.softcap)
        return out if isinstance(out, Fp8Rows) else out.reshape(T, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.act = cfg.hidden_act       # act(gate) * up
        intermediate = cfg.intermediate_size // _ranks(tp)
        self.gate_up_proj = linear(cfg.hidden_size, 2 * intermediate, False, cfg.quantization)
        self.down_proj = linear(intermediate, cfg.hidden_size, False, cfg.quantization)
        self.backend = TorchBackend()
        self.tp = tp
        self.post_norm = cfg.post_norms

    def forward(self, x: torch.Tensor):
        """The MLP's output, for the next RMSNorm (as `Attention.forward`'s)."""
        act = self.backend.act_and_mul(self.backend.linear_unscaled(self.gate_up_proj, x), self.act,
                                       into=self.down_proj)
        if self.tp is None:
            return self.down_proj(act) if self.post_norm else self.backend.linear_unscaled(self.down_proj, act)
        return self.tp.all_reduce(self.down_proj(act))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel | None = None,
                 window: int | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, rotary, tp, window)
        self.mlp = MLP(cfg, tp)
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Gemma 3's four norms (transformers' names): post_attention_layernorm normalises the attention's output
        # alone, before its residual add; pre_feedforward_layernorm is the MLP's input norm, and
        # post_feedforward_layernorm normalises its output alone. The residual adds ride in the next norm as
        # ever: x + post_attn(attn) in pre_feedforward_layernorm's, h + post_ff(mlp) in the next layer's
        self.post_norms = cfg.post_norms
        if cfg.post_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.backend = TorchBackend()

    def forward(self, positions, hidden, residual, meta, fused_linear=None, decode_attention=None, ids=None):
        """`fused_linear` (from the backend's `single_token_linear`): run the layer as single-token
        kernels; `decode_attention` (from its `decode_attention`): the attention as one kernel; `ids`
        (first layer, single-token only): `hidden` is the embedding table and the input its rows `ids`."""
        if fused_linear is not None:
            return self._forward_single_token(fused_linear, decode_attention, positions, hidden, residual,
                                              meta, ids)
        if ids is not None:
            raise ValueError("a layer gathers its input rows (ids) only as single-token kernels")
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv_proj = self.self_attn.qkv_proj
        if residual is None:
            residual = hidden
            hidden = self.backend.rms_norm(hidden, norm1.weight, norm1.eps, into=qkv_proj)
        else:
            hidden, residual = self.backend.rms_norm(hidden, norm1.weight, norm1.eps, residual, into=qkv_proj)
        hidden = self.self_attn(positions, hidden, meta, decode_attention)
        if self.post_norms:
            hidden = self.backend.rms_norm(hidden, norm2.weight, norm2.eps)
            norm2 = self.pre_feedforward_layernorm
        hidden, residual = self.backend.rms_norm(hidden, norm2.weight, norm2.eps, residual,
                                                 into=self.mlp.gate_up_proj)
        hidden = self.mlp(hidden)
        if self.post_norms:
            norm3 = self.post_feedforward_layernorm
            hidden = self.backend.rms_norm(hidden, norm3.weight, norm3.eps)
        return hidden, residual

    def _forward_single_token(self, fused_linear, decode_attention, positions, hidden, residual, meta, ids):
        """The same layer for one token in four weight-reading kernels, each norm before a product folded into
        it and the gated activation into gate_up (see `kernels/gemv.py`); the first layer's qkv product also
        gathers the token's embedding. Gemma's norms after a product (`post_norms`) run on their own."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = fused_linear(hidden, **_weights(attn.qkv_proj), norm_weight=self.input_layernorm.weight,
                                     eps=self.input_layernorm.eps, residual=residual, ids=ids)
        hidden, _ = fused_linear(attn.attend_qkv(positions, qkv, meta, decode_attention), **_weights(attn.o_proj))
        if self.tp is not None:       # the partial sums join between kernels, before the norm folded into gate_up
            self.tp.all_reduce(hidden)
        norm2 = self.post_attention_layernorm
        if self.post_norms:
            hidden = self.backend.rms_norm(hidden, norm2.weight, norm2.eps)
            norm2 = self.pre_feedforward_layernorm
        hidden, residual = fused_linear(hidden, **_weights(mlp.gate_up_proj), norm_weight=norm2.weight,
                                        eps=norm2.eps, residual=residual, act=mlp.act)
        hidden, _ = fused_linear(hidden, **_weights(mlp.down_proj))
        if self.tp is not None:
            self.tp.all_reduce(hidden)
        if self.post_norms:
            norm3 = self.post_feedforward_layernorm
            hidden = self.backend.rms_norm(hidden, norm3.weight, norm3.eps)
        return hidden, residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        # an uninitialised weight (the checkpoint fills it): nn.Embedding's own random init, on the meta
        # device the model is built on, runs torch's Python reference of normal_, whose first call imports
        # torch._dynamo, 1.0-1.4 s of every process's start-up on the CPU machine
        rows = cfg.vocab_size // _ranks(tp)
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size, _weight=torch.empty(rows, cfg.hidden_size))
        # one row per position of the context the engine serves (its max_model_len; no position reaches
        # past it), which also chooses LongRoPE's factors; each layer reads its table from its own module
        # (every RoPE path, CUDA graphs and tensor-parallel ranks included), so the NoPE layers share one
        # identity table beside the rotating layers' one, and Gemma 3's sliding layers their local one
        n = cfg.served_max_model_len
        rotary = RotaryEmbedding(cfg.head_dim, n, cfg.rope_theta, cfg.rope_scaling, cfg.rope_dim)
        layers = range(cfg.num_hidden_layers)
        nope = None if all(cfg.rotates(i) for i in layers) else NoRotaryEmbedding(cfg.head_dim, n)
        local = (None if not any(cfg.rotates_locally(i) for i in layers)
                 else RotaryEmbedding(cfg.head_dim, n, cfg.local_rope_theta, None, cfg.rope_dim))
        tables = [nope if not cfg.rotates(i) else local if cfg.rotates_locally(i) else rotary for i in layers]
        self.layers = nn.ModuleList(DecoderLayer(cfg, tables[i], tp, cfg.window(i)) for i in layers)
        self.tp = tp
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.backend = TorchBackend()
        # the single-token products read plain and FP8 weight matrices; 4-bit layers run the backend's
        # w4_linear on every step
        self.single_token_layers = not isinstance(cfg.quantization, W4Config)

    def forward(self, input_ids, positions, meta):
        fused_linear = self.backend.single_token_linear(input_ids) if self.single_token_layers else None
        decode_attention = self.backend.decode_attention(input_ids, meta)
        residual, ids = None, None
        if self.tp is not None:             # a rank holds only its vocabulary rows of the table
            hidden = self.tp.vocab_embedding(input_ids, self.embed_tokens.weight)
        elif fused_linear is not None:      # the first product gathers the embedding itself
            hidden, ids = self.embed_tokens.weight, input_ids
        else:
            hidden = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, meta, fused_linear, decode_attention,
                                     ids if i == 0 else None)
        hidden, _ = self.backend.rms_norm(hidden, self.norm.weight, self.norm.eps, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Also serves Qwen2 (attention_bias), Qwen3 (qk_norm, tied head), SmolLM3 (NoPE layers, `rope_layers`),
    Granite (scalar multipliers), Phi-3 (`rotary_dim`, LongRoPE, fused checkpoint tensors), Gemma 2 (`post_norms`,
    norm offsets, GELU, soft caps) and Gemma 3 (those but the caps, q/k norm, a local RoPE table for its sliding
    layers) through config flags."""

    # checkpoint shard name -> (packed parameter name, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DecoderModel(cfg, tp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size // _ranks(tp), bias=False)
        self.tie_weights()

    def bind_kv_cache(self, kv_cache: torch.Tensor | None, kv_scales: torch.Tensor | None = None) -> None:
        """Layer i's attention reads and writes K in kv_cache[i, 0] and V in kv_cache[i, 1] (kv_cache:
        [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]), an FP8 cache with the scales
        kv_scales[i] (float32 [num_layers, 2]); None unbinds them."""
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn.attn
            if kv_cache is None:
                attn.k_cache = attn.v_cache = torch.empty(0)
                attn.kv_scale = None
            else:          # plain views (not unbind's), which the cache stores write into in place
                attn.k_cache, attn.v_cache = kv_cache[i, 0], kv_cache[i, 1]
                attn.kv_scale = None if kv_scales is None else kv_scales[i]

    def use_backend(self, backend: TorchBackend) -> None:
        """The implementation of each operation that the forward pass runs (`layers/backend.py`): every
        module that asks one (`.backend`) gets this one. Until then, the PyTorch reference."""
        for module in self.modules():
            if hasattr(module, "backend"):
                module.backend = backend

    def tie_weights(self) -> None:
        """Shares the embedding with the head when the checkpoint ties them (must be redone after
        a dtype or device move, which replaces parameters)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def fold_multipliers(self) -> None:
        """Granite's scalars, and Gemma's norm offsets and embedding scale, folded into the loaded weights (once,
        by the loader, before any layer repacks them), so that the one forward pass computes Granite's
        (transformers' modeling_granite) and Gemma 2's and Gemma 3's (modeling_gemma2, modeling_gemma3):

        - Gemma's RMSNorm multiplies by 1 + w for each stored weight w (`norm_unit_offset`): every norm's weight
          (the four of a layer, q/k norm, the final norm) becomes 1 + w, rounded once in the model's dtype where
          transformers adds in float32 (bfloat16: within 4e-3 of it, as its own rounding of the norm's output).
          Before the scalars below, which divide the final norm's weight.
        - residual_multiplier scales o_proj's and down_proj's products, x (r W)^T = r (x W^T): their
          weights, or a quantized layer's scales (FP8 and 4-bit weights are values times scales, so the
          product scales with them); every path (reference, single-token kernels, an FP8 product whose
          scales the norm applies) reads those tensors.
        - embedding_multiplier scales the embedding table, so every lookup (the single-token kernel's
          gather, a tensor-parallel rank's rows) reads the scaled rows. Gemma's sqrt(hidden_size) is rounded to
          the table's dtype first (`embedding_multiplier_in_dtype`), as transformers casts it: the scaled rows are
          then transformers' to the bit.
        - logits_scaling divides the logits: the head is linear in its input, norm(h) * w, so dividing the
          final norm's weight w divides them. A tied head is the scaled table too: its logits come out
          times embedding_multiplier, which w divides out likewise. RMSNorm is scale-invariant in its
          input, not its weight: only w may carry this, and only the head reads the final norm's output.

        Exact but for one rounding of each scaled tensor in its dtype (float32 ~6e-8 of a value, bfloat16
        ~4e-3, a 4-bit layer's fp16 scales ~5e-4), where transformers rounds each product times its scalar."""
        cfg = self.config
        if not cfg.multiplies_weights:
            return
        if cfg.norm_unit_offset:
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)
        if cfg.residual_multiplier != 1.0:
            for layer in self.model.layers:
                _scale_output(layer.self_attn.o_proj, cfg.residual_multiplier)
                _scale_output(layer.mlp.down_proj, cfg.residual_multiplier)
        table = self.model.embed_tokens.weight
        embedding = cfg.embedding_multiplier
        if cfg.embedding_multiplier_in_dtype:
            embedding = torch.tensor(embedding, dtype=torch.float32).to(table.dtype).item()
        table.mul_(embedding)
        tied = self.lm_head.weight is table
        self.model.norm.weight.mul_(1.0 / (cfg.logits_scaling * (embedding if tied else 1.0)))

    def shard_sizes(self, packed: str) -> list[int]:
        """The output features of each part of a packed projection (this rank's, with tensor parallelism)."""
        c, n = self.config, _ranks(self.tp)
        if packed == "qkv_proj":
            kv = c.num_key_value_heads // n * c.head_dim
            return [c.num_attention_heads // n * c.head_dim, kv, kv]
        return [c.intermediate_size // n] * 2

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits of `hidden`'s rows: the one place that makes them, for every path that samples,
        takes the argmax or scores tokens (eager and CUDA-graph steps, prompt logprobs, tensor-parallel workers).
        Gemma 2's `final_logit_softcapping` caps them here, cap x tanh(logits / cap) in their dtype, in
        transformers' order."""
        logits = self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.all_gather_last(logits)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
