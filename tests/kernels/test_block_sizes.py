"""Every block size the block-size study measures (16, 32, 64, 128) through the engine: the attention
kernels that read the cache by block (prefill and one-kernel decode attention; Triton's interpreter on
the CPU) give the reference path's tokens, which do not depend on the block size; the KV cache holds
exactly the blocks the lengths need; a prefix longer than one block of 128 is found in the prefix cache.
On a GPU (gpu-marked) the whole engine, CUDA graphs included, gives block size 16's tokens at every size."""
from __future__ import annotations

from functools import partial

import pytest

from kernel_testing import HAS_CUDA
from tokenmill.layers.backend import TorchBackend, TritonBackend

BLOCK_SIZES = (16, 32, 64, 128)
# 150 tokens: across the first block boundary at every size; the second prompt shares the first's 130
PROMPT_A = [(7 * i + 3) % 300 + 5 for i in range(150)]
PROMPT_B = PROMPT_A[:130] + [11, 12, 13]
MAX_TOKENS = 2


class AttentionKernels(TritonBackend):
    """The Triton kernels that walk the paged cache through the block table, the rest on the reference
    (the prologue kernel stores at flat slots, block size unseen, and is tested in test_fused_ops). One
    split per decode program: the interpreter pays for every program, and the pages are walked alike."""
    rms_norm = TorchBackend.rms_norm
    act_and_mul = TorchBackend.act_and_mul
    qk_norm_rope_store = TorchBackend.qk_norm_rope_store
    single_token_linear = TorchBackend.single_token_linear
    greedy = TorchBackend.greedy

    def decode_attention(self, input_ids, meta):
        fused = super().decode_attention(input_ids, meta)
        return None if fused is None else partial(fused, num_splits=1)


def _run(model_dir, block_size, backend=None, device="cpu"):
    from tokenmill import LLM, SamplingParams
    llm = LLM(model_dir, device=device, dtype="float32", block_size=block_size, max_model_len=256,
              num_kv_blocks=-(-1024 // block_size), max_num_seqs=4, enforce_eager=device == "cpu")
    if backend is not None:
        llm.engine.runner.model.use_backend(backend)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([PROMPT_A, [12, 7, 9]], params, use_tqdm=False)
    stats = llm.engine.get_stats()
    second = llm.generate([PROMPT_B], params, use_tqdm=False)      # after A: its full blocks are cached
    tokens = [o.outputs[0].token_ids for o in first + second]
    return tokens, stats, llm.engine.get_stats()


@pytest.fixture(scope="module")
def one_layer_dir(save_tiny_model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-qwen3-one-layer"))
    save_tiny_model(path, "qwen3", num_hidden_layers=1)
    return path


@pytest.fixture(scope="module")
def reference_tokens(one_layer_dir):
    return _run(one_layer_dir, 16)[0]


@pytest.mark.skipif(HAS_CUDA, reason="the gpu test below runs the whole engine on the device")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_block_size_through_the_attention_kernels(one_layer_dir, reference_tokens, block_size):
    tokens, stats, after = _run(one_layer_dir, block_size, AttentionKernels())
    assert tokens == reference_tokens and len(tokens) == 3
    # both prompts' K/V (every token but the last sampled one) in ceil(L / block_size) blocks each
    lengths = (len(PROMPT_A) + MAX_TOKENS - 1, 3 + MAX_TOKENS - 1)
    assert stats["peak_blocks_used"] == sum(-(-n // block_size) for n in lengths)
    assert stats["num_total_blocks"] == -(-1024 // block_size)
    # B's first 130 tokens hold 130 // block_size full blocks of A, found in the cache
    assert after["prefix_cache_hits"] - stats["prefix_cache_hits"] == (130 // block_size) * block_size


@pytest.fixture(scope="module")
def gpu_reference_tokens(one_layer_dir):
    return _run(one_layer_dir, 16, device="cuda")[0]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_block_size_on_the_gpu(one_layer_dir, gpu_reference_tokens, block_size):
    """CUDA graphs and the compiled kernels: the tokens of block size 16 at every size, the blocks the
    lengths need, the prefix found."""
    tokens, stats, after = _run(one_layer_dir, block_size, device="cuda")
    assert tokens == gpu_reference_tokens
    lengths = (len(PROMPT_A) + MAX_TOKENS - 1, 3 + MAX_TOKENS - 1)
    assert stats["peak_blocks_used"] == sum(-(-n // block_size) for n in lengths)
    assert after["prefix_cache_hits"] - stats["prefix_cache_hits"] == (130 // block_size) * block_size
