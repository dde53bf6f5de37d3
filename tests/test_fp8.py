"""FP8 weights (`--quantization fp8`): Qwen's block-wise and compressed-tensors' per-channel checkpoints
written by our quantizer (`quant/fp8.py`) in their on-disk layouts, and plain checkpoints quantized at load.

- The formats are read exactly: an FP8 tiny model's logits equal those of the same model saved plain with
  the weights dequantized by this file's own reader (written from the format descriptions).
- Load-time quantization: 1 byte per weight, logits close to the unquantized model's.
- Errors: a mismatched --quantization, unsupported block sizes / bits / strategies / static activations,
  a GPU below sm89.
- The Triton kernels (few-row W8A8 product, per-token activation quantization) against torch references
  under the interpreter; on the GPU (`gpu`-marked) also the W8A8 `_scaled_mm` path and an FP8 model under
  CUDA graphs.
The real SmolLM2-135M weights in FP8: test_real_quantized.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.quant import fp8

from test_real_model import engine_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# hidden 192 (a partial 128-block along K of qkv/gate_up and along N of o_proj/down), q/k/v and gate/up
# shards of whole 128-row blocks, as Qwen's block-wise format needs
SHAPE = dict(hidden_size=192, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=64)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def e4m3_value(byte: int) -> float:
    """An E4M3 (fn) byte's value: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 subnormal."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


E4M3 = torch.tensor([e4m3_value(b) for b in range(256)], dtype=torch.float32)


def plain_dequant(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """W = value(byte) * the scale of its block (`block` None: one scale per row)."""
    n, k = weight.shape
    bn, bk = block or (1, k)
    values = E4M3[weight.view(torch.uint8).long()]
    rows, cols = torch.arange(n)[:, None] // bn, torch.arange(k)[None, :] // bk
    return values * scale[rows, cols]


def write_dequantized_twin(qdir: str, plain_dir: str) -> None:
    with open(os.path.join(qdir, "config.json")) as f:
        cfg = json.load(f)
    block = cfg["quantization_config"].get("weight_block_size")
    state = load_file(os.path.join(qdir, "model.safetensors"))
    plain = {}
    for key, t in state.items():
        if key.endswith((".weight_scale", ".weight_scale_inv")):
            continue
        scale = state.get(f"{key}_scale", state.get(f"{key}_scale_inv"))
        plain[key] = t if scale is None else plain_dequant(t, scale, block)
    os.makedirs(plain_dir)
    save_file(plain, os.path.join(plain_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(plain_dir, "config.json"), "w") as f:
        json.dump({k: v for k, v in cfg.items() if k != "quantization_config"}, f)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory, save_tiny_model):
    path = str(tmp_path_factory.mktemp("fp8") / "plain")
    save_tiny_model(path, "qwen3", **SHAPE)
    return path


def quantized_dir(plain_dir: str, fmt: str) -> str:
    out = os.path.join(os.path.dirname(plain_dir), fmt)
    if not os.path.isdir(out):
        with open(os.path.join(plain_dir, "config.json")) as f:
            cfg = json.load(f)
        fp8.write_checkpoint(out, load_file(os.path.join(plain_dir, "model.safetensors")), cfg, fmt)
    return out


IDS = [(7 * i + 3) % 500 for i in range(40)]
SMALL = dict(device="cpu", num_kv_blocks=8, max_num_batched_tokens=16)


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_tiny_checkpoint_reads_the_format_exactly(plain_dir, tmp_path, fmt):
    qdir = quantized_dir(plain_dir, fmt)
    state = load_file(os.path.join(qdir, "model.safetensors"))
    key = "model.layers.0.self_attn.o_proj.weight"                     # [192, 128]
    assert state[key].dtype == torch.float8_e4m3fn
    scale = state[key + ("_scale_inv" if fmt == "fp8" else "_scale")]
    assert tuple(scale.shape) == ((2, 1) if fmt == "fp8" else (192, 1)) and scale.dtype == torch.float32
    assert tuple(state["model.layers.0.mlp.gate_proj.weight_scale" + ("_inv" if fmt == "fp8" else "")].shape) \
        == ((2, 2) if fmt == "fp8" else (256, 1))                       # in 192: a partial block
    twin = str(tmp_path / "twin")
    write_dequantized_twin(qdir, twin)

    quantized = LLM(qdir, quantization="fp8", **SMALL)
    layer = quantized.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert type(layer).__name__ == "Fp8Linear" and layer.weight.dtype == torch.float8_e4m3fn
    assert layer.scale.dtype == torch.float32                          # whatever the model dtype
    ours = engine_logprobs(quantized, IDS)                             # chunked prefill, 16-token steps
    ref = engine_logprobs(LLM(twin, **SMALL), IDS)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)
    plain = engine_logprobs(LLM(plain_dir, **SMALL), IDS)
    assert (ours - plain).abs().max() > 1e-3                           # the FP8 rounding is there
    out = quantized.generate([IDS[:5]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


def test_plain_checkpoint_quantized_at_load(plain_dir):
    llm = LLM(plain_dir, quantization="fp8", **SMALL)
    model = llm.engine.runner.model
    down = model.model.layers[1].mlp.down_proj
    assert down.weight.dtype == torch.float8_e4m3fn and tuple(down.weight_scale.shape) == (192, 1)
    assert model.model.embed_tokens.weight.dtype == torch.float32       # the embedding (and tied head) kept
    linear_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith(".weight")
                       and any(s in n for s in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))
    linear_numel = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".weight")
                       and any(s in n for s in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))
    assert linear_bytes == linear_numel                                 # one byte per weight
    # the same quantization as the per-channel checkpoint writer's: equal logits
    ct = engine_logprobs(LLM(quantized_dir(plain_dir, "compressed-tensors"), **SMALL), IDS)
    ours = engine_logprobs(llm, IDS)
    torch.testing.assert_close(ours, ct, atol=2e-5, rtol=1e-5)
    ref = engine_logprobs(LLM(plain_dir, **SMALL), IDS)
    # close to the unquantized model: this random model (weights of std 0.15) amplifies rounding, measured
    # 0.16 mean / 1.0 largest log-prob difference; a scale misapplied anywhere gives differences of whole nats
    assert (ours - ref).abs().mean() < 0.3 and (ours - ref).abs().max() < 2.0


