"""YaRN RoPE scaling, as Qwen3's model card turns it on for 131,072 tokens: the rope_scaling dict added to
config.json, or given as --hf-overrides over a checkpoint without it. Tiny models whose original context (64)
a 240-token prompt passes are served to their whole YaRN context (64 x 4) and compared with transformers on
the same checkpoint; a longer max_model_len is refused naming both numbers."""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tokenmill import LLM, SamplingParams, cli
from tokenmill.config import ModelConfig

from served_sequence import assert_gpu_equals_cpu_engine, sequence_logprobs

ORIGINAL, FACTOR, CONTEXT = 64, 4.0, 80          # max_position_embeddings past the original, as Qwen3's 40,960
YARN = {"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIGINAL}
PROMPT = [(37 * i + 11) % 128 for i in range(240)]
# the prompt's logprobs, then greedy tokens (with theirs) to the end of the context: positions 0..255
TO_THE_END = SamplingParams(temperature=0, max_tokens=int(ORIGINAL * FACTOR) - len(PROMPT), ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
ARCHS = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


def _checkpoint(directory, arch: str, rope_scaling: dict | None) -> str:
    """A tiny random model saved by transformers, its config.json written as Qwen3-4B's is (rope_theta at
    the top level, rope_scaling null unless given)."""
    config, model = ARCHS[arch]
    torch.manual_seed(0)
    model(config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=CONTEXT,
                 initializer_range=0.2)).save_pretrained(directory)     # peaked attention: a wrong rotation shows
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        hf = json.load(f)
    hf.pop("rope_parameters", None)
    hf.update(rope_theta=1e6, rope_scaling=rope_scaling)
    with open(path, "w") as f:
        json.dump(hf, f)
    return str(directory)


def _served(model_dir: str, **engine_args):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=64, **engine_args)  # chunked prefill
    assert llm.engine.max_model_len == ORIGINAL * FACTOR
    tokens, logprobs = sequence_logprobs(llm.generate([PROMPT], TO_THE_END)[0], PROMPT)
    assert len(PROMPT) + len(tokens) == ORIGINAL * FACTOR
    return tokens, logprobs


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(the checkpoint with the model card's rope_scaling, the same without it, the first one served)"""
    root = tmp_path_factory.mktemp("yarn")
    edited = _checkpoint(root / "yarn", "qwen3", dict(YARN))
    return edited, _checkpoint(root / "plain", "qwen3", None), _served(edited)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_yarn_equals_transformers_past_the_original_context(arch, qwen3, tmp_path):
    """Prompt logprobs over a chunked 240-token prefill, then greedy tokens and their logprobs to the last
    position of the 256-token YaRN context, as transformers computes them from the same config.json
    (attention factor included: it scales cos and sin); the unscaled model's differ."""
    model_dir = qwen3[0] if arch == "qwen3" else _checkpoint(tmp_path, arch, dict(YARN))
    tokens, ours = qwen3[2] if arch == "qwen3" else _served(model_dir)
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(ids).logits[0].log_softmax(-1)
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, rope_scaling={
            "rope_type": "default", "rope_theta": 1e6}).eval()(ids).logits[0].log_softmax(-1)
    assert ref[len(PROMPT) - 1:-1].argmax(-1).tolist() == tokens
    rows = torch.arange(ids.shape[1] - 1)
    want, unscaled = ref[rows, ids[0, 1:]], plain[rows, ids[0, 1:]]
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    assert (unscaled - want).abs().max() > 0.1


def test_hf_overrides_serves_yarn_as_the_edited_config(qwen3):
    """--hf-overrides with the model card's rope_scaling, over a checkpoint without it, serves what the
    config.json edited as the card says serves: the same tokens and logprobs, the same context."""
    args = cli.build_parser()[0].parse_args(["serve", qwen3[1], "--hf-overrides", json.dumps({"rope_scaling": YARN})])
    overrides = cli.engine_config(args).hf_overrides
    assert overrides == {"rope_scaling": YARN}
    tokens, logprobs = _served(qwen3[1], hf_overrides=overrides)
    assert tokens == qwen3[2][0] and torch.equal(logprobs, qwen3[2][1])


def test_a_max_model_len_past_the_yarn_context_is_refused(qwen3):
    with pytest.raises(ValueError, match=r"max_model_len=257 exceeds the model's YaRN context of 256 tokens \(rope_"
                                         r"scaling's original_max_position_embeddings=64 x factor=4.0; "
                                         r"max_position_embeddings=80\)"):
        LLM(qwen3[0], device="cpu", dtype="float32", max_model_len=257)
    # without YaRN, the model's own context bounds it
    with pytest.raises(ValueError, match=r"max_model_len=81 exceeds the model's max_position_embeddings=80"):
        LLM(qwen3[1], device="cpu", dtype="float32", max_model_len=81)


def test_hf_overrides_merge_objects_key_by_key(qwen3):
    """An object merges into the checkpoint's object under the same key (one number of it changed); any
    other value replaces; a GGUF model, which has no config.json, refuses them, as LLM() refuses vLLM's
    other form, a function of the config."""
    yarn = ModelConfig.from_hf(qwen3[0], {"rope_scaling": {"factor": 8.0}, "max_position_embeddings": 96})
    assert yarn.rope_scaling == {**YARN, "factor": 8.0} and yarn.derived_max_model_len == 512
    assert ModelConfig.from_hf(qwen3[0], {"rope_scaling": None}).rope_scaling is None
    # transformers' YaRN without a factor: max_position_embeddings over the original context
    assert ModelConfig.from_hf(qwen3[1], {"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 20}}
                               ).rope_scaling["factor"] == 4.0
    with pytest.raises(ValueError, match=r"hf_overrides edit a checkpoint's config\.json; the GGUF model "
                                         r"'m\.gguf' has none"):
        LLM("m.gguf", hf_overrides={"rope_scaling": YARN})
    with pytest.raises(ValueError, match=r"hf_overrides must be a dict merged over config\.json \(None: none\), "
                                         r"got function"):
        LLM(qwen3[1], hf_overrides=lambda config: config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_yarn_on_the_gpu_equals_the_cpu_engine(qwen3, max_num_seqs):
    """The Triton RoPE kernels (the prefill's q/k norm + RoPE + cache write, the one-kernel decode at one and
    at several sequences, under CUDA graphs) read the YaRN table with its attention factor as the CPU path
    does: the same greedy tokens to the end of the context, logprobs within float32 kernel rounding."""
    assert_gpu_equals_cpu_engine(qwen3[0], PROMPT, TO_THE_END, *qwen3[2], max_num_seqs, max_num_batched_tokens=64)
