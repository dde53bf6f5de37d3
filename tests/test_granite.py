"""Granite 3.x (`GraniteForCausalLM`): a Llama decoder with four scalars, folded into the weights at load
(embedding_multiplier, residual_multiplier, logits_scaling) or taken as the softmax scale
(attention_multiplier). Tiny random checkpoints saved by transformers, with the head tied (as the 2B
instruct) and untied and every scalar far from 1, are served with transformers' logprobs and greedy tokens;
served with any one scalar at its neutral value they are not. Quantized checkpoints (FP8, AWQ, GPTQ, FP8 at
load) carry the residual fold in their scales: each computes what transformers computes on its dequantized
weights. The config's reading and its refusals are checked on config.json dicts."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GraniteConfig, GraniteForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.models.registry import get_model_class
from tokenmill.quant import fp8, w4
from tokenmill.quant.formats import parse_w4_config
from tokenmill.quant.quantize import write_checkpoint

from served_sequence import assert_gpu_equals_cpu_engine, sequence_logprobs, transformers_logprobs
from test_fp8 import write_dequantized_twin

# far from 1, and from Llama's softmax scale (1/sqrt(16) = 0.25 at head_dim 16)
MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05, logits_scaling=4.0)
# each scalar's value where it changes nothing: what serving without its fold would compute
NEUTRAL = dict(embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=16 ** -0.5, logits_scaling=1.0)
PROMPT = [(37 * i + 11) % 128 for i in range(100)]
# the prompt's logprobs over a prefill chunked by 32 tokens, then 20 greedy tokens with theirs
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0, prompt_logprobs=0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def save_granite(path: str, tied: bool, **shape) -> None:
    torch.manual_seed(0)
    shape = dict(dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2), **shape)
    GraniteForCausalLM(GraniteConfig(
        **shape, max_position_embeddings=256, rope_theta=1e4, bos_token_id=None, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=tied, initializer_range=0.2, **MULTIPLIERS)).save_pretrained(path)


def _served(model_dir: str, **engine_args):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=32, **engine_args)
    return (llm, *sequence_logprobs(llm.generate([PROMPT], PARAMS)[0], PROMPT))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("granite")
    paths = {}
    for head in ("tied", "untied"):
        paths[head] = str(root / head)
        save_granite(paths[head], tied=head == "tied")
    return paths


@pytest.fixture(scope="module", params=["tied", "untied"])
def granite(request, checkpoints):
    """(checkpoint directory, the engine serving it, its greedy tokens, its logprobs)"""
    path = checkpoints[request.param]
    return (path, *_served(path))


def test_granite_equals_transformers(granite):
    """Prompt logprobs over a chunked prefill, then greedy tokens and their logprobs past the prompt, as
    transformers computes them; a tied head stays the embedding table (scaled), the scalars live in the
    weights and the attention's scale."""
    path, llm, tokens, ours = granite
    want = transformers_logprobs(path, PROMPT, tokens)
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    model = llm.engine.runner.model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == model.config.tie_word_embeddings
    assert {layer.self_attn.attn.scale for layer in model.model.layers} == {0.05}


@pytest.mark.parametrize("name", list(MULTIPLIERS))
def test_each_scalar_moves_the_output(granite, name):
    """Served with one scalar at its neutral value (as if its fold were dropped), the logprobs move by more
    than 0.1: the test above would see any one fold missing."""
    path, _, _, ours = granite
    _, _, neutral = _served(path, hf_overrides={name: NEUTRAL[name]})
    assert (neutral[:len(PROMPT) - 1] - ours[:len(PROMPT) - 1]).abs().max() > 0.1


