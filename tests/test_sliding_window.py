"""Sliding-window attention in some layers only, as transformers computes it: Qwen2's use_sliding_window over the
layers from max_window_layers on, or those layer_types marks "sliding_attention", each over the window's latest
positions and the other layers over the whole context. A tiny random Qwen2 checkpoint saved by transformers (a
window of 5 in two of four layers) is served with transformers' logprobs and greedy tokens: two prompts at once,
prefilled in chunks of 8 tokens beside each other's decodes. Its reading of the config keys is checked on dicts
(Mistral's and Phi-3's every-layer windows in their own tests)."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig

from served_sequence import assert_gpu_equals_cpu_engine, sequence_logprobs, transformers_logprobs

PROMPTS = [[(37 * i + 11) % 128 for i in range(30)], [(29 * i + 5) % 128 for i in range(23)]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0)
# layers 2 and 3 slide (max_window_layers 2), as transformers' Qwen2Config reads it
WINDOW = dict(use_sliding_window=True, sliding_window=5, max_window_layers=2)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2_window"))
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=2, pad_token_id=0,
        initializer_range=0.2, **WINDOW)).save_pretrained(path)
    return path


def _served(path: str, **engine_args) -> list[tuple[list[int], torch.Tensor]]:
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=8, **engine_args)
    return [sequence_logprobs(result, prompt) for result, prompt in zip(llm.generate(PROMPTS, PARAMS), PROMPTS)]


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"] * 2])
def test_qwen2_sliding_layers_equal_transformers(qwen2, layer_types):
    """From max_window_layers on (layers 2 and 3), or by layer_types (layers 0 and 2): each prompt's logprobs and
    greedy tokens are transformers' (eager attention, whose mask applies the window)."""
    overrides = {} if layer_types is None else dict(layer_types=layer_types)
    for prompt, (tokens, ours) in zip(PROMPTS, _served(qwen2, hf_overrides=overrides)):
        want = transformers_logprobs(qwen2, prompt, tokens, attn_implementation="eager", **overrides)
        assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()


def test_the_window_changes_the_output(qwen2):
    """Served without its window (every layer "full_attention"), the checkpoint gives other logprobs: the test
    above would see attention over the whole context."""
    windowed = _served(qwen2)[0][1]
    whole = _served(qwen2, hf_overrides={"layer_types": ["full_attention"] * 4})[0][1]
    n = len(PROMPTS[0]) - 1
    assert (whole[:n] - windowed[:n]).abs().max() > 0.1


BASE = dict(architectures=["Qwen2ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
            num_hidden_layers=4, num_attention_heads=2)


@pytest.mark.parametrize("keys,windows", [
    # transformers' defaults: a window of 4,096 from layer 28 on (none of four), or from max_window_layers on
    (dict(use_sliding_window=True), [None] * 4),
    (dict(use_sliding_window=True, max_window_layers=3), [None, None, None, 4096]),
    (dict(use_sliding_window=True, max_window_layers=0, sliding_window=16), [16] * 4),
    # without use_sliding_window Qwen2 has no window, whatever sliding_window and max_window_layers say
    (dict(use_sliding_window=False, sliding_window=16, max_window_layers=0), [None] * 4),
    (dict(use_sliding_window=True, sliding_window=None, max_window_layers=0), [None] * 4),
    # layer_types over max_window_layers
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=3,
          layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"]),
     [16, None, None, 16]),
    (dict(layer_types=["full_attention"] * 4, sliding_window=16), [None] * 4),
    # Llama's decoder in transformers reads no window key
    (dict(architectures=["LlamaForCausalLM"], layer_types=["sliding_attention"] * 4, sliding_window=16,
          use_sliding_window=True), [None] * 4),
    (dict(architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=16, max_window_layers=2),
     [None, None, 16, 16]),
])
def test_config_reads_the_sliding_layers_as_transformers_does(keys, windows):
    cfg = ModelConfig.from_hf({**BASE, **keys})
    assert [cfg.window(i) for i in range(4)] == windows
    assert cfg.sliding_layers is None or not all(cfg.sliding_layers)     # every layer: None


@pytest.mark.parametrize("keys,message", [
    (dict(layer_types=["sliding_attention"] * 4, sliding_window=16),
     r"layer_types marks layers \[0, 1, 2, 3\] \"sliding_attention\", but Qwen2ForCausalLM has no window without "
     r"use_sliding_window: transformers builds no mask for them either"),
    (dict(layer_types=["sliding_attention"] * 3, sliding_window=16, use_sliding_window=True),
     r"layer_types is \['sliding_attention', 'sliding_attention', 'sliding_attention'\]; it must list each of the "
     r"num_hidden_layers=4 layers' attention"),
    (dict(use_sliding_window=True, sliding_window=0, max_window_layers=0),
     r"sliding_window is 0; it must be an integer >= 1 \(or null: none\)"),
])
def test_config_refuses_sliding_layers_without_a_window(keys, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**BASE, **keys})


def test_model_config_checks_its_sliding_layers():
    cfg = ModelConfig.from_hf(BASE)
    with pytest.raises(ValueError, match=r"sliding_layers is \(True,\); it needs a bool per layer, "
                                         r"num_hidden_layers=4"):
        cfg.__class__(**{**cfg.__dict__, "sliding_window": 8, "sliding_layers": (True,)})
    with pytest.raises(ValueError, match=r"sliding_layers name the layers that attend over sliding_window, which is "
                                         r"None"):
        cfg.__class__(**{**cfg.__dict__, "sliding_layers": (True,) * 4})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_sliding_layers_on_the_gpu_equal_the_cpu_engine(qwen2, max_num_seqs):
    """The Triton prefill, decode-rows and one-kernel decode kernels with a window, under CUDA graphs, at one and
    at eight sequences of 200 prompt tokens (the window's first position past the kernels' first tiles): the CPU
    engine's greedy tokens, logprobs within float32 kernel rounding."""
    prompt = [(13 * i + 7) % 128 for i in range(200)]
    llm = LLM(qwen2, device="cpu", dtype="float32", max_num_batched_tokens=64)
    tokens, logprobs = sequence_logprobs(llm.generate([prompt], PARAMS)[0], prompt)
    assert_gpu_equals_cpu_engine(qwen2, prompt, PARAMS, tokens, logprobs, max_num_seqs, max_num_batched_tokens=64)
