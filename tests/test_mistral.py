"""Mistral (`MistralForCausalLM`): Llama's decoder with a sliding window over every layer (Mistral-7B-v0.1's
4,096; null in later releases): a query at position p attends to the positions p - window < j <= p alone, as
transformers' mask has it, at the model's whole context. Tiny random checkpoints saved by transformers (a window of
6 under prompts of 40 tokens) are served with its logprobs and greedy tokens: over a chunked prefill, over a
prefix-cache hit past the window, and (the window's checkpoint) against transformers without the window, which
computes other numbers."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig

from served_sequence import sequence_logprobs, transformers_logprobs

PROMPT = [(37 * i + 11) % 128 for i in range(40)]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0)
# transformers' eager attention, which applies the window by its mask (as sdpa does)
EAGER = dict(attn_implementation="eager")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """No window (Mistral-7B-v0.3's null), and a window of 6 over a context of 256."""
    root = tmp_path_factory.mktemp("mistral")
    paths = {}
    for name, window in (("none", None), ("window", 6)):
        paths[name] = str(root / name)
        torch.manual_seed(0)
        MistralForCausalLM(MistralConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, sliding_window=window, bos_token_id=None,
            eos_token_id=2, pad_token_id=0, initializer_range=0.2)).save_pretrained(paths[name])
    return paths


@pytest.mark.parametrize("name", ["none", "window"])
def test_mistral_equals_transformers(checkpoints, name):
    """Prompt logprobs over a prefill chunked by 16 tokens (a chunk's first queries see the last chunk's keys
    through the window), then greedy tokens and theirs: transformers' own, at the model's whole context."""
    path = checkpoints[name]
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=16)
    assert llm.engine.max_model_len == 256
    tokens, ours = sequence_logprobs(llm.generate([PROMPT], PARAMS)[0], PROMPT)
    want = transformers_logprobs(path, PROMPT, tokens, **EAGER)
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    if name == "window":
        # without its window, transformers computes other logprobs: the check above sees the window
        ids = torch.tensor([PROMPT + tokens])
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, sliding_window=None,
                                                          **EAGER).eval()(ids).logits[0]
        whole = logits.log_softmax(-1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
        assert (whole - want).abs().max() > 0.1


def test_a_prefix_cache_hit_past_the_window(checkpoints):
    """A prompt that shares the first's 32 tokens takes them from the prefix cache (blocks of 4, the blocks below
    the window kept): its own 10 tokens attend over cached keys within the window, and its greedy tokens and
    their logprobs are transformers'."""
    path = checkpoints["window"]
    llm = LLM(path, device="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    llm.generate([PROMPT], params)
    prompt = PROMPT[:32] + [5, 9, 77, 3, 100, 42, 8, 8, 19, 64]
    result = llm.generate([prompt], params)[0]
    assert result.num_cached_tokens == 32
    out = result.outputs[0]
    ours = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
    want = transformers_logprobs(path, prompt, list(out.token_ids), **EAGER)[len(prompt) - 1:]
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()


def test_the_window_is_read_over_every_layer():
    """A config.json without sliding_window takes transformers' MistralConfig default of 4,096 (and its context of
    131,072), over every layer, served at that whole context; layer_types, which transformers' Mistral does not
    read, changes nothing; null is no window."""
    hf = dict(architectures=["MistralForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4)
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.max_position_embeddings) == (4096, None, 131072)
    assert [cfg.window(i) for i in range(2)] == [4096, 4096]
    assert cfg.serving(131072).max_model_len == 131072
    mixed = ModelConfig.from_hf({**hf, "layer_types": ["full_attention", "sliding_attention"]})
    assert [mixed.window(i) for i in range(2)] == [4096, 4096]
    none = ModelConfig.from_hf({**hf, "sliding_window": None})
    assert none.sliding_window is None and [none.window(i) for i in range(2)] == [None, None]
