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
    for name in ("rms_norm", "silu_and_mul", "qk_norm_rope_store", "attend", "single_token_linear",
                 "decode_attention"):
        method = getattr(backend, name)
        setattr(backend, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    llm.engine.runner.model.use_backend(backend)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert set(calls) == {"rms_norm", "silu_and_mul", "qk_norm_rope_store", "attend", "single_token_linear",
                          "decode_attention"}
