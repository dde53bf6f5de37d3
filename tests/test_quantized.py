"""4-bit AWQ (GEMM) and GPTQ checkpoints, written by our quantizer (`quant/quantize.py`) in their on-disk
layouts and loaded through the real loader.

- The packing is read exactly: a quantized tiny model's logits equal those of the same model saved as a
  plain checkpoint with the weights dequantized by this file's own bit-by-bit reader (written from the
  layout description, not from `quant/w4.py`).
- Act-order GPTQ (`desc_act: true`, groups named by g_idx) is read exactly too, by the same comparison;
  a g_idx that is not a grouping, and the shards of one packed layer in different orders, are refused.
- Errors: a --quantization that does not match the checkpoint, unsupported bits / group sizes / AWQ
  versions.
- GPTQ (`quant/gptq.py`): its error compensation beats rounding on the same grid on a random layer.
The real SmolLM2-135M weights quantized by GPTQ: `lab/quant_quality.py checkpoints` (FP8 GPTQ: test_real_quantized.py).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.quant import fp8, w4
from tokenmill.quant.formats import QUANTIZED_LAYERS, W4Config
from tokenmill.quant.quantize import (pack_cols, quantize_awq, quantize_gptq, quantization_config,
                                      write_checkpoint)

from test_real_model import engine_logprobs, engine_logprobs_many

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# AutoAWQ GEMM: the 4-bit field i (bits 4i..4i+3) of a word holds output column 8j + AWQ_FIELD_COLUMN[i]
AWQ_FIELD_COLUMN = [0, 2, 4, 6, 1, 3, 5, 7]


def nibble(word: int, field: int) -> int:
    return (int(word) >> (4 * field)) & 0xF


def plain_dequant(tensors: dict[str, np.ndarray], method: str, group: int, in_features: int,
                  zero_offset: int) -> np.ndarray:
    """W [out, in] from one layer's packed tensors, one element at a time; a GPTQ layer's input row i is
    in group g_idx[i] where it has one (act-order), else i // group."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"].astype(np.float32)
    out_features = scales.shape[1]
    w = np.zeros((out_features, in_features), np.float32)
    for i in range(in_features):
        g = int(tensors["g_idx"][i]) if "g_idx" in tensors else i // group
        for o in range(out_features):
            if method == "awq":
                q = nibble(qweight[i, o // 8], AWQ_FIELD_COLUMN.index(o % 8))
                z = nibble(qzeros[g, o // 8], AWQ_FIELD_COLUMN.index(o % 8))
            else:        # GPTQ: input rows packed in order; zeros packed along output columns in order
                q = nibble(qweight[i // 8, o], i % 8)
                z = nibble(qzeros[g, o // 8], o % 8) + zero_offset
            w[o, i] = np.float32(q - z) * scales[g, o]
    return w


def test_known_words_unpack_in_each_order():
    word = torch.tensor([[0x76543210]], dtype=torch.int32)           # field i holds the value i
    assert w4.unpack_cols(word, awq_order=True).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert w4.AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)            # what the quantizer packs by
    assert w4.unpack_cols(word).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert w4.unpack_rows(word).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    high = torch.tensor([[0x87654321 - (1 << 32)]], dtype=torch.int32)     # the sign bit set
    assert w4.unpack_cols(high).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.mark.parametrize("method,kwargs", [("awq", {}), ("gptq", dict(sym=True)), ("gptq", dict(sym=False)),
                                           ("gptq", dict(sym=False, checkpoint_format="gptq_v2"))])
def test_quantizer_layout_and_error(method, kwargs):
    torch.manual_seed(0)
    out_f, in_f, group = 24, 96 if method == "awq" else 80, 32      # GPTQ: a partial last group
    w = torch.randn(out_f, in_f) * 0.05
    parts = quantize_awq(w, group) if method == "awq" else quantize_gptq(w, group, **kwargs)
    groups = -(-in_f // group)
    want = {"qweight": (in_f, out_f // 8) if method == "awq" else (in_f // 8, out_f),
            "qzeros": (groups, out_f // 8), "scales": (groups, out_f)}
    if method == "gptq":
        want["g_idx"] = (in_f,)
        assert parts["g_idx"].tolist() == [i // group for i in range(in_f)]
    assert {k: tuple(v.shape) for k, v in parts.items()} == want
    assert parts["qweight"].dtype == parts["qzeros"].dtype == torch.int32 and parts["scales"].dtype == torch.float16
    offset = 1 if method == "gptq" and kwargs.get("checkpoint_format", "gptq") == "gptq" else 0
    mine = plain_dequant({k: v.numpy() for k, v in parts.items()}, method, group, in_f, offset)
    cfg = W4Config(method, group, zero_offset=offset)
    ref = w4.dequantize(parts["qweight"], parts["qzeros"], parts["scales"], cfg, in_f)
    assert torch.equal(ref, torch.from_numpy(mine))
    # round to nearest: within half a step of the group's grid
    step = parts["scales"].float().repeat_interleave(group, 0)[:in_f].t()
    assert ((ref - w).abs() <= 0.5 * step * 1.01 + 1e-7).all()
    if kwargs.get("sym"):
        zeros = w4.unpack_cols(parts["qzeros"]) + offset
        assert (zeros == 8).all()                 # symmetric: zero 8, stored as 7 in the v1 format


def test_gptq_error_compensation_beats_rounding_on_its_own_grid():
    """On a layer whose inputs are correlated, GPTQ's compensated rounding leaves a smaller output error
    ||(W - Q) X^T|| than rounding each weight to nearest on the very same grid (its scales and zeros), and
    its grid packs into the GPTQ layout unchanged."""
    from tokenmill.quant.gptq import gptq_quantize
    from tokenmill.quant.w4 import dequantize_grid
    torch.manual_seed(0)
    out_f, in_f, group = 64, 200, 64                       # a partial last group
    x = torch.randn(1024, in_f) @ (torch.randn(in_f, in_f) / in_f ** 0.5) + 0.3 * torch.randn(1024, in_f)
    w = torch.randn(out_f, in_f) * 0.05
    q, zeros, scales = gptq_quantize(w, x.t() @ x, group, min_zero=1)
    rows = torch.arange(in_f) // group
    s, z = scales.float()[rows], zeros[rows]                                        # [in, out]
    nearest = (torch.round(w.t() / s) + z).clamp(0, 15).to(torch.int32)
    def output_error(grid):
        return (x @ (dequantize_grid(grid, group) - w).t()).square().mean().item()
    gptq, rtn = output_error((q, zeros, scales)), output_error((nearest, zeros, scales))
    print(f"output error: GPTQ {gptq:.3e}, nearest on the same grid {rtn:.3e}")
    assert gptq < 0.75 * rtn
    assert (q != nearest).any() and q.min() >= 0 and q.max() <= 15 and zeros.min() >= 1
    parts = quantize_gptq(w, group, sym=False, grid=(q, zeros, scales))
    packed = w4.dequantize(parts["qweight"], parts["qzeros"], parts["scales"], W4Config("gptq", group, zero_offset=1), in_f)
    assert torch.equal(packed, dequantize_grid((q, zeros, scales), group))


def test_gptq_clip_search_weighs_each_weight_by_its_inputs_energy():
    """`clipped_grid` picks each group's shrink by the rounding error weighted by `weight` (GPTQ: H's
    diagonal): where a few inputs carry most of the energy, the weighted search's grids leave less
    weighted error than the plain search's, and with equal weights both pick the same grids."""
    from tokenmill.quant.gptq import clipped_grid
    torch.manual_seed(0)
    wg = torch.randn(256, 4, 64) * 0.05
    energy = torch.ones(1, 4, 64)
    energy[..., :4] = 100.0

    def weighted_error(grid):
        s, z = (t[..., None] for t in grid)
        return ((torch.round(wg / s) + z).clamp(0, 15).sub(z).mul(s).sub(wg).square() * energy).sum().item()
    plain, weighted = clipped_grid(wg, False, 1), clipped_grid(wg, False, 1, weight=energy)
    assert weighted_error(weighted) < 0.9 * weighted_error(plain)
    same = clipped_grid(wg, False, 1, weight=torch.full((1, 4, 64), 3.0))
    assert all(torch.equal(a, b) for a, b in zip(same, plain))


def test_gptq_output_target_steps_towards_the_float_models_outputs():
    """Where a layer's inputs X differ from the float model's Xf (the layers before it quantized),
    `output_target` moves W towards the weight that maps X to Xf W^T, and the ridge holds the step: on
    inputs not seen in calibration, its weight and its GPTQ rounding are both nearer the float outputs than
    W and W's rounding are; the larger the ridge the nearer W it stays, and without a difference it is W."""
    from tokenmill.quant.gptq import gptq_quantize, output_target
    from tokenmill.quant.w4 import dequantize_grid
    torch.manual_seed(0)
    out_f, in_f, group = 64, 128, 64
    mix = torch.randn(in_f, in_f) / in_f ** 0.5
    drift = torch.eye(in_f) + 0.15 * torch.randn(in_f, in_f) / in_f ** 0.5    # what quantization upstream did

    def inputs(n):
        xf = torch.randn(n, in_f) @ mix + 0.3 * torch.randn(n, in_f)
        return xf @ drift, xf
    x, xf = inputs(4096)
    x_new, xf_new = inputs(4096)
    w = torch.randn(out_f, in_f) * 0.05
    h = x.t() @ x

    def error(v):
        return (x_new @ v.t() - xf_new @ w.t()).square().mean().item()
    targets = {r: output_target(w, h, x, xf, ridge=r) for r in (0.1, 1.0, 30.0)}
    errors = {r: error(t) for r, t in targets.items()}
    print(f"held-out output error: W {error(w):.3e}, targets by ridge {errors}")
    assert errors[0.1] < errors[1.0] < errors[30.0] < error(w)
    assert errors[0.1] < 0.2 * error(w)
    rounded_w, rounded_target = (dequantize_grid(gptq_quantize(v, h, group), group) for v in (w, targets[1.0]))
    assert error(rounded_target) < 0.5 * error(rounded_w)
    torch.testing.assert_close(output_target(w, xf.t() @ xf, xf, xf), w)


@pytest.mark.parametrize("n,k,m", [(128, 64, 256), (512, 256, 32)])
def test_gptq_output_target_in_either_order_is_the_ridge_regression(n, k, m):
    """`output_target` through [in, in] (a wide output: 128 x 64 inputs, 256 outputs) and through [n, out]
    (a wide input) equals W + ((X^T X + r I)^-1 X^T (Xf - X) W^T)^T computed directly in float64."""
    from tokenmill.quant.gptq import OUTPUT_TARGET_RIDGE, output_target
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g) * 0.05
    xf = x + 0.1 * torch.randn(n, k, generator=g)
    x64, xf64, w64 = x.double(), xf.double(), w.double()
    h64 = x64.t() @ x64
    a = h64 + (OUTPUT_TARGET_RIDGE * h64.diagonal().mean() + 1e-8) * torch.eye(k, dtype=torch.float64)
    expected = w64 + torch.linalg.solve(a, x64.t() @ (xf64 - x64) @ w64.t()).t()
    torch.testing.assert_close(output_target(w, x.t() @ x, x, xf).double(), expected, rtol=1e-4, atol=1e-6)


def test_gptq_triangular_inverse_by_uneven_halves():
    """The inverse of an upper triangular R that GPTQ's columns read, by halves down to 32-wide leaves:
    300 = 150 + 150, 150 = 75 + 75, 75 = 37 + 38."""
    from tokenmill.quant.gptq import upper_triangular_inverse
    b = torch.randn(300, 300, generator=torch.Generator().manual_seed(3))
    r = torch.linalg.cholesky(b @ b.t() + 300 * torch.eye(300)).t().contiguous()
    torch.testing.assert_close(upper_triangular_inverse(r, leaf=32) @ r, torch.eye(300), rtol=0, atol=1e-5)


def test_gptq_fp8_compensation_beats_rounding_to_nearest():
    """The same on the FP8 E4M3 grid: per-channel scales of `fp8.quantize` (the row's absmax / 448),
    compensated values with a smaller output error than `fp8.quantize`'s round to nearest."""
    from tokenmill.quant import fp8
    from tokenmill.quant.gptq import gptq_fp8_quantize
    torch.manual_seed(0)
    out_f, in_f = 64, 200
    x = torch.randn(1024, in_f) @ (torch.randn(in_f, in_f) / in_f ** 0.5) + 0.3 * torch.randn(1024, in_f)
    w = torch.randn(out_f, in_f) * 0.05
    q, scale = gptq_fp8_quantize(w, x.t() @ x)
    nearest, rtn_scale = fp8.quantize(w)
    assert q.dtype == fp8.FP8 and q.shape == w.shape and torch.equal(scale, rtn_scale)

    def output_error(q):
        return (x @ (fp8.dequantize(q, scale, (1, in_f)) - w).t()).square().mean().item()
    gptq, rtn = output_error(q), output_error(nearest)
    print(f"output error: GPTQ {gptq:.3e}, nearest {rtn:.3e}")
    assert gptq < 0.75 * rtn


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_scales_tuned_end_to_end_lower_the_divergence_they_are_trained_on(tmp_path, save_tiny_model, arch):
    """`scale_tuning.tune_scales` after GPTQ keeps every code and zero, moves the scales, and lowers the KL
    divergence of the quantized model's next-token distributions from the float model's on its
    calibration sequences, as the engine computes them from each checkpoint read back through the loader
    (so transformers' forward that trains them and the engine's agree on what a scale does; Qwen2: with
    its q/k/v biases, which the trained layers once left out, raising the divergence). Whether that
    carries to held-out text needs real weights and text: on random weights and random tokens it does
    not (SmolLM2-135M: docs/BENCHMARKS.md, "4-bit GPTQ with its group scales trained end to end")."""
    from tokenmill.quant.gptq import gptq_model
    from tokenmill.quant.quantize import min_zero
    from tokenmill.quant.scale_tuning import tune_scales
    from tokenmill.runner.loader import load_model
    src = str(tmp_path / "src")
    save_tiny_model(src, arch)                       # llama: hidden 80, group 32 leaves a partial last group
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    state = load_file(os.path.join(src, "model.safetensors"))
    calibration = torch.randint(3, 512, (16, 48), generator=torch.Generator().manual_seed(0))
    model = load_model(src, ModelConfig.from_hf(cfg), torch.device("cpu"), torch.float32)
    grids = gptq_model(model, calibration, 32, sym=False, min_zero=min_zero("gptq"))
    tuned = tune_scales(state, cfg, grids, calibration, 32, steps=40, lr=5e-3, batch=4)
    assert tuned.keys() == grids.keys()
    for key, (q, z, s) in grids.items():
        assert torch.equal(tuned[key][0], q) and torch.equal(tuned[key][1], z)
        assert tuned[key][2].dtype == s.dtype and tuned[key][2].shape == s.shape
    assert sum((tuned[k][2] != grids[k][2]).float().mean().item() for k in grids) / len(grids) > 0.5

    texts = calibration[:6].tolist()
    float_lp = engine_logprobs_many(LLM(src, device="cpu", num_kv_blocks=64), texts)
    divergence = {}
    for name, g in (("gptq", grids), ("tuned", tuned)):
        qdir = str(tmp_path / name)
        write_checkpoint(qdir, state, cfg, "gptq", 32, sym=False, grids=g)
        lps = engine_logprobs_many(LLM(qdir, device="cpu", num_kv_blocks=64), texts)
        divergence[name] = sum((f.exp() * (f - q)).sum(-1).mean().item() for f, q in zip(float_lp, lps)) / len(lps)
    print(f"KL divergence from the float model on calibration sequences: {divergence}")
    assert divergence["tuned"] < 0.85 * divergence["gptq"]


def write_dequantized_twin(qdir: str, plain_dir: str, cfg: dict) -> None:
    """The quantized checkpoint at `qdir` as a plain one: each quantized layer's weight read back by
    `plain_dequant`, the rest copied."""
    state = load_file(os.path.join(qdir, "model.safetensors"))
    qcfg = cfg["quantization_config"]
    offset = 1 if qcfg["quant_method"] == "gptq" and qcfg["checkpoint_format"] == "gptq" else 0
    plain = {}
    for key in state:
        prefix, _, leaf = key.rpartition(".")
        if prefix.rpartition(".")[2] in QUANTIZED_LAYERS and leaf in ("qweight", "qzeros", "scales", "g_idx"):
            if leaf == "qweight":
                parts = {n: state[f"{prefix}.{n}"].numpy() for n in ("qweight", "qzeros", "scales", "g_idx")
                         if f"{prefix}.{n}" in state}
                in_f = parts["qweight"].shape[0] * (1 if qcfg["quant_method"] == "awq" else 8)
                plain[f"{prefix}.weight"] = torch.from_numpy(
                    plain_dequant(parts, qcfg["quant_method"], qcfg["group_size"], in_f, offset))
        else:
            plain[key] = state[key]
    os.makedirs(plain_dir, exist_ok=True)
    save_file(plain, os.path.join(plain_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(plain_dir, "config.json"), "w") as f:
        json.dump({k: v for k, v in cfg.items() if k != "quantization_config"}, f)


TINY = [   # arch, method, group, model overrides, quantizer options
    ("llama", "awq", 32, dict(hidden_size=64, num_attention_heads=8, head_dim=8), {}),
    ("llama", "gptq", 32, {}, dict(sym=True)),                 # hidden 80: a partial last group
    ("llama", "gptq", 32, {}, dict(sym=False, desc_act=True)), # act-order groups, a partial last one
    ("qwen2", "gptq", 64, {}, dict(sym=False)),                # q/k/v biases beside packed 4-bit shards
    ("qwen3", "awq", 128, dict(hidden_size=128, intermediate_size=256, head_dim=32), {}),
    ("qwen3", "gptq", 128, dict(hidden_size=128, intermediate_size=256, head_dim=32),
     dict(sym=False, checkpoint_format="gptq_v2")),
]


@pytest.mark.parametrize("arch,method,group,overrides,options", TINY,
                         ids=[f"{a}-{m}-g{g}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                              for a, m, g, _, o in TINY])
def test_tiny_model_reads_the_format_exactly(tmp_path, save_tiny_model, arch, method, group, overrides, options):
    src, qdir, twin = (str(tmp_path / n) for n in ("src", "q", "twin"))
    save_tiny_model(src, arch, **overrides)
    with open(os.path.join(src, "config.json")) as f:
        hf_cfg = json.load(f)
    write_checkpoint(qdir, load_file(os.path.join(src, "model.safetensors")), hf_cfg, method, group, **options)
    with open(os.path.join(qdir, "config.json")) as f:
        write_dequantized_twin(qdir, twin, json.load(f))

    ids = [(7 * i + 3) % 500 for i in range(40)]
    quantized = LLM(qdir, device="cpu", num_kv_blocks=8, max_num_batched_tokens=16, quantization=method)
    model = quantized.engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert type(qkv).__name__ == "W4Linear" and qkv.qweight.dtype == torch.int32
    assert qkv.scales.dtype == torch.float16             # as stored, whatever the model dtype
    assert (qkv.input_perm is not None) == options.get("desc_act", False)
    float_params = {n for n, p in model.named_parameters() if p.is_floating_point() and p.dim() == 2}
    assert all(n.endswith(".scales") or "embed_tokens" in n or "lm_head" in n for n in float_params)
    ours = engine_logprobs(quantized, ids)           # chunked prefill over 16-token steps
    ref = engine_logprobs(LLM(twin, device="cpu", num_kv_blocks=8, max_num_batched_tokens=16), ids)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)
    greedy = quantized.generate([ids[:5]], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert len(greedy.token_ids) == 6                    # decode steps run through the same layers


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory, save_tiny_model):
    path = str(tmp_path_factory.mktemp("awq"))
    src = os.path.join(path, "src")
    save_tiny_model(src, "qwen3", hidden_size=64)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    write_checkpoint(os.path.join(path, "q"), load_file(os.path.join(src, "model.safetensors")), cfg, "awq", 32)
    return path


def test_requested_quantization_must_match_the_checkpoint(awq_dir):
    with pytest.raises(ValueError, match=r"--quantization gptq does not match the checkpoint .*, which is awq"):
        LLM(os.path.join(awq_dir, "q"), device="cpu", num_kv_blocks=8, quantization="gptq")
    with pytest.raises(ValueError, match=r"--quantization awq was asked for, but the checkpoint .* has no "
                                         r"quantization_config"):
        LLM(os.path.join(awq_dir, "src"), device="cpu", num_kv_blocks=8, quantization="awq")
    with pytest.raises(ValueError, match=r"quantization 'int8' is not supported; supported: awq, gptq, fp8"):
        EngineConfig(model="x", quantization="int8")
    # vLLM's Marlin names of the 4-bit formats are those formats: awq_marlin reads an AWQ checkpoint, and
    # gptq_marlin on it is refused naming both
    from tokenmill.config import ModelConfig
    from tokenmill.runner.loader import check_quantization
    q = os.path.join(awq_dir, "q")
    check_quantization("awq_marlin", ModelConfig.from_hf(q), q)
    with pytest.raises(ValueError, match=r"--quantization gptq_marlin does not match the checkpoint .*, which is awq"):
        check_quantization("gptq_marlin", ModelConfig.from_hf(q), q)


def test_quantization_on_a_gguf_file_is_refused_but_fp8(tmp_path):
    """A GGUF file's own types are dequantized as read; fp8 is the one quantization it takes at load
    (test_gguf_fp8.py), any other is refused naming it."""
    from tokenmill.runner.loader import check_quantization
    path = tmp_path / "m.gguf"
    path.write_bytes(b"")
    for method in ("awq", "gptq", "awq_marlin"):
        with pytest.raises(ValueError, match=rf"--quantization {method} cannot apply to .*m\.gguf', a GGUF file: .* "
                                             r"fp8 is the one quantization a GGUF file can be quantized to at load"):
            check_quantization(method, None, str(path))
    check_quantization("fp8", None, str(path))


def test_cli_flag_reaches_the_engine_config():
    from tokenmill import cli
    parser, _ = cli.build_parser()
    assert cli.engine_config(parser.parse_args(["serve", "m", "--quantization", "gptq"])).quantization == "gptq"
    assert cli.engine_config(parser.parse_args(["serve", "m", "--quantization", "awq_marlin"])).quantization \
        == "awq_marlin"
    assert cli.engine_config(parser.parse_args(["serve", "m"])).quantization is None


BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4}


@pytest.mark.parametrize("qc,message", [
    (dict(quant_method="awq", bits=8, group_size=128, version="gemm"),
     r"awq checkpoint with bits=8 is not supported; supported: 4"),
    (dict(quant_method="gptq", bits=4, group_size=256, desc_act=False),
     r"gptq checkpoint with group_size=256 is not supported; supported: 32, 64, 128"),
    (dict(quant_method="gptq", bits=4, group_size=-1, desc_act=False),
     r"group_size=-1 is not supported"),
    (dict(quant_method="awq", bits=4, group_size=128, version="gemv"),
     r"awq checkpoint with version='gemv' is not supported; supported: gemm"),
    (dict(quant_method="awq", bits=4, group_size=128, version="gemm", zero_point=False),
     r"zero_point=false is not supported"),
    (dict(quant_method="gptq", bits=4, group_size=128, checkpoint_format="marlin"),
     r"checkpoint_format='marlin' is not supported; supported: gptq, gptq_v2"),
    (dict(quant_method="gptq", bits=4, group_size=128, pack_dtype="int8"),
     r"pack_dtype='int8' is not supported; supported: int32"),
    (dict(quant_method="bitsandbytes", bits=4),
     r"quant_method 'bitsandbytes' is not supported; supported: awq, gptq, fp8"),
    (dict(quant_method="gptq", bits=4, group_size=128, dynamic={"-:.*layers\\.1\\..*": {}}),
     r"gptq checkpoint with dynamic=.* \(per-module overrides\) is not supported"),
    # these passed the checks (4.0 == 4) or failed in them with a TypeError, and then in the layers
    (dict(quant_method="awq", bits=4.0, group_size=128, version="gemm"), r"awq checkpoint with bits=4.0 is not supported"),
    (dict(quant_method="gptq", bits=4, group_size=128.0), r"gptq checkpoint with group_size=128.0 is not supported"),
    (dict(quant_method="fp8", weight_block_size=128), r"fp8 checkpoint with weight_block_size=128 is not supported"),
    (dict(quant_method="fp8", weight_block_size=[128.0, 128.0]), r"weight_block_size=\[128.0, 128.0\] is not supported"),
    (dict(quant_method="compressed-tensors", format="float-quantized", config_groups={"g": ["Linear"]}),
     r"compressed-tensors group 'g' must be a JSON object, got \['Linear'\]"),
    (dict(quant_method="compressed-tensors", format="float-quantized", config_groups={"g": {
        "targets": ["Linear"], "weights": 8}}), r"compressed-tensors weights must be a JSON object, got 8"),
])
def test_unsupported_quantization_configs_are_named(qc, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(dict(BASE, quantization_config=qc))
    with pytest.raises(ValueError, match="quantization_config must be a JSON object, got 'fp8'"):
        ModelConfig.from_hf(dict(BASE, quantization_config="fp8"))


def test_config_reads_each_format():
    awq = ModelConfig.from_hf(dict(BASE, quantization_config=quantization_config("awq", 128))).quantization
    assert (awq.method, awq.group_size, awq.zero_offset) == ("awq", 128, 0)
    v1 = ModelConfig.from_hf(dict(BASE, quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True})).quantization
    assert (v1.method, v1.group_size, v1.sym, v1.zero_offset) == ("gptq", 64, True, 1)   # v1 unless told
    assert ModelConfig.from_hf(BASE).quantization is None


def test_a_g_idx_that_is_not_a_grouping_or_differs_between_shards_is_refused(tmp_path, save_tiny_model):
    """Act-order permutes which input rows a group holds, never how many: a g_idx that gives a group
    more rows than group_size is refused, and so are q/k/v shards in different orders (they read one
    input, which a layer permutes once)."""
    src, qdir = str(tmp_path / "src"), str(tmp_path / "q")
    save_tiny_model(src, "qwen3", hidden_size=64)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    write_checkpoint(qdir, load_file(os.path.join(src, "model.safetensors")), cfg, "gptq", 32, desc_act=True)
    path = os.path.join(qdir, "model.safetensors")
    original = load_file(path)
    key = "model.layers.0.mlp.down_proj.g_idx"
    in_f = original[key].numel()
    for change, message in (
            ({key: torch.zeros(in_f, dtype=torch.int32)},
             rf"'{key}' does not put group_size=32 of the {in_f} input rows in each of groups 0-{in_f // 32 - 1}"),
            ({"model.layers.0.self_attn.q_proj.g_idx": original["model.layers.0.self_attn.q_proj.g_idx"].flip(0)},
             r"'model.layers.0.self_attn.k_proj.g_idx' and 'model.layers.0.self_attn.q_proj.g_idx' order the "
             r"input rows of 'model.layers.0.self_attn.qkv_proj' differently")):
        save_file({**original, **{k: v.contiguous() for k, v in change.items()}}, path)
        with pytest.raises(ValueError, match=message):
            LLM(qdir, device="cpu", num_kv_blocks=8)
    # desc_act=true without a layer's g_idx: its rows would be read in the plain order, every output wrong
    save_file({k: v for k, v in original.items() if k != "model.layers.0.self_attn.v_proj.g_idx"}, path)
    with pytest.raises(ValueError, match=r"desc_act=true but not every g_idx of 'model.layers.0.self_attn.qkv_proj'"):
        LLM(qdir, device="cpu", num_kv_blocks=8)


def test_an_already_quantized_checkpoint_is_not_quantized_again(tmp_path, save_tiny_model):
    """The writers take an unquantized checkpoint: an FP8 one written again as FP8 had its values rounded
    as if they were weights (a checkpoint that loaded, with other logits), a 4-bit one had its packed
    tensors copied under the new quantization_config. Refused by its config, or without one (AutoGPTQ's
    quantize_config.json beside it) by its tensors."""
    src = str(tmp_path / "src")
    save_tiny_model(src, "qwen3", hidden_size=64)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    state = load_file(os.path.join(src, "model.safetensors"))
    for method, write in (("compressed-tensors", lambda d, s, c: fp8.write_checkpoint(d, s, c, "compressed-tensors")),
                          ("gptq", lambda d, s, c: write_checkpoint(d, s, c, "gptq", 32))):
        qdir = str(tmp_path / method)
        write(qdir, state, cfg)
        with open(os.path.join(qdir, "config.json")) as f:
            qcfg = json.load(f)
        qstate = load_file(os.path.join(qdir, "model.safetensors"))
        plain_cfg = {k: v for k, v in qcfg.items() if k != "quantization_config"}
        for again in (lambda d, s, c: fp8.write_checkpoint(d, s, c, "compressed-tensors"),
                      lambda d, s, c: write_checkpoint(d, s, c, "awq", 32)):
            with pytest.raises(ValueError, match=rf"already quantized \(quantization_config quant_method='{method}'\)"):
                again(str(tmp_path / "again"), qstate, qcfg)
            with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.0.* is already quantized"):
                again(str(tmp_path / "again"), qstate, plain_cfg)
            assert not os.path.exists(tmp_path / "again")


def test_the_writers_refuse_fused_projections(tmp_path, save_tiny_model):
    """The writers quantize q/k/v_proj and gate/up_proj by name: a checkpoint that fuses them (Phi-3's qkv_proj
    and gate_up_proj) had them copied unquantized beside the quantized o_proj and down_proj."""
    src = str(tmp_path / "src")
    save_tiny_model(src, "qwen3", hidden_size=64)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    state = load_file(os.path.join(src, "model.safetensors"))
    p = "model.layers.0."
    state[p + "mlp.gate_up_proj.weight"] = torch.cat([state.pop(p + "mlp.gate_proj.weight"),
                                                      state.pop(p + "mlp.up_proj.weight")])
    for write in (lambda d: fp8.write_checkpoint(d, state, cfg, "compressed-tensors"),
                  lambda d: write_checkpoint(d, state, cfg, "awq", 32)):
        with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.0.mlp.gate_up_proj.weight' fuses "
                                             r"several projections .* split it into them first"):
            write(str(tmp_path / "out"))
        assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("write,message", [
    (lambda d, s, c: write_checkpoint(d, s, c, "gptq", 16), r"gptq checkpoint with group_size=16 is not supported"),
    (lambda d, s, c: write_checkpoint(d, s, c, "gptq", -1), r"gptq checkpoint with group_size=-1 is not supported"),
    (lambda d, s, c: write_checkpoint(d, s, c, "awq", 0), r"awq checkpoint with group_size=0 is not supported"),
    (lambda d, s, c: write_checkpoint(d, s, c, "gptq", 32, checkpoint_format="marlin"),
     r"checkpoint_format='marlin' is not supported; supported: gptq, gptq_v2"),
    (lambda d, s, c: write_checkpoint(d, s, c, "int4", 32), r"4-bit method 'int4' is not supported; supported: awq, gptq"),
    (lambda d, s, c: fp8.write_checkpoint(d, s, c, "e4m3"),
     r"FP8 checkpoint format 'e4m3' is not supported; supported: fp8, compressed-tensors"),
], ids=["group16", "group-1", "group0", "marlin", "int4", "fp8-e4m3"])
def test_writer_options_the_loader_refuses_are_refused_before_writing(tmp_path, write, message):
    """An option outside what the loader reads was written (group 16, a 'marlin' format: a checkpoint the
    loader then refused), crashed mid-way (group -1 or 0: a reshape error, a division by zero) or was
    written as another format (an unknown 4-bit method as GPTQ, an unknown FP8 format as
    compressed-tensors)."""
    state = {"model.layers.0.mlp.down_proj.weight": torch.randn(64, 128)}
    with pytest.raises(ValueError, match=message):
        write(str(tmp_path / "q"), state, dict(BASE))
    assert not os.path.exists(tmp_path / "q")


@pytest.mark.parametrize("method,overrides,key,shape", [
    ("gptq", dict(intermediate_size=100), "mlp.down_proj", (64, 100)),      # a partial word of input rows
    ("awq", dict(intermediate_size=100), "mlp.down_proj", (64, 100)),
    ("gptq", dict(head_dim=10), "self_attn.k_proj", (20, 64)),               # 2 KV heads of 10
])
def test_a_shape_the_4bit_layout_cannot_hold_is_refused_naming_it(tmp_path, save_tiny_model, method, overrides,
                                                                  key, shape):
    """A weight whose rows or columns are not whole words of 8 was a reshape error that named no layer,
    and left an empty output directory behind."""
    src, qdir = str(tmp_path / "src"), str(tmp_path / "q")
    save_tiny_model(src, "qwen3", num_hidden_layers=1, **overrides)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises(ValueError, match=rf"checkpoint tensor 'model.layers.0.{key}.weight' of shape "
                                         rf"\({shape[0]}, {shape[1]}\) cannot be written as {method}: out_features "
                                         rf"and in_features must be multiples of 8"):
        write_checkpoint(qdir, load_file(os.path.join(src, "model.safetensors")), cfg, method, 32)
    assert not os.path.exists(qdir)


def test_a_directory_holding_a_checkpoint_is_not_written_into(tmp_path):
    """Written into its sharded source's directory, the new model.safetensors went beside the index and
    shards, which the loader then read with the new quantization_config (a checkpoint that loaded neither
    way, the source's config replaced). A directory with only tokenizer files in it is written into."""
    import transformers
    src = str(tmp_path / "src")
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    transformers.Qwen3ForCausalLM(config).save_pretrained(src, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(src, "model.safetensors.index.json"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    state = {}
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(src, name)))
    for write in (lambda d: write_checkpoint(d, state, cfg, "gptq", 32),
                  lambda d: fp8.write_checkpoint(d, state, cfg, "compressed-tensors")):
        with pytest.raises(ValueError, match=r"'.*src' already holds a checkpoint \(config.json, model-00001-of-"):
            write(src)
    with open(os.path.join(src, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    assert not os.path.exists(os.path.join(src, "model.safetensors"))
    out = tmp_path / "q"
    out.mkdir()
    (out / "tokenizer_config.json").write_text("{}")
    write_checkpoint(str(out), state, cfg, "gptq", 32)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer_config.json"]


def test_a_calibrated_grid_must_fit_the_checkpoint_it_is_written_into(tmp_path):
    """A grid of groups of 32 written with group_size=64 was packed and read as the wrong groups (the
    loader then refused its qzeros' shape); an asymmetric grid written with the default sym=True got a
    config that told readers every zero is 8."""
    from tokenmill.quant.gptq import gptq_quantize
    key = "model.layers.0.mlp.down_proj.weight"
    w, x = torch.randn(64, 128) * 0.05, torch.randn(256, 128)
    asym = gptq_quantize(w, x.t() @ x, 32, sym=False, min_zero=1)
    state = {key: w}
    with pytest.raises(ValueError, match=rf"the grid of '{key}' \(q \(128, 64\), scales \(4, 64\)\) does not fit "
                                         r"its weight \(64, 128\) in groups of 64"):
        write_checkpoint(str(tmp_path / "a"), state, dict(BASE), "gptq", 64, sym=False, grids={key: asym})
    with pytest.raises(ValueError, match=rf"the grid of '{key}' has zeros other than 8"):
        write_checkpoint(str(tmp_path / "b"), state, dict(BASE), "gptq", 32, grids={key: asym})
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
    write_checkpoint(str(tmp_path / "c"), state, dict(BASE), "gptq", 32, sym=False, grids={key: asym})
    sym = gptq_quantize(w, x.t() @ x, 32, sym=True)
    write_checkpoint(str(tmp_path / "d"), state, dict(BASE), "gptq", 32, grids={key: sym})


@pytest.mark.parametrize("calibration,group,message", [
    (torch.zeros(0, 16, dtype=torch.long), 32, r"calibration of shape \(0, 16\) holds no tokens"),
    (torch.ones(16, dtype=torch.long), 32, r"an integer tensor of token ids \[num_seqs, seq_len\], got torch.int64 "
                                           r"of shape \(16,\)"),
    (torch.ones(2, 16), 32, r"an integer tensor .* got torch.float32 of shape \(2, 16\)"),
    (torch.full((2, 16), 600), 32, r"calibration token ids must be in \[0, 512\), got \[600, 600\]"),
    (torch.ones(1, 600, dtype=torch.long), 32, r"sequences of 600 tokens are longer than the model's "
                                               r"context, its max_position_embeddings=512"),
    (torch.ones(2, 16, dtype=torch.long), 48, r"group_size=48 is not supported; supported: 32, 64, 128"),
], ids=["empty", "1-d", "float", "out-of-vocab", "too-long", "group48"])
def test_calibration_the_quantizer_cannot_use_is_refused(tmp_path, save_tiny_model, calibration, group, message):
    """No tokens gave every linear an all-zero Hessian, whose inputs count as dead: every weight was
    quantized to zero, silently. The others were errors of torch's that named no option (an unpacking, an
    index out of range), or (group 48) a grid the writer refuses after the calibration's time was spent."""
    from tokenmill.quant.gptq import gptq_fp8_model, gptq_model
    from tokenmill.runner.loader import load_model
    src = str(tmp_path / "src")
    save_tiny_model(src, "qwen3", num_hidden_layers=1)
    with open(os.path.join(src, "config.json")) as f:
        cfg = ModelConfig.from_hf(json.load(f))
    with pytest.raises(ValueError, match=message):
        gptq_model(load_model(src, cfg, torch.device("cpu"), torch.float32), calibration, group, sym=False)
    if group == 32:
        with pytest.raises(ValueError, match=message):
            gptq_fp8_model(load_model(src, cfg, torch.device("cpu"), torch.float32), calibration)


def test_a_zero_the_format_cannot_store_is_refused_not_packed():
    """GPTQ v1 stores zeros minus one: a grid's zero of 0 became -1, which borrowed through its word (the
    column read back as zero 16, its neighbour's zero off by one)."""
    with pytest.raises(ValueError, match=r"values must be in \[0, 15\], got \[-1, 7\]"):
        pack_cols(torch.tensor([[0, 6, 7, 8, 7, 6, 5, 7]]) - 1)


def test_awq_needs_whole_groups(tmp_path, save_tiny_model):
    src = str(tmp_path / "src")
    save_tiny_model(src, "llama")                                 # hidden 80: not a multiple of 32
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(dict(cfg, quantization_config=quantization_config("awq", 32)), f)
    with pytest.raises(ValueError, match=r"an AWQ layer needs in_features \(80\) to be a multiple of group_size \(32\)"):
        LLM(src, device="cpu", num_kv_blocks=8)


def test_quantized_layers_on_the_graph_path_and_not_the_single_token_kernels(awq_dir):
    """The single-token kernels read plain and FP8 weight matrices, not 4-bit ones, so a 4-bit model never
    asks for them; its steps staged into the padded CUDA-graph buffers (replayed by re-running the forward
    on the CPU) give the eager tokens."""
    from tokenmill.layers.backend import TorchBackend

    class SingleTokenKernels(TorchBackend):
        def single_token_linear(self, input_ids):
            def fused_linear(*args, **kwargs):
                raise AssertionError("a 4-bit layer reached the single-token kernels")
            return fused_linear
    prompts = [[(5 * i + 7 * j) % 500 for j in range(n)] for i, n in enumerate([3, 20, 41, 9])]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    config = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)
    eager = LLM(os.path.join(awq_dir, "q"), **config)
    eager.engine.runner.model.use_backend(SingleTokenKernels())
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    graphs = LLM(os.path.join(awq_dir, "q"), **config)
    graphs.engine.runner.capture_graphs(emulate=True)
    used = []
    replay = graphs.engine.runner.graph_runner.replay
    graphs.engine.runner.graph_runner.replay = lambda key, inp, prev: used.append(key) or replay(key, inp, prev)
    assert [o.outputs[0].token_ids for o in graphs.generate(prompts, params)] == expected
    assert {k[0] for k in used} == {"decode", "mixed"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method,desc_act", [("awq", False), ("gptq", False), ("gptq", True)])
def test_gpu_4bit_model_under_cuda_graphs(tmp_path, save_tiny_model, method, desc_act):
    """A 4-bit checkpoint on the GPU through the Triton backend: prompts of 3-41 tokens beside decode rows
    (multi-row steps, where the norms and SiLU-and-mul feed the 4-bit products) and one-token steps, the
    greedy tokens through the graphs those of the eager steps, and the teacher-forced log-probs close to
    the CPU's dequantizing reference."""
    src, qdir = str(tmp_path / "src"), str(tmp_path / "q")
    save_tiny_model(src, "qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    write_checkpoint(qdir, load_file(os.path.join(src, "model.safetensors")), cfg, method, 128, desc_act=desc_act)
    prompts = [[(5 * i + 7 * j) % 500 for j in range(n)] for i, n in enumerate([3, 20, 41, 9])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    config = dict(max_num_seqs=4, num_kv_blocks=64, dtype="bfloat16")
    graphs = LLM(qdir, device="cuda", **config)
    assert graphs.engine.runner.graphs
    eager = LLM(qdir, device="cuda", enforce_eager=True, **config)
    assert [o.outputs[0].token_ids for o in graphs.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    ids = [(7 * i + 3) % 500 for i in range(40)]
    ours = engine_logprobs(eager, ids).float().cpu()
    ref = engine_logprobs(LLM(qdir, device="cpu", num_kv_blocks=8), ids)
    # the same 4-bit weights, bfloat16 activations against float32: a wrong scale or zero moves the
    # log-probs by whole nats
    assert (ours - ref).abs().mean() < 0.1
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_older_gptq_checkpoints_load(tmp_path, save_tiny_model):
    """GPTQ-for-LLaMa and older AutoGPTQ: a zero bias beside every quantized linear (skipped; a nonzero one
    is still a key the model lacks), and the quantization in quantize_config.json rather than config.json."""
    src, qdir = str(tmp_path / "src"), str(tmp_path / "q")
    save_tiny_model(src, "qwen3", hidden_size=64)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    write_checkpoint(qdir, load_file(os.path.join(src, "model.safetensors")), cfg, "gptq", 32)
    ids = [(7 * i + 3) % 500 for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = LLM(qdir, device="cpu", num_kv_blocks=8).generate([ids], greedy)[0].outputs[0].token_ids
    path = os.path.join(qdir, "model.safetensors")
    tensors = load_file(path)
    bias = "model.layers.0.mlp.down_proj.bias"
    save_file({**tensors, bias: torch.zeros(64)}, path)
    with open(os.path.join(qdir, "config.json")) as f:
        full = json.load(f)
    with open(os.path.join(qdir, "quantize_config.json"), "w") as f:
        json.dump(full.pop("quantization_config"), f)
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(full, f)
    assert LLM(qdir, device="cpu", num_kv_blocks=8).generate([ids], greedy)[0].outputs[0].token_ids == want
    save_file({**tensors, bias: torch.ones(64)}, path)
    with pytest.raises(ValueError, match=rf"checkpoint keys not used by .*'{bias}'"):
        LLM(qdir, device="cpu", num_kv_blocks=8)
