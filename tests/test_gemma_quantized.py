"""Quantized Gemma 2 and Gemma 3 checkpoints (AWQ, GPTQ, FP8 per channel and in 128 x 128 blocks, FP8 at load):
each loads (every parameter filled, no key left over) and computes what the same quantized values, dequantized
into a plain checkpoint, compute when served: Gemma's norm offsets and embedding scale are folded into the norms
and the table alone, and the tied head stays the scaled table (the CUDA path's unscaled FP8 products, which layers
with post-norms do not hand to a norm, are not reached on the CPU). Tiny random
checkpoints saved by transformers (random norm weights, so that 1 + w is not 1; head_dim 64 with two KV heads, so
that k and v fall on whole 128-row FP8 blocks), served on the CPU, whose reference dequantizes each layer. A
multimodal checkpoint that leaves its vision tower unquantized, as llm-compressor writes it, serves its text."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3Config, Gemma3ForCausalLM, \
    Gemma3ForConditionalGeneration, Gemma3TextConfig

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.quant import fp8
from tokenmill.quant.quantize import write_checkpoint

from served_sequence import sequence_logprobs
from test_fp8 import write_dequantized_twin
from test_granite import _w4_twin

SHAPE = dict(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=256, query_pre_attn_scalar=24,
             sliding_window=16, bos_token_id=None, eos_token_id=2, pad_token_id=0)
GEMMA3 = dict(SHAPE, layer_types=["sliding_attention", "full_attention"], rope_theta=1e4, rope_local_base_freq=100.0)
GEMMA2 = dict(SHAPE, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
PROMPT = [(37 * i + 11) % 128 for i in range(40)]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _save(model: torch.nn.Module, path: str) -> str:
    """`model` with every RMSNorm weight drawn at random (transformers initialises them 0), saved to `path`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def _read(path: str) -> tuple[dict, dict]:
    with open(os.path.join(path, "config.json")) as f:
        return load_file(os.path.join(path, "model.safetensors")), json.load(f)


def _served(model_dir: str, **engine_args):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=16, **engine_args)
    return (llm, *sequence_logprobs(llm.generate([PROMPT], PARAMS)[0], PROMPT))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma_quantized")
    torch.manual_seed(0)
    return {"gemma3": _save(Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA3)), str(root / "gemma3")),
            "gemma2": _save(Gemma2ForCausalLM(Gemma2Config(**GEMMA2)), str(root / "gemma2"))}


def _write(fmt: str, plain_dir: str, qdir: str, twin: str) -> None:
    """`plain_dir` quantized as `fmt` into `qdir`, and its quantized values dequantized into `twin`."""
    state, hf = _read(plain_dir)
    if fmt in ("awq", "gptq"):
        write_checkpoint(qdir, state, hf, fmt, 32)
        _w4_twin(qdir, twin)
    else:       # FP8 at load quantizes per channel, as the compressed-tensors writer
        fp8.write_checkpoint(qdir, state, hf, "fp8" if fmt == "fp8" else "compressed-tensors")
        write_dequantized_twin(qdir, twin)


@pytest.mark.parametrize("model,fmt", [("gemma3", "awq"), ("gemma3", "gptq"), ("gemma3", "compressed-tensors"),
                                       ("gemma3", "fp8"), ("gemma3", "fp8 at load"), ("gemma2", "awq"),
                                       ("gemma2", "fp8")])