def _w4_twin(qdir: str, plain_dir: str) -> None:
    """A 4-bit checkpoint's weights dequantized (`w4.dequantize`), as a plain checkpoint."""
    with open(os.path.join(qdir, "config.json")) as f:
        cfg = json.load(f)
    quant = parse_w4_config(cfg.pop("quantization_config"))
    state = load_file(os.path.join(qdir, "model.safetensors"))
    plain = {}
    for key, t in state.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == "qweight":
            in_features = t.shape[0] * (8 if quant.method == "gptq" else 1)
            plain[f"{prefix}.weight"] = w4.dequantize(t, state[f"{prefix}.qzeros"], state[f"{prefix}.scales"],
                                                      quant, in_features).contiguous()
        elif leaf not in ("qzeros", "scales", "g_idx"):
            plain[key] = t
    os.makedirs(plain_dir)
    save_file(plain, os.path.join(plain_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(plain_dir, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("fmt,atol", [("compressed-tensors", 1e-4), ("fp8 at load", 1e-4), ("awq", 2e-3),
                                      ("gptq", 2e-3)])
def test_quantized_granite_equals_transformers_on_its_dequantized_weights(checkpoints, tmp_path, fmt, atol):
    """residual_multiplier folded into o_proj's and down_proj's scales (FP8's float32 ones, rounded once in
    float32; AWQ's and GPTQ's fp16 ones, rounded once in fp16, ~5e-4 of a weight) computes what transformers
    computes on the checkpoint's dequantized weights, the Granite config beside them."""
    plain = checkpoints["tied"]
    with open(os.path.join(plain, "config.json")) as f:
        hf = json.load(f)
    state = load_file(os.path.join(plain, "model.safetensors"))
    qdir, twin = str(tmp_path / "q"), str(tmp_path / "twin")
    if fmt in ("awq", "gptq"):
        write_checkpoint(qdir, state, hf, fmt, 32)
        _w4_twin(qdir, twin)
    else:
        fp8.write_checkpoint(qdir, state, hf, "compressed-tensors")
        write_dequantized_twin(qdir, twin)
    # FP8 at load quantizes per channel as the compressed-tensors writer does (test_fp8.py)
    llm, tokens, ours = _served(plain, quantization="fp8") if fmt == "fp8 at load" else _served(qdir)
    layer = llm.engine.runner.model.model.layers[0].self_attn.o_proj
    assert type(layer).__name__ == ("W4Linear" if fmt in ("awq", "gptq") else "Fp8Linear")
    want = transformers_logprobs(twin, PROMPT, tokens)
    assert torch.allclose(ours, want, atol=atol), (ours - want).abs().max()


BASE = dict(architectures=["GraniteForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4)


def test_config_reads_the_scalars_as_transformers_does():
    cfg = ModelConfig.from_hf({**BASE, **MULTIPLIERS})
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling, cfg.attention_scale) == (
        12.0, 0.22, 4.0, 0.05)
    assert cfg.multiplies_weights
    # transformers' defaults where config.json is silent: 1.0 each, the softmax scale too (not 1/sqrt(head_dim))
    cfg = ModelConfig.from_hf(BASE)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling, cfg.attention_scale) == (
        1.0, 1.0, 1.0, 1.0)
    assert not cfg.multiplies_weights and cfg.max_position_embeddings == 2048
    # another architecture never reads the keys
    cfg = ModelConfig.from_hf({**BASE, **MULTIPLIERS, "architectures": ["LlamaForCausalLM"]})
    assert not cfg.multiplies_weights and cfg.attention_scale == 16 ** -0.5


@pytest.mark.parametrize("change,message", [
    ({"residual_multiplier": 0}, r"residual_multiplier is 0; it must be a positive finite number"),
    ({"embedding_multiplier": -12.0}, r"embedding_multiplier is -12.0; it must be a positive finite number"),
    ({"logits_scaling": "8"}, r"logits_scaling is '8'; it must be a positive finite number"),
    ({"attention_multiplier": float("inf")}, r"attention_multiplier is inf; it must be a positive finite number"),
    ({"attention_bias": True}, r"GraniteForCausalLM with attention_bias is not supported"),
    ({"mlp_bias": True}, r"GraniteForCausalLM with mlp_bias is not supported"),
])
def test_config_refuses_what_is_not_served(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**BASE, **change})


@pytest.mark.parametrize("arch,why", [("GraniteMoeForCausalLM", "its MLP is a mixture of experts"),
                                      ("GraniteMoeHybridForCausalLM", "Granite 4's decoder: Mamba-2 layers")])
def test_granite_moe_and_hybrid_are_refused(arch, why):
    with pytest.raises(ValueError, match=rf"unsupported architecture '{arch}' \({why}.*which tokenmill does not "
                                         r"run\); supported: .*GraniteForCausalLM, LlamaForCausalLM"):
        get_model_class(ModelConfig.from_hf({**BASE, "architectures": [arch]}))


def test_gptq_refuses_a_model_whose_residual_multiplier_is_folded(checkpoints):
    """GPTQ's grids of a loaded Granite would carry residual_multiplier into a checkpoint whose config.json
    names it too."""
    from tokenmill.quant.gptq import gptq_model
    from tokenmill.runner.loader import load_model
    path = checkpoints["tied"]
    model = load_model(path, ModelConfig.from_hf(path), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"residual_multiplier=0.22 is folded into the loaded model's o_proj "
                                         r"and down_proj"):
        gptq_model(model, torch.tensor([PROMPT[:8]]), 32)


def prefolded(src: str, out: str, dtype: torch.dtype) -> None:
    """The Granite checkpoint with embedding_multiplier, residual_multiplier and logits_scaling in its tensors
    (a quantized one's in its o_proj and down_proj scales; config.json's at 1.0), attention_multiplier kept: a
    model that computes the same through no fold. The embedding and the final norm are scaled in `dtype`, the
    one served, as the loader scales them."""
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    state = load_file(os.path.join(src, "model.safetensors"))
    r, e, s = cfg["residual_multiplier"], cfg["embedding_multiplier"], cfg["logits_scaling"]
    scaled = ("scales", "weight_scale") if "quantization_config" in cfg else ("weight",)
    for key in state:
        layer, _, leaf = key.rpartition(".")
        if layer.endswith(("o_proj", "down_proj")) and leaf in scaled:
            state[key] = state[key] * r
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].to(dtype) * e
    state["model.norm.weight"] = state["model.norm.weight"].to(dtype) * (
        1.0 / (s * (e if cfg["tie_word_embeddings"] else 1.0)))
    os.makedirs(out)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(cfg, residual_multiplier=1.0, embedding_multiplier=1.0, logits_scaling=1.0), f)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_granite_on_the_gpu_equals_the_cpu_engine(granite, max_num_seqs):
    """The Triton prologue, attention kernels (the config's softmax scale) and single-token products (the
    first one gathering the scaled embedding), under CUDA graphs, at one and at four sequences: the CPU
    engine's greedy tokens, logprobs within float32 kernel rounding."""
    path, _, tokens, logprobs = granite
    assert_gpu_equals_cpu_engine(path, PROMPT, PARAMS, tokens, logprobs, max_num_seqs, max_num_batched_tokens=32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["fp8", "awq"])
