"""The CUDA path end to end (run on the GPU machine: `pytest -m gpu`): decode CUDA graphs with padded
batches, host/device overlap and the Triton kernels must give the same greedy tokens as eager mode and
as the CPU float32 engine's batch-independent results."""
from __future__ import annotations

import random

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    out = []
    for i in range(23):                      # 23: graph buckets of 24 and 32 get padding rows
        body = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 90))]
        out.append(shared + body if i % 4 == 0 else body)
    return out


def _params(prompts):
    # different lengths, so requests leave the batch at different steps and the batch shrinks
    return [SamplingParams(temperature=0, max_tokens=4 + (i * 7) % 29, ignore_eos=True)
            for i in range(len(prompts))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_and_overlap_match_eager(qwen3_dir, prompts):
    common = dict(device="cuda", dtype="float32", block_size=16, max_num_seqs=32,
                  max_num_batched_tokens=256, gpu_memory_utilization=0.3)
    eager = LLM(qwen3_dir, enforce_eager=True, **common)
    eager.engine.overlap = False
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, _params(prompts))]
    del eager
    fast = LLM(qwen3_dir, **common)
    assert fast.engine.runner.graphs, "decode CUDA graphs were not captured"
    # the graphs' inputs and tokens go through pinned memory by kernels (staging.py); the second half
    # runs the copy-engine path for comparison
    assert fast.engine.runner.graph_runner.mapped
    for mapped in (True, True, False):        # the second round hits the prefix cache
        fast.engine.runner.graph_runner.mapped = mapped
        got = [o.outputs[0].token_ids for o in fast.generate(prompts, _params(prompts))]
        assert got == expected
    stats = fast.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["prefix_cache_hits"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_cpu_float32(qwen3_dir, prompts):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cpu = LLM(qwen3_dir, device="cpu", dtype="float32")
    expected = [o.outputs[0].token_ids for o in cpu.generate(prompts[:8], params)]
    gpu = LLM(qwen3_dir, device="cuda", dtype="float32", max_num_seqs=16, gpu_memory_utilization=0.3)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts[:8], params)] == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_single_request_decode_kernels_match_cpu_float32(qwen3_dir, prompts, monkeypatch):
    """One request at a time: every decode step is a one-token CUDA graph through the fused
    single-token layer (kernels/gemv.py) with programmatic dependent launch."""
    from tokenmill.layers.backend import TritonBackend
    used = []
    original = TritonBackend.single_token_linear
    monkeypatch.setattr(TritonBackend, "single_token_linear",
                        lambda self, h: used.append(original(self, h)) or used[-1])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cpu = LLM(qwen3_dir, device="cpu", dtype="float32")
    expected = [o.outputs[0].token_ids for o in cpu.generate(prompts[:6], params)]
    gpu = LLM(qwen3_dir, device="cuda", dtype="float32", max_num_seqs=1, gpu_memory_utilization=0.3)
    assert ("decode", 1) in gpu.engine.runner.graphs
    assert any(f is not None for f in used), "the single-token layer was not captured"
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts[:6], params)] == expected


def _compiled_variants() -> dict[str, int]:
    """Compiled variants of each of tokenmill's Triton kernels, over all devices."""
    import importlib
    import pkgutil

    import tokenmill.layers.kernels as kernels
    from triton.runtime.jit import JITFunction

    counts = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction):
                counts[f"{info.name}.{name}"] = sum(len(c[0]) for c in fn.device_caches.values())
    return counts


