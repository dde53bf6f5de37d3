"""SmolLM3 (`SmolLM3ForCausalLM`): a Llama decoder whose NoPE layers (`no_rope_layers` 0) apply no RoPE to q
and k. A tiny random checkpoint saved by transformers, with NoPE layers where its default would not put them,
is served with transformers' logprobs and greedy tokens; served as plain Llama (every layer rotating) it is
not. The config's reading, its defaults and its refusals are checked on config.json dicts."""
from __future__ import annotations

import pytest
import torch
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.layers.rotary import NoRotaryEmbedding, RotaryEmbedding

from served_sequence import assert_gpu_equals_cpu_engine, sequence_logprobs, transformers_logprobs

NO_ROPE_LAYERS = [1, 0, 1, 0]          # transformers' default for 4 layers is [1, 1, 1, 0]
PROMPT = [(37 * i + 11) % 128 for i in range(100)]
# the prompt's logprobs over a prefill chunked by 32 tokens, then 20 greedy tokens with theirs
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0, prompt_logprobs=0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _served(model_dir: str, **engine_args):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=32, **engine_args)
    return (llm, *sequence_logprobs(llm.generate([PROMPT], PARAMS)[0], PROMPT))


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    """(checkpoint directory, the engine serving it, its greedy tokens, its logprobs)"""
    path = str(tmp_path_factory.mktemp("smollm3"))
    torch.manual_seed(0)
    SmolLM3ForCausalLM(SmolLM3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e4, no_rope_layers=NO_ROPE_LAYERS,
        bos_token_id=None, eos_token_id=2, pad_token_id=0,
        initializer_range=0.2)).save_pretrained(path)    # peaked attention: a wrong rotation shows
    return (path, *_served(path))


def test_smollm3_equals_transformers(smollm3):
    """Prompt logprobs over a chunked prefill, then greedy tokens and their logprobs past the prompt, as
    transformers computes them; the NoPE layers share one identity table beside the rotating layers' one."""
    path, llm, tokens, ours = smollm3
    want = transformers_logprobs(path, PROMPT, tokens)
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    model = llm.engine.runner.model
    assert model.config.rope_layers == (True, False, True, False)
    tables = [layer.self_attn.rotary for layer in model.model.layers]
    assert type(tables[0]) is RotaryEmbedding and tables[2] is tables[0]
    assert isinstance(tables[1], NoRotaryEmbedding) and tables[3] is tables[1]
    assert len({id(b) for b in model.buffers()}) == 2


def test_served_as_llama_the_nope_layers_would_rotate(smollm3):
    """The same checkpoint read as plain Llama (every layer rotating) gives other logprobs: the test above
    would see a NoPE layer that rotated."""
    path, _, tokens, ours = smollm3
    _, _, as_llama = _served(path, hf_overrides={"architectures": ["LlamaForCausalLM"]})
    assert (as_llama[:len(PROMPT) - 1] - ours[:len(PROMPT) - 1]).abs().max() > 0.1


def test_yarn_scales_the_rotating_layers_alone(smollm3):
    """YaRN (SmolLM3's long context), merged over the checkpoint's rope_parameters: the rotating layers read
    the scaled table, attention factor included, and the NoPE layers still rotate nothing, as in transformers;
    the prompt (100 tokens) passes the original context of 64."""
    path, _, _, plain = smollm3
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    _, tokens, ours = _served(path, hf_overrides={"rope_parameters": yarn})
    want = transformers_logprobs(path, PROMPT, tokens, rope_parameters={**yarn, "rope_theta": 1e4})
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    assert (ours[:len(PROMPT) - 1] - plain[:len(PROMPT) - 1]).abs().max() > 0.1


BASE = dict(architectures=["SmolLM3ForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=128,
            num_hidden_layers=6, num_attention_heads=4)


def test_config_reads_no_rope_layers_as_transformers_does():
    # without the list: every no_rope_layer_interval-th layer (4 by default); the list, where given, wins
    assert ModelConfig.from_hf(BASE).rope_layers == (True, True, True, False, True, True)
    assert ModelConfig.from_hf({**BASE, "no_rope_layer_interval": 2}).rope_layers == (True, False) * 3
    assert ModelConfig.from_hf({**BASE, "no_rope_layers": [0, 1, 1, 1, 1, 0, 1],
                                "no_rope_layer_interval": 2}).rope_layers == (False, True, True, True, True, False)
    # transformers' SmolLM3 defaults where config.json is silent, not Llama's
    cfg = ModelConfig.from_hf(BASE)
    assert (cfg.rope_theta, cfg.tie_word_embeddings, cfg.num_key_value_heads, cfg.max_position_embeddings) == (
        2e6, True, 4, 32768)
    # another architecture never reads the key
    assert ModelConfig.from_hf({**BASE, "architectures": ["LlamaForCausalLM"], "no_rope_layers": [0] * 6}
                               ).rope_layers is None
    # SmolLM3 slides only its NoPE layers (the 4th here), and only with a window and use_sliding_window; by
    # layer_types, its window whatever use_sliding_window says (transformers' mask)
    assert ModelConfig.from_hf({**BASE, "use_sliding_window": True, "sliding_window": None}).sliding_window is None
    assert ModelConfig.from_hf({**BASE, "sliding_window": 64}).sliding_window is None
    cfg = ModelConfig.from_hf({**BASE, "use_sliding_window": True, "sliding_window": 64})
    assert [cfg.window(i) for i in range(6)] == [None, None, None, 64, None, None]
    cfg = ModelConfig.from_hf({**BASE, "sliding_window": 64,
                               "layer_types": ["sliding_attention"] + ["full_attention"] * 5})
    assert [cfg.window(i) for i in range(6)] == [64, None, None, None, None, None]


@pytest.mark.parametrize("change,message", [
    ({"no_rope_layers": [1, 1, 0]}, r"no_rope_layers is \[1, 1, 0\] \(3 entries\); it must list 1 \(RoPE\) or 0 "
                                    r"\(no RoPE\) for each of the num_hidden_layers=6 layers"),
    ({"no_rope_layers": [1, 2, 1, 1, 1, 1]}, r"no_rope_layers is \[1, 2, 1, 1, 1, 1\] \(6 entries\)"),
    ({"no_rope_layers": "1110"}, r"no_rope_layers is '1110'"),
    ({"no_rope_layer_interval": 0}, r"no_rope_layer_interval is 0; it must be an integer >= 1"),
    ({"layer_types": ["sliding_attention"] * 6},
     r"layer_types marks layers \[0, 1, 2, 3, 4, 5\] \"sliding_attention\", but sliding_window is null"),
    ({"attention_bias": True}, r"SmolLM3ForCausalLM with attention_bias is not supported"),
    ({"mlp_bias": True}, r"SmolLM3ForCausalLM with mlp_bias is not supported"),
])
def test_config_refuses_what_is_not_served(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**BASE, **change})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_smollm3_on_the_gpu_equals_the_cpu_engine(smollm3, max_num_seqs):
    """The Triton prologue and one-kernel decode, under CUDA graphs, at one and at four sequences, read each
    layer's own table (the NoPE layers' identity one): the CPU engine's greedy tokens, logprobs within float32
    kernel rounding."""
    path, _, tokens, logprobs = smollm3
    assert_gpu_equals_cpu_engine(path, PROMPT, PARAMS, tokens, logprobs, max_num_seqs, max_num_batched_tokens=32)
