"""Phi-3 (`Phi3ForCausalLM`: Phi-3-mini, Phi-3.5-mini, Phi-4-mini): a Llama decoder whose checkpoints hold q/k/v
in one `qkv_proj` and gate/up in one `gate_up_proj`, which the loader splits into the packed layers' shards, with
partial rotary (Phi-4-mini's partial_rotary_factor 0.75) and LongRoPE (short and long factors, chosen once by the
served context). Tiny random checkpoints saved by transformers are served with transformers' logprobs and greedy
tokens: plain, partial rotary, LongRoPE in each regime where transformers chooses the factors tokenmill chose, a
sliding window as long as the context and one shorter than the prompt, FP8 quantized at load; a tensor-parallel
rank loads its slices of the fused tensors. The config's reading and its refusals are checked on config.json
dicts."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Phi3Config, Phi3ForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.layers.parallel import TensorParallel
from tokenmill.layers.rotary import RotaryEmbedding, rotary_order
from tokenmill.quant import fp8
from tokenmill.runner.loader import build_model, load_model, load_weights

from served_sequence import assert_gpu_equals_cpu_engine, sequence_logprobs, transformers_logprobs

PROMPT = [(37 * i + 11) % 128 for i in range(100)]
# the prompt's logprobs over a prefill chunked by 32 tokens, then 20 greedy tokens with theirs
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0, prompt_logprobs=0)
# LongRoPE over an original context of 64 (a context of 256: attention factor sqrt(1 + ln 4 / ln 64)), one
# factor per rotated frequency: 12 of head_dim 16 rotate at 0.75
SHORT, LONG = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], [2.0, 3.0, 4.5, 6.0, 8.0, 9.5]
LONGROPE = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "rope_theta": 1e4}
CHECKPOINTS = {
    # Phi-3-mini's shape: whole-head RoPE, and a window as long as the context (Phi-3.5's is longer)
    "plain": dict(sliding_window=256),
    "partial": dict(partial_rotary_factor=0.75),
    # Phi-4-mini's: partial rotary, LongRoPE, tied head
    "longrope": dict(partial_rotary_factor=0.75, original_max_position_embeddings=64, rope_parameters=LONGROPE,
                     tie_word_embeddings=True),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _served(model_dir: str, prompt: list[int] = PROMPT, **engine_args):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=32, **engine_args)
    return (llm, *sequence_logprobs(llm.generate([prompt], PARAMS)[0], prompt))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3")
    paths = {}
    for name, config in CHECKPOINTS.items():
        paths[name] = str(root / name)
        torch.manual_seed(0)
        Phi3ForCausalLM(Phi3Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e4, bos_token_id=None, eos_token_id=2,
            pad_token_id=0, initializer_range=0.2, **config)).save_pretrained(paths[name])  # peaked attention
    return paths


@pytest.fixture(scope="module")
def longrope(checkpoints):
    """(checkpoint directory, its greedy tokens and logprobs served at its whole context: the long factors)"""
    path = checkpoints["longrope"]
    return (path, *_served(path)[1:])


@pytest.mark.parametrize("name", ["plain", "partial"])
def test_phi3_equals_transformers(checkpoints, name):
    """Prompt logprobs over a chunked prefill, then greedy tokens and their logprobs past the prompt, as
    transformers computes them from the fused qkv_proj and gate_up_proj."""
    _, tokens, ours = _served(checkpoints[name])
    want = transformers_logprobs(checkpoints[name], PROMPT, tokens)
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()


def test_longrope_long_factors_past_the_original_context(longrope):
    """Served at its context of 256 (past the original 64: the long factors) with partial rotary and a tied head,
    a 120-token sequence computes what transformers computes over it, which takes the long factors too."""
    path, tokens, ours = longrope
    want = transformers_logprobs(path, PROMPT, tokens)
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()


def test_longrope_short_factors_within_the_original_context(longrope):
    """Served within the original context (max_model_len 64, or a cache of 64 tokens: the short factors), a
    60-token sequence computes what transformers computes over it (the short factors below 65 tokens); served at
    256, the same prompt takes the long factors, which transformers would not for it, and its logprobs move by
    more than 0.1."""
    path = longrope[0]
    prompt = PROMPT[:40]
    _, tokens, ours = _served(path, prompt, max_model_len=64)
    want = transformers_logprobs(path, prompt, tokens)
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    # a cache sized by hand to 64 tokens serves that context: the short factors too
    assert torch.equal(_served(path, prompt, num_kv_blocks=4, block_size=16)[2], ours)
    _, _, long = _served(path, prompt)
    assert (long[:len(prompt) - 1] - ours[:len(prompt) - 1]).abs().max() > 0.1


def test_partial_rotary_is_not_whole_head_rotary(checkpoints):
    """The partial checkpoint read with partial_rotary_factor 1.0 (every dim rotating, as Llama's) gives other
    logprobs: the test above would see a rotation of the wrong dims."""
    path = checkpoints["partial"]
    _, _, ours = _served(path)
    _, _, whole = _served(path, hf_overrides={"rope_parameters": {"partial_rotary_factor": 1.0}})
    assert (whole[:len(PROMPT) - 1] - ours[:len(PROMPT) - 1]).abs().max() > 0.1


def test_fp8_at_load_equals_transformers_on_its_dequantized_weights(checkpoints, tmp_path):
    """--quantization fp8 quantizes the fused tensors' shards per output channel after the split and the
    partial-rotary order, as it does Llama's: transformers on the checkpoint with each linear weight rounded
    so (a row's FP8 values times its scale) computes the same."""
    path, twin = checkpoints["partial"], str(tmp_path / "twin")
    state = load_file(os.path.join(path, "model.safetensors"))
    for key, w in state.items():
        if key.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")):
            q, scale = fp8.quantize(w)
            state[key] = q.float() * scale
    os.makedirs(twin)
    save_file(state, os.path.join(twin, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f, open(os.path.join(twin, "config.json"), "w") as out:
        out.write(f.read())
    llm, tokens, ours = _served(path, quantization="fp8")
    assert type(llm.engine.runner.model.model.layers[0].self_attn.qkv_proj).__name__ == "Fp8Linear"
    want = transformers_logprobs(twin, PROMPT, tokens)
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()


def test_a_tensor_parallel_rank_loads_its_slices_of_the_fused_tensors(checkpoints):
    """Each of 2 ranks reads its heads' rows of q, k and v out of qkv_proj (q and k in the partial-rotary order)
    and its rows of gate and of up out of gate_up_proj."""
    path = checkpoints["partial"]
    cfg = ModelConfig.from_hf(path)
    state = load_file(os.path.join(path, "model.safetensors"))
    order = rotary_order(16, 12)
    for rank in range(2):
        model = build_model(cfg, torch.device("cpu"), torch.float32, TensorParallel(rank, 2))
        load_weights(model, path)
        q, k, v = state["model.layers.1.self_attn.qkv_proj.weight"].split([64, 32, 32])
        heads = [t.reshape(-1, 16, 64)[n * rank:n * (rank + 1)] for t, n in ((q, 2), (k, 1), (v, 1))]
        want = torch.cat([heads[0][:, order], heads[1][:, order], heads[2]]).reshape(-1, 64)
        assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, want)
        gate, up = state["model.layers.1.mlp.gate_up_proj.weight"].split([128, 128])
        want = torch.cat([gate[64 * rank:64 * (rank + 1)], up[64 * rank:64 * (rank + 1)]])
        assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, want)


def test_a_sliding_window_shorter_than_the_prompt(checkpoints):
    """transformers' Phi3 attends over the latest sliding_window positions in every layer; so does tokenmill, at
    the model's whole context: a window of 7 over a 60-token prompt chunked by 32 computes what transformers
    computes, which differs from the same checkpoint's attention over the whole context."""
    path = checkpoints["plain"]
    prompt = PROMPT[:60]
    llm, tokens, ours = _served(path, prompt, hf_overrides={"sliding_window": 7})
    assert llm.engine.max_model_len == 256
    want = transformers_logprobs(path, prompt, tokens, sliding_window=7, attn_implementation="eager")
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    _, _, whole = _served(path, prompt)
    assert (whole[:len(prompt) - 1] - ours[:len(prompt) - 1]).abs().max() > 0.1


def test_partial_rotary_is_refused_where_rows_cannot_be_reordered(checkpoints):
    """A quantized checkpoint's packed values and scales do not take the partial-rotary order row by row; GPTQ's
    grids of a loaded model would carry the order into a checkpoint that a load reorders again."""
    from tokenmill.quant.gptq import gptq_model
    path = checkpoints["partial"]
    with pytest.raises(ValueError, match=r"rotates 12 of its head_dim=16 dims \(partial rotary\); tokenmill serves "
                                         r"partial rotary from plain weights only"):
        LLM(path, device="cpu", dtype="float32", hf_overrides={"quantization_config": {"quant_method": "fp8",
                                                                                    "weight_block_size": [128, 128]}})
    model = load_model(path, ModelConfig.from_hf(path), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"rotary_dim=12 of head_dim=16: the loaded model's q_proj and k_proj rows "
                                         r"are reordered"):
        gptq_model(model, torch.tensor([PROMPT[:8]]), 32)


# Phi-4-mini-instruct's config.json, its 48 factors of each kind cut to what a test needs to tell apart
PHI4_MINI = dict(architectures=["Phi3ForCausalLM"], vocab_size=200064, hidden_size=3072, intermediate_size=8192,
                 num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
                 original_max_position_embeddings=4096, partial_rotary_factor=0.75, rope_theta=10000.0,
                 rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
                 sliding_window=262144, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                 resid_pdrop=0.0, embd_pdrop=0.0, rms_norm_eps=1e-5, eos_token_id=199999, bos_token_id=199999)


def test_config_reads_phi4_mini_as_transformers_does():
    cfg = ModelConfig.from_hf(PHI4_MINI)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_dim, cfg.sliding_window, cfg.derived_max_model_len) == (
        128, 96, 96, 262144, 131072)
    s = cfg.rope_scaling
    assert (s["rope_type"], s["original_max_position_embeddings"], s["factor"]) == ("longrope", 4096, 32.0)
    # served at its context the long factors, at 4,096 the short ones; both times transformers' attention factor
    for context, factor in ((131072, 2.0), (4096, 1.0)):
        table = RotaryEmbedding(128, context, 1e4, s, rotary_dim=96).cos_sin
        inv = 1.0 / (1e4 ** (torch.arange(0, 96, 2, dtype=torch.float64) / 96)) / factor
        scale = (1 + torch.log(torch.tensor(32.0)) / torch.log(torch.tensor(4096.0))).sqrt()
        assert torch.allclose(table[5, :48].double(), (5 * inv).cos() * scale.double(), atol=1e-6)
        assert torch.equal(table[:, 48:64], torch.ones(context, 16)) and not table[:, 112:].any()
    # su and yarn are older names of longrope in transformers' Phi3; partial_rotary_factor in the RoPE dict first
    for old in ("su", "yarn"):
        cfg = ModelConfig.from_hf({**PHI4_MINI, "rope_scaling": {**PHI4_MINI["rope_scaling"], "type": old}})
        assert cfg.rope_scaling["rope_type"] == "longrope"
    whole = {**PHI4_MINI["rope_scaling"], "partial_rotary_factor": 1.0}
    cfg = ModelConfig.from_hf({**PHI4_MINI, "rope_scaling": whole})
    assert cfg.rotary_dim is None and cfg.rope_dim == 128
    # Phi3Config's defaults: original_max_position_embeddings 4,096 over the RoPE dict's own, rms_norm_eps 1e-5
    plain = {k: v for k, v in PHI4_MINI.items() if k not in ("original_max_position_embeddings", "rms_norm_eps")}
    plain["rope_scaling"] = {**PHI4_MINI["rope_scaling"], "original_max_position_embeddings": 8192}
    cfg = ModelConfig.from_hf(plain)
    assert (cfg.rope_scaling["original_max_position_embeddings"], cfg.rms_norm_eps) == (4096, 1e-5)


def test_config_reads_the_sliding_window_over_every_layer():
    """Phi-3-mini-4k's config: a window of 2,047 over every layer, served at its whole context of 4,096 (GPTQ
    calibration past the window too: its attention applies the window); null is no window."""
    cfg = ModelConfig.from_hf({**PHI4_MINI, "sliding_window": 2047, "max_position_embeddings": 4096,
                               "rope_scaling": None, "partial_rotary_factor": 1.0})
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.window(0), cfg.window(31)) == (2047, None, 2047, 2047)
    assert cfg.serving(4096).max_model_len == 4096
    from tokenmill.quant.gptq import check_calibration
    check_calibration(torch.zeros(1, 4096, dtype=torch.long), cfg)
    none = ModelConfig.from_hf({**PHI4_MINI, "sliding_window": None})
    assert none.sliding_window is None and none.window(0) is None


