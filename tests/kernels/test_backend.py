"""The compute backend (`layers/backend.py`): chosen by device, and the Triton backend, every kernel of
it run by the interpreter on the CPU, gives the reference backend's tokens through the engine (batches of
two and of one, so decode, prefill and single-token steps all take its kernels)."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import HAS_CUDA
from tokenmill.layers.backend import TorchBackend, TritonBackend, make_backend
from tokenmill.layers.kernel_config import KernelConfig


def test_make_backend_picks_triton_on_cuda_only():
    kernels = KernelConfig()
    assert type(make_backend(torch.device("cpu"), kernels)) is TorchBackend
    cuda = make_backend(torch.device("cuda"), kernels)
    assert isinstance(cuda, TritonBackend) and cuda.kernels is kernels


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the engine runs the Triton backend anyway")
def test_triton_backend_gives_the_reference_tokens(qwen3_dir):
    from tokenmill import LLM, SamplingParams
    prompts = [[5, 9, 31, 7, 200, 3, 3, 41] * 2, [12, 7]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 3)]
    config = dict(device="cpu", dtype="float32", block_size=4)
    expected = [o.outputs[0].token_ids for o in LLM(qwen3_dir, **config).generate(prompts, params)]
    llm = LLM(qwen3_dir, **config)
    backend = TritonBackend()
    calls = []
    for name in ("rms_norm", "act_and_mul", "qk_norm_rope_store", "attend", "single_token_linear",
                 "decode_attention"):
        method = getattr(backend, name)
        setattr(backend, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    llm.engine.runner.model.use_backend(backend)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert set(calls) == {"rms_norm", "act_and_mul", "qk_norm_rope_store", "attend", "single_token_linear",
                          "decode_attention"}


def test_triton_norm_and_silu_quantize_only_for_fp8_products_that_take_quantized_rows():
    """The Triton backend's RMSNorm and SiLU-and-mul write FP8 rows (`Fp8Rows`) where the linear layer
    they feed is FP8 and every path of its product quantizes its input; for a plain layer, a 4-bit one
    (which has no `weight`) and an FP8 one whose dims are not multiples of 16 they write plain rows."""
    from tokenmill.layers.quantized import linear
    from tokenmill.quant.fp8 import Fp8Rows
    from tokenmill.quant.formats import Fp8Config, W4Config
    backend = TritonBackend()
    x = torch.randn(3, 128)
    w = torch.ones(128)
    gate_up = torch.randn(3, 256)
    layers = {"plain": linear(128, 64, False, None), "w4": linear(128, 64, False, W4Config("gptq", 128)),
              "fp8": linear(128, 64, False, Fp8Config()), "fp8, 56 rows": linear(128, 56, False, Fp8Config())}
    for name, layer in layers.items():
        quantized = name == "fp8"
        assert isinstance(backend.rms_norm(x, w, 1e-6, into=layer), Fp8Rows) == quantized, name
        out, _ = backend.rms_norm(x, w, 1e-6, residual=x, into=layer)
        assert isinstance(out, Fp8Rows) == quantized, name
        assert isinstance(backend.act_and_mul(gate_up, "silu", into=layer), Fp8Rows) == quantized, name