def test_quantizer_round_trip_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(200, 300)
    for block in (None, (128, 128)):
        q, s = fp8.quantize(w, block)
        back = fp8.dequantize(q, s, block or (1, 300))
        torch.testing.assert_close(back, plain_dequant(q, s, block), atol=0, rtol=0)
        # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 above the subnormals
        big = w.abs() > 2.0 ** -6 * s.max()
        assert ((back - w).abs()[big] <= w.abs()[big] * 2.0 ** -4 + 1e-7).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_quantizes_the_bytes_of_the_cpu():
    """Weights quantized at load on the GPU hold the bytes a checkpoint written on the CPU holds: the
    scales and the FP8 values bit for bit, per channel and block-wise, over weights whose row maxima take
    many exponents (a scale one rounding off flips the FP8 value of some weight at a tie)."""
    torch.manual_seed(0)
    w = torch.randn(4096, 512) * torch.logspace(-4, 1, 4096)[:, None]
    for block in (None, (128, 128)):
        cpu_q, cpu_s = fp8.quantize(w, block)
        gpu_q, gpu_s = (t.cpu() for t in fp8.quantize(w.cuda(), block))
        assert torch.equal(gpu_s, cpu_s), (gpu_s != cpu_s).sum()
        assert torch.equal(gpu_q.view(torch.uint8), cpu_q.view(torch.uint8)), (gpu_q != cpu_q).sum()


@pytest.fixture(scope="module")
def hf_base():
    return dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=4)