def _burst(num_prompts: int, total: int) -> list[list[int]]:
    """`num_prompts` new prompts of `total` tokens together (no two share a block)."""
    rng = random.Random(1)
    lens = [total // num_prompts + (i < total % num_prompts) for i in range(num_prompts)]
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lens]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8"])
def test_no_kernel_compiles_after_ready(qwen3_dir, prompts, quantized):
    # steps larger than any graph run eagerly, with block tables only as wide as their longest sequence:
    # everything they launch must have compiled while the engine was getting ready (graph capture and
    # its eager warm-up steps), not inside the first large batch of a run. With FP8 weights a first step
    # of 40 prompts, 3,001 tokens (above fp8_gemm.UNSCALED_NARROW_MAX_ROWS, not a multiple of 16), runs the
    # products scaled before the norms, at a row count unlike the memory profile's 4,096; the later steps of
    # 65-192 tokens, above the graphs' 64, the wide products (qkv, gate_up) before their scales
    from tokenmill.layers.kernels.fp8_gemm import UNSCALED_NARROW_MAX_ROWS
    args = dict(max_num_seqs=32, max_num_batched_tokens=512)
    if quantized:
        args = dict(max_num_seqs=40, max_num_batched_tokens=4096, quantization="fp8", kv_cache_dtype="fp8")
        prompts = _burst(40, 3001) + prompts
        assert UNSCALED_NARROW_MAX_ROWS < 3001 < 4096
    llm = LLM(qwen3_dir, device="cuda", dtype="bfloat16", cuda_graph_max_tokens=64, gpu_memory_utilization=0.3,
              **args)
    ready = _compiled_variants()
    assert sum(ready.values()) > 0
    runner, sizes = llm.engine.runner, []
    eager = runner._eager_forward
    runner._eager_forward = lambda inp, *rest: sizes.append(len(inp.input_ids)) or eager(inp, *rest)
    outs = llm.generate(prompts, _params(prompts))
    del runner._eager_forward           # the wrapper holds the runner: a cycle that would keep its memory
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(outs, _params(prompts)))
    assert sizes and (not quantized or sizes[0] == 3001), sizes
    after = _compiled_variants()
    grew = {k: (ready.get(k, 0), v) for k, v in after.items() if v != ready.get(k, 0)}
    assert not grew, f"kernels compiled after ready (before, after): {grew}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prompt_logprobs_of_a_long_prompt_match_cpu_float32(qwen3_long_dir):
    """A prompt of several chunks, each scored ROWS_AT_ONCE positions at a time on the GPU, against the
    CPU engine's values."""
    from tokenmill.runner import prompt_logprobs
    rng = random.Random(1)
    prompt = [rng.randrange(3, 400) for _ in range(1500)]
    assert len(prompt) > 2 * prompt_logprobs.ROWS_AT_ONCE
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    cpu = LLM(qwen3_long_dir, device="cpu", dtype="float32", max_num_batched_tokens=600)
    expected = cpu.generate([prompt], params)[0].prompt_logprobs
    del cpu
    gpu = LLM(qwen3_long_dir, device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=600,
              gpu_memory_utilization=0.3)
    got = gpu.generate([prompt], params)[0].prompt_logprobs
    assert got[0] is None and len(got) == len(expected) == len(prompt)
    for position, (g, e) in enumerate(zip(got[1:], expected[1:]), 1):
        token = prompt[position]
        assert g[token].logprob == pytest.approx(e[token].logprob, abs=2e-3), position
        assert len(g) >= 3
    stats = gpu.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_values_at_float32_edges_on_the_kernel(qwen3_dir, prompts):
    """The sampling kernel (`kernels/sampling.py`) with the values that rounded to 0 or inf in the step's
    float32 record (`sampling_rows`): a vanishing top_p keeps the top token (greedy's); huge and tiny
    repetition penalties and top_k past int32 sample."""
    # float32: bf16 logits tie often, and ties at top-p's cut-off stay together (the kernel's rule)
    llm = LLM(qwen3_dir, device="cuda", dtype="float32", max_num_seqs=16, gpu_memory_utilization=0.3)
    base = dict(max_tokens=8, ignore_eos=True)
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], SamplingParams(temperature=0, **base))]
    for top_p in (1e-320, 5e-324, 1e-40):
        got = llm.generate(prompts[:4], SamplingParams(temperature=1.0, top_p=top_p, seed=1, **base))
        assert [o.outputs[0].token_ids for o in got] == greedy, top_p
    for extra in (dict(repetition_penalty=1e308), dict(repetition_penalty=1e-308), dict(top_k=10**14)):
        got = llm.generate(prompts[:4], SamplingParams(temperature=1.0, seed=3, **base, **extra))
        assert all(len(o.outputs[0].token_ids) == 8 for o in got), extra
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_huge_temperature_keeps_to_the_grammar_on_the_kernel(qwen3_dir, prompts):
    """temperature 1e308 (inf in float32 made 0 * inf of the masked logits) samples under a grammar."""
    pytest.importorskip("xgrammar")
    from tokenmill.sampling_params import StructuredOutputsParams
    llm = LLM(qwen3_dir, device="cuda", dtype="float32", max_num_seqs=16, gpu_memory_utilization=0.3)
    out = llm.generate(prompts[0], SamplingParams(temperature=1e308, max_tokens=40, seed=2,
                                                  structured_outputs=StructuredOutputsParams(regex="[ab]{1,30}")))
    assert set(out[0].outputs[0].text) <= {"a", "b"} and out[0].outputs[0].text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_allowed_token_ids_and_bad_words_on_the_kernel(qwen3_dir, prompts):
    """allowed_token_ids (a mask on the device) and bad_words (a two-token word decided on the device while
    its first token is in flight, CUDA graphs and overlap on) on the sampling kernel, in bf16 logits."""
    llm = LLM(qwen3_dir, device="cuda", max_num_seqs=16, gpu_memory_utilization=0.3)
    allowed = [40, 41, 300]
    got = llm.generate(prompts[:4], SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True,
                                                   allowed_token_ids=allowed))
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in got)
    free = llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for o, prompt in zip(free, prompts[:4]):
        ids = o.outputs[0].token_ids
        word = ids[2:4]
        at = next(j for j in range(1, len(ids)) if ids[j - 1:j + 1] == word)
        banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                       bad_words=["w"], bad_words_token_ids=[word]))
        out = banned[0].outputs[0].token_ids
        assert out[:at] == ids[:at] and out[at] != ids[at]
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_engine_is_freed_at_its_last_reference(qwen3_dir, prompts):
    """A dead LLM's weights, KV cache and CUDA graphs go back to the allocator when its last reference goes,
    without a collection: the next LLM of the process profiles the GPU with that memory free."""
    import gc
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    llm = LLM(qwen3_dir, device="cuda", dtype="float32", max_num_seqs=16, gpu_memory_utilization=0.3)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert llm.engine.runner.graphs
    held = torch.cuda.memory_allocated() - before
    collecting = gc.isenabled()
    gc.disable()
    try:
        del llm
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - before
    finally:
        if collecting:
            gc.enable()
    assert held > 1 << 30 and left < held // 100, (held, left)
