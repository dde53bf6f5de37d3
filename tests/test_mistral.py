"""Mistral (`MistralForCausalLM`): Llama's decoder with a sliding window over every layer (Mistral-7B-v0.1's
4,096; null in later releases). tokenmill attends over the whole context, which is the window's attention up to
the window's length, so the window bounds the context served: the model's default is lowered to it, a longer
--max-model-len is refused. Tiny random checkpoints saved by transformers, served with its logprobs and greedy
tokens."""
from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig

from served_sequence import sequence_logprobs, transformers_logprobs

PROMPT = [(37 * i + 11) % 128 for i in range(40)]
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0, prompt_logprobs=0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """No window (Mistral-7B-v0.3's null), and a window of 64 over a context of 256 (v0.1's shape)."""
    root = tmp_path_factory.mktemp("mistral")
    paths = {}
    for name, window in (("none", None), ("window", 64)):
        paths[name] = str(root / name)
        torch.manual_seed(0)
        MistralForCausalLM(MistralConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, sliding_window=window, bos_token_id=None,
            eos_token_id=2, pad_token_id=0, initializer_range=0.2)).save_pretrained(paths[name])
    return paths


@pytest.mark.parametrize("name", ["none", "window"])
def test_mistral_equals_transformers(checkpoints, name, caplog):
    """Prompt logprobs over a chunked prefill, then greedy tokens: transformers' own. With a window of 64 the
    engine serves 64 tokens a request by default (and says so), within which the window attends to all."""
    path = checkpoints[name]
    with caplog.at_level("WARNING", logger="tokenmill"):
        llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=16)
    assert llm.engine.max_model_len == (256 if name == "none" else 64)
    assert ("sliding window of 64 positions" in caplog.text) == (name == "window")
    tokens, ours = sequence_logprobs(llm.generate([PROMPT], PARAMS)[0], PROMPT)
    want = transformers_logprobs(path, PROMPT, tokens)
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()


def test_a_context_past_the_window_is_refused_and_the_default_window_read():
    """--max-model-len past the window is refused naming both; a config.json without sliding_window takes
    transformers' MistralConfig default of 4,096 (and its context of 131,072)."""
    hf = dict(architectures=["MistralForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4)
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.sliding_window, cfg.max_position_embeddings) == (4096, 131072)
    with pytest.raises(ValueError, match=r"max_model_len=4097 is longer than the model's sliding_window=4096"):
        cfg.serving(4097)
    assert ModelConfig.from_hf({**hf, "sliding_window": None}).serving(131072).sliding_window is None
