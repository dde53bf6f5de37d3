"""`ModelConfig`: the model's shape and features, frozen and checked, and what follows from them.
`ModelConfig.from_hf` reads a Hugging Face config.json (`hf_config.py`), `ModelConfig.from_gguf` a GGUF file's
model metadata (`gguf_config.py`). Imported as `tokenmill.config.ModelConfig`, beside `EngineConfig`."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.config_values import ACTIVATIONS, GRANITE_MULTIPLIERS, finite_number, positive
from tokenmill.quant.formats import Fp8Config, W4Config

# torch is imported where a dtype or a device is made, not here: an API server process builds these
# configs (the command line's) without the tensor library, which would cost it ~1.5 s of CPU and ~180 MB

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype
    hidden_act: str = "silu"
    # the checkpoint's weight format (its quantization_config); None: plain weights
    quantization: W4Config | Fp8Config | None = None
    # per layer, whether it rotates q and k (`rotates`); None: every layer does. SmolLM3's NoPE layers do not
    rope_layers: tuple[bool, ...] | None = None
    # Granite's scalars: the embeddings times embedding_multiplier, each residual branch (attention and MLP
    # outputs) times residual_multiplier, the logits over logits_scaling, all three folded into the weights
    # at load (`LlamaForCausalLM.fold_multipliers`); the attention's softmax scale `attention_scale`
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # the softmax scale of q.k; None: 1/sqrt(head_dim)
    attention_multiplier: float | None = None
    # embedding_multiplier rounded to the model's dtype before it scales the table, as transformers' Gemma casts
    # its sqrt(hidden_size) (34.0 for sqrt(1152) in bfloat16); Granite's scales as the number it is
    embedding_multiplier_in_dtype: bool = False
    # Gemma 3's four norms a layer: the attention's and the MLP's outputs each normalised before their residual
    # add (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by pre_feedforward_layernorm
    post_norms: bool = False
    # every RMSNorm weight stored as its offset from 1 (Gemma's x_normed * (1 + w)); the load adds the 1
    # (`LlamaForCausalLM.fold_multipliers`)
    norm_unit_offset: bool = False
    # the leading dims of each head that RoPE rotates (Phi-3's partial_rotary_factor: Phi-4-mini's 96 of 128),
    # the rest passed through; None: the whole head
    rotary_dim: int | None = None
    # the sliding window of the layers that have one: a query at position p sees the positions j with
    # p - sliding_window < j <= p alone (transformers' mask; `window`); None: every layer sees the whole context
    sliding_window: int | None = None
    # per layer, whether it attends over sliding_window (Qwen2's from max_window_layers on, layer_types'
    # "sliding_attention", Gemma 3's); None with a window: every layer does (Mistral's, Phi-3's)
    sliding_layers: tuple[bool, ...] | None = None
    # the RoPE base of the sliding layers, which rotate unscaled (Gemma 3's rope_local_base_freq); None: every
    # layer rotates with rope_theta and rope_scaling
    local_rope_theta: float | None = None
    # Gemma 2's soft cap of every layer's attention scores: q.k x attention_scale = s becomes
    # attn_logit_softcapping x tanh(s / attn_logit_softcapping) before the softmax, in every attention path
    # (`PagedAttention.softcap`); None: none
    attn_logit_softcapping: float | None = None
    # Gemma 2's soft cap of the logits: each becomes final_logit_softcapping x tanh(logit / final_logit_softcapping)
    # in `LlamaForCausalLM.compute_logits`, which every path that samples or scores tokens reads; None: none
    final_logit_softcapping: float | None = None
    # the longest context served: the engine's max_model_len, set once resolved (`serving`); None:
    # derived_max_model_len. LongRoPE's factors are chosen by it (`rotary.longrope_uses_long_factors`)
    max_model_len: int | None = None

    def __post_init__(self):
        # sizes a checkpoint's config states: a zero or negative one failed deep in the build (an empty RoPE
        # table, a division by zero), or loaded a model whose KV heads no query head maps onto
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"the model config's {name} is {value!r}; it must be an integer >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"the model config's num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads} (each KV head serves a whole "
                             "group of query heads)")
        if self.head_dim % 2:
            raise ValueError(f"the model config's head_dim is {self.head_dim}; RoPE rotates a head's values in pairs, "
                             "so it must be even")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_hidden_layers:
            raise ValueError(f"the model config's rope_layers has {len(self.rope_layers)} entries; it needs one per "
                             f"layer, num_hidden_layers={self.num_hidden_layers}")
        # a negative or NaN one loaded a model whose every output was noise
        if not positive(self.rope_theta):
            raise ValueError(f"the model config's rope_theta is {self.rope_theta!r}; it must be a positive finite "
                             "number")
        if not (finite_number(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise ValueError(f"the model config's rms_norm_eps is {self.rms_norm_eps!r}; it must be a finite number "
                             ">= 0")
        for name in ("local_rope_theta", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not positive(value):
                raise ValueError(f"the model config's {name} is {value!r}; it must be a positive finite number (or "
                                 "None: none)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"the model config's hidden_act is {self.hidden_act!r}; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        for name in GRANITE_MULTIPLIERS:
            value = getattr(self, name)
            if not (name == "attention_multiplier" and value is None) and not positive(value):
                raise ValueError(f"the model config's {name} is {value!r}; it must be a positive finite number")
        r = self.rotary_dim
        if r is not None and (type(r) is not int or r % 2 or not 2 <= r <= self.head_dim):
            raise ValueError(f"the model config's rotary_dim is {r!r}; RoPE rotates a head's leading dims in pairs, "
                             f"so it must be an even integer from 2 to head_dim={self.head_dim}")
        for name in ("sliding_window", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"the model config's {name} is {value!r}; it must be an integer >= 1 (or None)")
        layers = self.sliding_layers
        if layers is not None:
            if self.sliding_window is None:
                raise ValueError("the model config's sliding_layers name the layers that attend over sliding_window, "
                                 "which is None; give the window (or no sliding_layers)")
            if len(layers) != self.num_hidden_layers or any(type(f) is not bool for f in layers):
                raise ValueError(f"the model config's sliding_layers is {layers!r}; it needs a bool per layer, "
                                 f"num_hidden_layers={self.num_hidden_layers}")

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax, in every attention path (`PagedAttention.scale`)."""
        return self.head_dim ** -0.5 if self.attention_multiplier is None else float(self.attention_multiplier)

    @property
    def multiplies_weights(self) -> bool:
        """Whether loading scales weights by the config's multipliers, or adds 1 to its norms'
        (`LlamaForCausalLM.fold_multipliers`): its linear, embedding and norm weights are then not the
        checkpoint's."""
        return (self.norm_unit_offset
                or (self.embedding_multiplier, self.residual_multiplier, self.logits_scaling) != (1.0, 1.0, 1.0))

    @property
    def rope_dim(self) -> int:
        """The leading dims of each head that RoPE rotates: rotary_dim, else all of head_dim."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def served_max_model_len(self) -> int:
        """The longest context served: max_model_len once the engine set it, else derived_max_model_len."""
        return self.derived_max_model_len if self.max_model_len is None else self.max_model_len

    def serving(self, max_model_len: int) -> "ModelConfig":
        """This config serving contexts of up to `max_model_len` tokens (the engine's, once resolved)."""
        return dataclasses.replace(self, max_model_len=max_model_len)

    def rotates(self, layer: int) -> bool:
        """Whether `layer` applies RoPE to q and k (a NoPE layer attends by content alone)."""
        return self.rope_layers is None or self.rope_layers[layer]

    def window(self, layer: int) -> int | None:
        """The sliding window `layer` attends over (a query sees itself and the window - 1 positions before
        it), or None where it sees the whole context. The KV cache keeps every position either way."""
        if self.sliding_window is None or not (self.sliding_layers is None or self.sliding_layers[layer]):
            return None
        return self.sliding_window

    def rotates_locally(self, layer: int) -> bool:
        """Whether `layer` rotates with the local base (`local_rope_theta`, unscaled): Gemma 3's sliding layers."""
        return self.local_rope_theta is not None and (self.sliding_layers is None or self.sliding_layers[layer])

    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | os.PathLike,
                hf_overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """Normalise a Hugging Face config (a dict, a config.json path or a model directory), with
        `hf_overrides` merged over it first (`merge_hf_overrides`)."""
        from tokenmill.hf_config import read_hf_config
        return read_hf_config(cls, hf, hf_overrides)

    @classmethod
    def from_gguf(cls, gguf: Any) -> "ModelConfig":
        """Our config from a GGUF file's metadata (a path, or an opened `gguf_file.GGUFFile`):
        `{arch}.*` shape keys, RoPE base, RMSNorm eps, context length, the tokenizer's BOS id and its
        EOS/EOT/EOM ids as stop ids, a head tied to the embedding when the file has no `output.weight`, a
        granite file's scalars, a phi3 file's rotated dims, LongRoPE factors and sliding window (over
        every layer), and a gemma2 or gemma3 file's layers (`gguf_config._gguf_gemma`)."""
        from tokenmill.gguf_config import read_gguf_config
        return read_gguf_config(cls, gguf)

    @property
    def derived_max_model_len(self) -> int:
        """The longest context the model serves (vLLM's derived max_model_len; the RoPE table covers it):
        max_position_embeddings, or with YaRN original_max_position_embeddings x factor where that is
        longer. YaRN numbers that are not positive are left to the RoPE table's check, which names them."""
        s = self.rope_scaling
        if s is None or s["rope_type"] != "yarn" or not (positive(s.get("factor"))
                                                         and positive(s.get("original_max_position_embeddings"))):
            return self.max_position_embeddings
        return max(self.max_position_embeddings, int(s["original_max_position_embeddings"] * s["factor"]))

    @property
    def derived_max_model_len_source(self) -> str:
        """Where `derived_max_model_len` comes from, for an error that refuses a longer max_model_len."""
        n, s = self.derived_max_model_len, self.rope_scaling
        if n == self.max_position_embeddings:
            return f"max_position_embeddings={n}"
        return (f"YaRN context of {n} tokens (rope_scaling's original_max_position_embeddings="
                f"{s['original_max_position_embeddings']} x factor={s['factor']}; max_position_embeddings="
                f"{self.max_position_embeddings})")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * self.dtype.itemsize
