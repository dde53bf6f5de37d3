"""--quantization fp8 on a GGUF file: each tensor dequantized as read (and unpermuted, and for phi3 split),
then every decoder linear weight quantized per output channel as a plain safetensors checkpoint's is. A GGUF
file and the same weights written as a safetensors checkpoint, both quantized at load, hold the same FP8 bytes
and scales in every parameter and give the same logprobs: the GGUF path adds nothing of its own. Other
--quantization values on a GGUF file are refused in test_quantized.py."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tokenmill import LLM
from tokenmill.config import ModelConfig
from tokenmill.layers.parallel import TensorParallel
from tokenmill.layers.rotary import rotary_order
from tokenmill.quant import fp8
from tokenmill.runner.gguf_loader import hf_name, unpermute_rows
from tokenmill.runner.loader import load_model

from test_gguf import (HEAD_DIMS, HEADS, HIDDEN, INTER, KV_HEADS, LAYERS, Q, gguf, llama3_to_gguf,
                       llama3_tokenizer_metadata, tiny_tokenizer_metadata, write_gguf)
from test_real_model import engine_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = dict(device="cpu", dtype="float32", num_kv_blocks=16, block_size=4, max_num_batched_tokens=12)
IDS = [(37 * i + 11) % 256 for i in range(30)]


def _served_alike(gguf_path: str, twin_dir: str, **engine) -> torch.nn.Module:
    """Loads both with --quantization fp8 and checks that every parameter holds the same bytes (FP8 weights
    and their scales, the embedding, norms and head in float32) and the prompt logprobs (a prefill in chunks
    of 12) are equal; returns the GGUF file's model. `engine`: arguments over SMALL's."""
    ours, twin = (LLM(p, quantization="fp8", **{**SMALL, **engine}) for p in (gguf_path, twin_dir))
    model = ours.engine.runner.model
    got, want = dict(model.named_parameters()), dict(twin.engine.runner.model.named_parameters())
    assert got.keys() == want.keys()
    for name, t in got.items():
        assert t.dtype == want[name].dtype and torch.equal(t.view(torch.uint8), want[name].view(torch.uint8)), name
    assert got["model.layers.0.self_attn.qkv_proj.weight"].dtype == fp8.FP8
    assert got["model.layers.0.mlp.down_proj.weight"].dtype == fp8.FP8
    assert got["model.embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(engine_logprobs(ours, IDS), engine_logprobs(twin, IDS))
    return model


def _llama_file_and_twin(tmp_path) -> tuple[str, str, dict, dict]:
    """A llama file of Q8_0 (q, k, o, gate, down), Q4_K (up) and F16 (v) projections, and its twin checkpoint:
    the tensors as `gguf` dequantizes them, q and k unpermuted. Returns both paths, the twin's tensors and the
    file's (q and k as stored)."""
    path = str(tmp_path / "q8.gguf")
    layer = dict(attn_q=Q.Q8_0, attn_k=Q.Q8_0, attn_v=Q.F16, attn_output=Q.Q8_0, ffn_gate=Q.Q8_0, ffn_up=Q.Q4_K,
                 ffn_down=Q.Q8_0)
    tok = tiny_tokenizer_metadata()
    write_gguf(path, "llama", tok, seed=5, layer_types=[layer] * LAYERS, embed_type=Q.Q8_0)
    state, stored = {}, {}
    for t in gguf.GGUFReader(path).tensors:
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape(tuple(reversed([int(n) for n in t.shape])))
        key = hf_name(t.name)
        stored[key] = w
        heads = HEADS if ".q_proj." in key else KV_HEADS if ".k_proj." in key else None
        state[key] = w if heads is None else unpermute_rows(w, heads)
    twin = str(tmp_path / "twin")
    os.makedirs(twin)
    save_file(state, os.path.join(twin, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(twin, "config.json"), "w") as f:
        json.dump(dict(architectures=["LlamaForCausalLM"], vocab_size=len(tok["tokens"]), hidden_size=HIDDEN,
                       intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, head_dim=HEAD_DIMS["llama"], rope_theta=50000.0,
                       rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=False,
                       eos_token_id=2), f)
    return path, twin, state, stored


def test_llama_gguf_quantized_at_load_as_its_safetensors_twin(tmp_path):
    """Each linear layer of the llama file holds `fp8.quantize` of the tensor as `gguf` dequantizes it, q and k
    unpermuted first (the permuted rows would give other bytes), and every parameter and logprob equals those
    of the twin checkpoint of those dequantized tensors, quantized at load."""
    path, twin, state, stored = _llama_file_and_twin(tmp_path)
    model = _served_alike(path, twin)
    layer0 = model.model.layers[0].self_attn.qkv_proj
    parts = [fp8.quantize(state[f"model.layers.0.self_attn.{p}_proj.weight"]) for p in "qkv"]
    assert torch.equal(layer0.weight.view(torch.uint8), torch.cat([q for q, _ in parts]).view(torch.uint8))
    assert torch.equal(layer0.scale, torch.cat([s for _, s in parts]))
    permuted, _ = fp8.quantize(stored["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(layer0.weight[:len(permuted)].view(torch.uint8), permuted.view(torch.uint8))
    with pytest.raises(ValueError, match=r"--quantization awq cannot apply to .*q8\.gguf', a GGUF file"):
        LLM(path, quantization="awq", **SMALL)
    # tensor parallelism still loads plain safetensors checkpoints only
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 loads plain safetensors checkpoints only, "
                                         r"unquantized; .*q8\.gguf' is a GGUF file"):
        load_model(path, ModelConfig.from_gguf(path), torch.device("cpu"), torch.float32, "fp8", TensorParallel(0, 2))


@pytest.mark.gpu
def test_llama_gguf_quantized_at_load_on_the_gpu_as_its_safetensors_twin(tmp_path):
    """On a GPU each GGUF tensor goes to the device before it is unpermuted and quantized, as a safetensors
    checkpoint's tensors are opened there: the same bytes in every parameter, the same logprobs."""
    path, twin, _, _ = _llama_file_and_twin(tmp_path)
    _served_alike(path, twin, device="cuda", block_size=16, num_kv_blocks=8)


def test_phi3_gguf_quantized_at_load_as_its_safetensors_twin(tmp_path):
    """A Phi-4-mini-shaped phi3 file (fused attn_qkv and ffn_up, 12 of 16 dims rotating, LongRoPE, tied head) and
    the checkpoint it was converted from, both quantized at load: the same bytes in every parameter and the
    same logprobs. The fused tensors are quantized once split (and q/k put in the partial-rotary order), which
    gives the bytes of quantizing them whole: a row's scale is its own, whichever rows stand beside it."""
    from transformers import Phi3Config, Phi3ForCausalLM
    tok = llama3_tokenizer_metadata()
    torch.manual_seed(0)
    hf = Phi3ForCausalLM(Phi3Config(
        vocab_size=len(tok["tokens"]), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        original_max_position_embeddings=32, partial_rotary_factor=0.75, tie_word_embeddings=True,
        bos_token_id=tok["bos"], eos_token_id=tok["eos"], pad_token_id=None, initializer_range=0.2,
        rope_parameters={"rope_type": "longrope", "short_factor": [1.0, 1.125, 1.25, 1.5, 2.0, 2.5],
                         "long_factor": [2.0, 3.0, 4.5, 6.0, 8.0, 9.5], "rope_theta": 1e4})).eval()
    twin, path = str(tmp_path / "twin"), str(tmp_path / "phi3.gguf")
    hf.save_pretrained(twin)
    llama3_to_gguf(path, hf, tok, arch="phi3")
    # the file holds LongRoPE's numbers in float32 (the factors above are exact in it): the twin takes the
    # file's attention factor, so that both RoPE tables are the same and only the weights' path is compared
    with open(os.path.join(twin, "config.json")) as f:
        config = json.load(f)
    config["rope_parameters"]["attention_factor"] = ModelConfig.from_gguf(path).rope_scaling["attention_factor"]
    with open(os.path.join(twin, "config.json"), "w") as f:
        json.dump(config, f)
    model = _served_alike(path, twin)
    attn, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    gate_up, _ = fp8.quantize(mlp.gate_up_proj.weight.detach())
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight.view(torch.uint8), gate_up.view(torch.uint8))
    qkv, _ = fp8.quantize(attn.qkv_proj.weight.detach())
    order = rotary_order(16, 12)
    q, k, v = qkv.view(torch.uint8).split([4 * 16, 2 * 16, 2 * 16])
    q, k = (x.view(-1, 16, 64)[:, order].reshape(-1, 64) for x in (q, k))
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight.view(torch.uint8), torch.cat([q, k, v]))