@pytest.mark.parametrize("qc,message", [
    (dict(fp8.quantization_config("fp8"), weight_block_size=[64, 64]),
     r"fp8 checkpoint with weight_block_size=\[64, 64\] is not supported; supported: \[128, 128\]"),
    (dict(fp8.quantization_config("fp8"), activation_scheme="static"),
     r"activation_scheme='static' is not supported; supported: dynamic"),
    (dict(fp8.quantization_config("fp8"), fmt="e5m2"), r"fmt='e5m2' is not supported; supported: e4m3"),
    ({**fp8.quantization_config("compressed-tensors"), "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
     r"strategy='block' are not supported; supported: num_bits=8 type='float' strategy='channel'"),
    ({**fp8.quantization_config("compressed-tensors"), "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     r"num_bits=4 type='int'"),
    ({**fp8.quantization_config("compressed-tensors"), "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
     r"input_activations with dynamic=false \(static scales, strategy='tensor'\) are not supported"),
    (dict(fp8.quantization_config("compressed-tensors"), ignore=["lm_head", "model.layers.0.mlp.down_proj"]),
     r"leaving \['model.layers.0.mlp.down_proj'\] unquantized is not supported"),
    (dict(quant_method="bitsandbytes"),
     r"quant_method 'bitsandbytes' is not supported; supported: awq, gptq, fp8, compressed-tensors"),
    # compressed-tensors' own default format: the weights stored unquantized
    ({k: v for k, v in fp8.quantization_config("compressed-tensors").items() if k != "format"},
     r"format='dense' is not supported; supported: float-quantized"),
    (dict(fp8.quantization_config("compressed-tensors"), kv_cache_scheme={"num_bits": 8, "type": "float"}),
     r"kv_cache_scheme=.* \(stored KV cache scales\) is not supported"),
])
def test_unsupported_fp8_configs_are_named(hf_base, qc, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(dict(hf_base, quantization_config=qc))


@pytest.mark.parametrize("qc", [
    dict(fp8.quantization_config("fp8"), modules_to_not_convert=["lm_head"]),
    dict(fp8.quantization_config("fp8"), ignored_layers=["lm_head"]),
    dict(fp8.quantization_config("compressed-tensors"), ignore=["re:.*lm_head"]),
    dict(quant_method="awq", bits=4, group_size=128, version="gemm", zero_point=True,
         modules_to_not_convert=["lm_head"]),
])
def test_a_checkpoint_that_leaves_only_the_head_unquantized_is_read(hf_base, qc):
    """The head stays in the model dtype whatever the checkpoint says, so a list of unquantized modules
    naming it alone (AutoAWQ's `modules_to_not_convert: ["lm_head"]`, an FP8 `ignored_layers`, a
    compressed-tensors `re:` pattern) is read; one naming a decoder layer is still refused."""
    assert ModelConfig.from_hf(dict(hf_base, quantization_config=qc)).quantization is not None
    with pytest.raises(ValueError, match="down_proj"):
        ModelConfig.from_hf(dict(hf_base, quantization_config=dict(qc, modules_to_not_convert=[
            "lm_head", "model.layers.0.mlp.down_proj"], ignore=["re:.*down_proj"])))


def test_config_reads_each_fp8_format(hf_base):
    block = ModelConfig.from_hf(dict(hf_base, quantization_config=fp8.quantization_config("fp8"))).quantization
    assert (block.method, block.weight_block_size, block.scale_name) == ("fp8", (128, 128), "weight_scale_inv")
    ct = ModelConfig.from_hf(dict(hf_base, quantization_config=fp8.quantization_config("compressed-tensors")))
    assert (ct.quantization.method, ct.quantization.weight_block_size, ct.quantization.scale_name) == \
        ("fp8", None, "weight_scale")
    assert EngineConfig(model="x", quantization="fp8").quantization == "fp8"


def test_a_quantized_tensor_of_another_dtype_is_refused(plain_dir, tmp_path):
    """An FP8 weight stored in bf16 was cast into the FP8 parameter and then scaled again (every layer's
    output ~1/1000 of its size): a quantized tensor is read as stored or not at all."""
    import shutil
    src = quantized_dir(plain_dir, "compressed-tensors")
    out = tmp_path / "bf16-weight"
    shutil.copytree(src, out)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    tensors[key] = tensors[key].to(torch.bfloat16)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with pytest.raises(ValueError, match=rf"'{key}' is torch.bfloat16, the model expects torch.float8_e4m3fn"):
        LLM(str(out), **SMALL)


def test_mismatched_quantization_is_refused(plain_dir):
    with pytest.raises(ValueError, match=r"--quantization awq does not match the checkpoint .*, which is fp8 "
                                         r"\(compressed-tensors\)"):
        LLM(quantized_dir(plain_dir, "compressed-tensors"), quantization="awq", **SMALL)
    with pytest.raises(ValueError, match=r"--quantization gptq does not match the checkpoint .*, which is fp8 "
                                         r"\(its quantization_config\)"):
        LLM(quantized_dir(plain_dir, "fp8"), quantization="gptq", **SMALL)
    with pytest.raises(ValueError, match=r"--quantization awq was asked for, but .* has no quantization_config"):
        LLM(plain_dir, quantization="awq", **SMALL)


def test_gpu_below_sm89_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8.9 \(sm89\) or newer; NVIDIA A100 is sm80"):
        fp8.check_device(torch.device("cuda"))
    fp8.check_device(torch.device("cpu"))


def test_cli_takes_fp8():
    from tokenmill import cli
    parser, _ = cli.build_parser()
    assert cli.engine_config(parser.parse_args(["serve", "m", "--quantization", "fp8"])).quantization == "fp8"