def test_quantized_granite_on_the_gpu_equals_its_prefolded_twin(tmp_path, fmt):
    """On the GPU's FP8 (W8A8, the norms applying o_proj's and down_proj's unscaled products) and 4-bit
    kernels in bfloat16, under CUDA graphs: a quantized Granite checkpoint (FP8 per channel, AWQ) whose residual
    fold the loader puts in its scales gives the logprobs and greedy tokens of the same quantized values with
    every fold already in the checkpoint (`prefolded`; equal on the CPU's reference in bfloat16, bit for bit). A
    dropped residual fold moved them there by 3.7-3.8 at most, 0.68-0.69 on average. Both sides read the same
    quantized bytes, written by the CPU quantizer, so that a difference is the fold's; FP8 quantized at load is
    compared apart (test_granite_fp8_at_load_on_the_gpu_equals_the_written_checkpoint)."""
    from test_real_model import engine_logprobs
    plain, twin = str(tmp_path / "plain"), str(tmp_path / "twin")
    save_granite(plain, tied=True, vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2)
    with open(os.path.join(plain, "config.json")) as f:
        hf = json.load(f)
    state = load_file(os.path.join(plain, "model.safetensors"))
    if fmt == "awq":
        write_checkpoint(plain + "-q", state, hf, "awq", 128)
    else:
        fp8.write_checkpoint(plain + "-q", state, hf, "compressed-tensors")
    plain += "-q"
    prefolded(plain, twin, torch.bfloat16)
    config = dict(device="cuda", dtype="bfloat16", max_num_seqs=4, num_kv_blocks=64, gpu_memory_utilization=0.3)
    ids = [(7 * i + 3) % 512 for i in range(40)]
    granite = LLM(plain, **config)
    folded = LLM(twin, **config)
    assert granite.engine.runner.graphs
    ours, want = engine_logprobs(granite, ids).float().cpu(), engine_logprobs(folded, ids).float().cpu()
    assert (ours - want).abs().max() < 0.05, (ours - want).abs().max()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[(5 * i + 7 * j) % 512 for j in range(n)] for i, n in enumerate([3, 20, 41, 9])]
    assert [o.outputs[0].token_ids for o in granite.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in folded.generate(prompts, params)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_granite_fp8_at_load_on_the_gpu_equals_the_written_checkpoint(tmp_path):
    """Granite's bf16 checkpoint quantized at load on the GPU (`--quantization fp8`, its multipliers folded
    into the scales) serves the logprobs of the same checkpoint written per channel by the CPU quantizer, bit
    for bit: both hold the same FP8 bytes and scales. With the scales divided on the GPU as a product with
    448's reciprocal they were 0.16 apart at most."""
    from test_real_model import engine_logprobs
    plain = str(tmp_path / "plain")
    save_granite(plain, tied=True, vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2)
    with open(os.path.join(plain, "config.json")) as f:
        hf = json.load(f)
    fp8.write_checkpoint(plain + "-q", load_file(os.path.join(plain, "model.safetensors")), hf, "compressed-tensors")
    config = dict(device="cuda", dtype="bfloat16", max_num_seqs=4, num_kv_blocks=64, gpu_memory_utilization=0.3)
    ids = [(7 * i + 3) % 512 for i in range(40)]
    at_load = engine_logprobs(LLM(plain, quantization="fp8", **config), ids)
    written = engine_logprobs(LLM(plain + "-q", **config), ids)
    assert torch.equal(at_load, written), (at_load.float() - written.float()).abs().max()