def test_quantized_gemma_equals_its_dequantized_twin(plain, tmp_path, model, fmt):
    """Greedy tokens and logprobs (a prefill chunked by 16, then 8 tokens) of the quantized checkpoint are those of
    its dequantized twin: the CPU reference computes each layer on the dequantized weight, so any difference is a
    fold or a load that treats the quantized tensors otherwise than the plain ones."""
    qdir, twin = str(tmp_path / "q"), str(tmp_path / "twin")
    _write(fmt, plain[model], qdir, twin)
    llm, tokens, ours = _served(plain[model], quantization="fp8") if fmt == "fp8 at load" else _served(qdir)
    decoder = llm.engine.runner.model
    assert type(decoder.model.layers[1].mlp.down_proj).__name__ == ("W4Linear" if fmt in ("awq", "gptq")
                                                                    else "Fp8Linear")
    assert decoder.lm_head.weight is decoder.model.embed_tokens.weight
    _, want_tokens, want = _served(twin)
    assert tokens == want_tokens
    assert torch.allclose(ours, want, atol=1e-5), (ours - want).abs().max()


def _vision_linears(model: torch.nn.Module) -> list[str]:
    """The vision tower's linear layers as llm-compressor lists them in `ignore`: as the transformers of the
    published Gemma 3 checkpoints named them (vision_tower.vision_model.*), or as the installed one does."""
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "vision_tower" in n]
    return [n.replace("model.vision_tower.", "vision_tower.vision_model.") for n in names], names


def test_multimodal_checkpoint_with_its_vision_tower_unquantized(tmp_path):
    """A Gemma3ForConditionalGeneration FP8 checkpoint whose vision tower stays unquantized, listed layer by layer
    in compressed-tensors' `ignore` with the head (as llm-compressor writes gemma-3-4b-it's), serves its language
    model as its dequantized twin does; that list in either naming, AutoAWQ's prefix form and a `re:` pattern of
    the tower are read as leaving no decoder layer unquantized, one naming a decoder layer is still refused."""
    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=GEMMA3, vision_config=vision,
                                                        mm_tokens_per_image=4, image_token_index=125,
                                                        boi_token_index=126, eoi_token_index=127))
    old_names, new_names = _vision_linears(model)
    state, hf = _read(_save(model, str(tmp_path / "plain")))
    tower = {k: t for k, t in state.items() if k.startswith("vision_tower.")}
    assert tower and any(k.endswith("q_proj.weight") for k in tower)
    qdir, twin = str(tmp_path / "q"), str(tmp_path / "twin")
    fp8.write_checkpoint(qdir, {k: t for k, t in state.items() if k not in tower}, hf, "compressed-tensors")
    with open(os.path.join(qdir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"]["ignore"] = ["language_model.lm_head", *old_names]
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({**load_file(os.path.join(qdir, "model.safetensors")), **tower}, os.path.join(qdir, "model.safetensors"),
              metadata={"format": "pt"})
    write_dequantized_twin(qdir, twin)
    _, tokens, ours = _served(qdir)
    _, want_tokens, want = _served(twin)
    assert tokens == want_tokens
    assert torch.allclose(ours, want, atol=1e-5), (ours - want).abs().max()

    ct = cfg["quantization_config"]
    awq = dict(quant_method="awq", bits=4, group_size=32, version="gemm", zero_point=True)
    for qc in (dict(ct, ignore=["lm_head", *new_names]), dict(ct, ignore=["re:.*lm_head", "re:vision_tower.*",
                                                                          "re:multi_modal_projector.*"]),
               dict(awq, modules_to_not_convert=["vision_tower", "multi_modal_projector"])):
        assert ModelConfig.from_hf(dict(hf, quantization_config=qc)).quantization is not None
    for qc in (dict(ct, ignore=[*old_names, "language_model.model.layers.0.mlp.down_proj"]),
               dict(ct, ignore=["re:.*vision_tower.*", "re:.*down_proj"])):
        with pytest.raises(ValueError, match="down_proj"):
            ModelConfig.from_hf(dict(hf, quantization_config=qc))
    # a text model has no vision tower to leave out: the same names there are not the head's
    text = dict(GEMMA3, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text")
    with pytest.raises(ValueError, match="vision_tower"):
        ModelConfig.from_hf(dict(text, quantization_config=dict(ct, ignore=["lm_head", "re:vision_tower.*"])))