@pytest.mark.parametrize("change,message", [
    ({"partial_rotary_factor": 0}, r"partial_rotary_factor is 0; it must be a number in \(0, 1\]"),
    ({"partial_rotary_factor": "0.75"}, r"partial_rotary_factor is '0.75'; it must be a number in \(0, 1\]"),
    ({"partial_rotary_factor": 0.7}, r"rotary_dim is 89; RoPE rotates a head's leading dims in pairs, so it must be "
                                     r"an even integer from 2 to head_dim=128"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"Phi3ForCausalLM with rope_scaling of type 'linear' is "
                                                          r"not supported: transformers' Phi3 takes longrope"),
    ({"sliding_window": 0}, r"sliding_window is 0; it must be an integer >= 1 \(or null: none\)"),
])
def test_config_refuses_what_is_not_served(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**PHI4_MINI, **change})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_phi3_on_the_gpu_equals_the_cpu_engine(longrope, max_num_seqs):
    """The Triton prologue and one-kernel decode, under CUDA graphs, at one and at four sequences, with partial
    rotary (the table's identity columns, q/k rows in rotary_order) and LongRoPE's long factors: the CPU
    engine's greedy tokens, logprobs within float32 kernel rounding."""
    path, tokens, logprobs = longrope
    assert_gpu_equals_cpu_engine(path, PROMPT, PARAMS, tokens, logprobs, max_num_seqs, max_num_batched_tokens=32)
