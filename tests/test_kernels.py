"""Triton kernels against their plain-PyTorch references.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1) on small shapes; the
kernel modules are imported lazily, after the variable is set (see `_use_interpreter`). With a GPU the
same tests run compiled on it (half precision as bfloat16), and the `gpu`-marked tests add
realistic bfloat16 sizes.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"
# the interpreter keeps bfloat16 as raw uint16 (its tl.dot multiplies the bit patterns, its casts
# truncate), so the CPU runs cover the half-precision paths in float16
HALF = torch.bfloat16 if HAS_CUDA else torch.float16

from tokenmill.layers.activation import silu_and_mul_torch  # noqa: E402
from tokenmill.layers.attention import paged_attention_torch, store_kvcache_torch  # noqa: E402
from tokenmill.layers.attention_metadata import AttentionMetadata  # noqa: E402
from tokenmill.layers.kernel_config import (DecodeAttentionConfig, KernelConfig,  # noqa: E402
                                            PrefillAttentionConfig, RegisterTile, SmemTile, WholeRowTile)
from tokenmill.layers.norm import rms_norm_torch  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary_torch  # noqa: E402


def _fix_interpreter_scalars() -> None:
    """The interpreter holds scalars as 1-element arrays and turns them into loop bounds with int(),
    which NumPy >= 2.4 rejects for arrays with ndim > 0; index the single element instead."""
    from triton.runtime import interpreter
    original = interpreter._patch_lang_tensor
    if getattr(original, "scalar_index_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.scalar_index_fixed = True
    interpreter._patch_lang_tensor = patched


def _use_interpreter() -> None:
    """`triton.jit` picks interpreter or compiler when a module is imported, triton's own `tl.sum` & co.
    included. If another test imported triton before TRITON_INTERPRET was set, import it (and our
    kernels) afresh; the compiled extension `triton._C` is kept, it does not depend on the mode."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(tl.sum, InterpretedFunction):
        for name in list(sys.modules):
            stale_triton = (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")
            if stale_triton or name.startswith("tokenmill.layers.kernels"):
                del sys.modules[name]
    _fix_interpreter_scalars()


def _kernels():
    if not HAS_CUDA:
        _use_interpreter()
    from tokenmill.layers.kernels import fused_ops, paged_attention
    return paged_attention, fused_ops


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=torch.float32, gen=None) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen, spare_blocks=3):
    """Random cache with each sequence's blocks scattered over a random permutation of block ids."""
    blocks_per_seq = [-(-c // block_size) for c in seq_lens]
    max_blocks = max(max(blocks_per_seq), 1) + 1
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = perm[used:used + n].int()
        used += n
    k_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    return k_cache, v_cache, table.to(DEVICE)


def _tol(dtype):
    return {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


# ------------------------------------------------------------------------------------ paged attention


@pytest.mark.parametrize("group,block_size,dtype", [
    (5, 16, torch.float32), (4, 1, torch.float32), (4, 32, HALF)])
def test_prefill_varlen_with_cached_prefix(group, block_size, dtype):
    pa, _ = _kernels()
    gen = _gen(3)
    num_kv_heads, head_dim = 1, 16
    q_lens = [5, 1, 23, 0, 17]
    seq_lens = [5, 40, 30, 9, 17]
    k_cache, v_cache, table = _paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    num_q_heads = group * num_kv_heads
    qkv = _randn(sum(q_lens), (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    q = qkv[:, :num_q_heads * head_dim].view(-1, num_q_heads, head_dim)  # strided view, as in the model
    ref = paged_attention_torch(q, k_cache, v_cache, table, ctx, qsl, 0.3)
    out = pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, max(q_lens), 0.3,
                                     config=PrefillAttentionConfig(16, 16, 4, 1))
    torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))


def test_prefill_tile_grid_equals_sequence_grid():
    """The tile-map grid of a padded CUDA-graph batch: empty padding sequences, spare tiles, a
    sequence spanning two tiles. Rows past the last sequence (padding tokens) are not attended."""
    from tokenmill.layers.attention_metadata import PREFILL_BLOCK_M, prefill_tiles
    pa, _ = _kernels()
    gen = _gen(4)
    num_kv_heads, head_dim, group = 2, 16, 2
    q_lens = [5, 1, PREFILL_BLOCK_M + 6, 0, 17, 0, 0]           # the last two: padding sequences
    seq_lens = [5, 40, PREFILL_BLOCK_M + 30, 9, 17, 0, 0]
    k_cache, v_cache, table = _paged_cache(seq_lens, 8, num_kv_heads, head_dim, torch.float32, gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    tokens = sum(q_lens)
    q = _randn(tokens + 3, group * num_kv_heads, head_dim, gen=gen)  # 3 padding token rows
    tiles = torch.from_numpy(prefill_tiles(q_lens, tokens // PREFILL_BLOCK_M + len(q_lens))).to(DEVICE)
    assert tiles.shape[1] > int((tiles[1] < 1000).sum())          # spare tiles are present
    cfg = PrefillAttentionConfig(PREFILL_BLOCK_M, 16, 4, 1)
    out = pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, tokens + 3, 0.3, config=cfg,
                                     tiles=tiles)
    ref = paged_attention_torch(q[:tokens], k_cache, v_cache, table, ctx, qsl, 0.3)
    torch.testing.assert_close(out[:tokens], ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="BLOCK_M"):
        pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, tokens, 0.3,
                                   config=PrefillAttentionConfig(16, 16, 4, 1), tiles=tiles)


def test_paged_attention_dispatch_store_then_attend():
    """Full layer step through AttentionMetadata: a prefill chunk, then a decode step (both through the
    prefill kernel; pure-decode model steps take the fused decode kernel instead)."""
    pa, _ = _kernels()
    gen = _gen(4)
    block_size, num_kv_heads, group, head_dim = 4, 2, 4, 16
    num_q_heads = group * num_kv_heads
    caches = [torch.zeros(12, block_size, num_kv_heads, head_dim, device=DEVICE) for _ in range(2)]
    table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 0]], dtype=torch.int32, device=DEVICE)
    for q_lens, ctx_list in (([6, 9], [6, 9]), ([1, 1], [7, 10])):
        num_tokens = sum(q_lens)
        q = _randn(num_tokens, num_q_heads, head_dim, gen=gen)
        k = _randn(num_tokens, num_kv_heads, head_dim, gen=gen)
        v = _randn(num_tokens, num_kv_heads, head_dim, gen=gen)
        positions = [p for n, c in zip(q_lens, ctx_list) for p in range(c - n, c)]
        owner = [b for b, n in enumerate(q_lens) for _ in range(n)]
        slots = torch.tensor([int(table[b, p // block_size]) * block_size + p % block_size
                              for b, p in zip(owner, positions)], device=DEVICE)
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.tensor([0, q_lens[0], num_tokens], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(ctx_list, dtype=torch.int32, device=DEVICE),
            block_tables=table, max_query_len=max(q_lens),
            # decode must not depend on host-side lengths (CUDA graphs replay it with new ones)
            max_seq_len=max(ctx_list) if max(q_lens) > 1 else -1)
        store_kvcache_torch(k, v, caches[0], caches[1], slots)
        ref = paged_attention_torch(q, caches[0], caches[1], table, meta.seq_lens,
                                    meta.query_start_loc, 0.25)
        out = pa.paged_attention(q, caches[0], caches[1], meta, 0.25)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_attention_wrappers_reject_bad_inputs():
    pa, _ = _kernels()
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    ctx = torch.ones(1, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 2 kv heads"):
        pa.paged_prefill_attention(torch.zeros(1, 3, 16, device=DEVICE), cache, cache, table, ctx, qsl, 1, 1.0)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        pa.paged_prefill_attention(torch.zeros(1, 4, 16, device=DEVICE), cache, cache, table.long(), ctx, qsl, 1,
                                   1.0)
    with pytest.raises(TypeError, match="cache dtype"):
        pa.paged_prefill_attention(torch.zeros(1, 4, 16, device=DEVICE, dtype=torch.float16), cache, cache,
                                   table, ctx, qsl, 1, 1.0)
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        pa.paged_prefill_attention(torch.zeros(1, 4, 16, device=DEVICE), cache, cache, table, ctx, qsl.long(), 1,
                                   1.0)


# ---------------------------------------------------------------------------------------- fused ops


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    _, ops = _kernels()
    gen = _gen(5)
    x = _randn(5, 48, dtype=dtype, gen=gen)
    weight = _randn(48, dtype=dtype, gen=gen)
    residual = _randn(5, 48, dtype=dtype, gen=gen) if with_residual else None
    residual_before = None if residual is None else residual.clone()
    ref, ref_res = rms_norm_torch(x, weight, 1e-5, residual)
    got = ops.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        out, res = got
        torch.testing.assert_close(res, ref_res, rtol=0, atol=0)
        torch.testing.assert_close(residual, residual_before, rtol=0, atol=0)
    else:
        out = got
    torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))


def test_rms_norm_per_head_on_strided_view():
    """Qwen3's q/k norm runs on [T, H, D] views of the packed qkv output."""
    _, ops = _kernels()
    gen = _gen(6)
    qkv = _randn(3, (4 + 2) * 16, gen=gen)
    q = qkv[:, :64].view(3, 4, 16)
    weight = _randn(16, gen=gen)
    ref, _ = rms_norm_torch(q, weight, 1e-6)
    torch.testing.assert_close(ops.rms_norm(q, weight, 1e-6), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_silu_and_mul_matches_reference(dtype):
    _, ops = _kernels()
    gen = _gen(7)
    x = _randn(4, 2 * 40 + 6, dtype=dtype, gen=gen)[:, :80]  # row stride != 2I
    torch.testing.assert_close(ops.silu_and_mul(x), silu_and_mul_torch(x), rtol=_tol(dtype),
                               atol=_tol(dtype))


def _gemv():
    if not HAS_CUDA:
        _use_interpreter()
    from tokenmill.layers.kernels import gemv
    return gemv


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("norm,residual,silu,bias", [
    (False, False, False, False), (False, False, False, True), (True, False, False, False),
    (True, True, False, True), (True, True, True, False)])
def test_fused_linear_matches_reference(dtype, norm, residual, silu, bias):
    gemv = _gemv()
    gen = _gen(21)
    n, k = 44, 200   # 11 row blocks of 4 over 4 programs: each program loops; k is 7 ragged chunks of 32
    x, w = _randn(1, k, dtype=dtype, gen=gen), _randn(n, k, dtype=dtype, gen=gen) / 8
    kwargs = dict(bias=_randn(n, dtype=dtype, gen=gen) if bias else None,
                  norm_weight=_randn(k, dtype=dtype, gen=gen) if norm else None, eps=1e-5,
                  residual=_randn(1, k, dtype=dtype, gen=gen) if residual else None, silu=silu)
    ref, ref_res = gemv.fused_linear_torch(x, w, **kwargs)
    out, out_res = gemv.fused_linear(x, w, tile=RegisterTile(4, 32, 4, 1), **kwargs)
    assert out.shape == ((1, n // 2) if silu else (1, n))
    torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))
    if not norm:
        assert out_res is None
    elif residual:
        torch.testing.assert_close(out_res, ref_res, rtol=0, atol=0)
    else:
        assert out_res is x


def test_fused_linear_shared_memory_tile_falls_back_where_it_cannot_run():
    # a tile table entry SmemTile for a product in float32 (as correctness checks run the presets):
    # the product runs with the default register tile; asked for explicitly, the tile is refused by name
    gemv = _gemv()
    gen = _gen(22)
    x, w = _randn(1, 256, gen=gen), _randn(64, 256, gen=gen) / 8
    kernels = KernelConfig(tiles={(64, 256, False): SmemTile(8, 256, 4)}, default_tile=RegisterTile(4, 64, 4, 2))
    out, _ = gemv.fused_linear(x, w, kernels=kernels)
    torch.testing.assert_close(out, gemv.fused_linear_torch(x, w)[0], rtol=_tol(torch.float32),
                               atol=_tol(torch.float32))
    with pytest.raises((ValueError,), match="16-bit|no Gluon"):
        gemv.fused_linear(x, w, tile=SmemTile(8, 256, 4))


@pytest.mark.parametrize("n,k", [(44, 200), (37, 128), (9, 96)])
def test_fused_linear_whole_row_tiles_match_reference(n, k):
    """("whole", ...) tiles: a row block's K columns in one load of a power of two and one of the rest
    (k = 200: 128 + 128 with 56 masked; 128: one load; 96: 64 + 32), the next block's loads issued
    ahead, one or several blocks per program, the last cut short, each with and without a norm,
    residual, bias, SiLU-and-mul (gate and up rows) and gathered input row."""
    gemv = _gemv()
    gen = _gen(24)
    dtype = HALF
    x, w = _randn(1, k, dtype=dtype, gen=gen), _randn(n, k, dtype=dtype, gen=gen) / 8
    norm, res, bias = _randn(k, dtype=dtype, gen=gen), _randn(1, k, dtype=dtype, gen=gen), _randn(n, dtype=dtype, gen=gen)
    cases = [{}, dict(bias=bias), dict(norm_weight=norm, eps=1e-5), dict(norm_weight=norm, eps=1e-5, residual=res, bias=bias),
             dict(norm_weight=norm, eps=1e-5, residual=res, silu=True)]
    if n % 2:
        cases.pop()
    for kwargs in cases:
        ref, ref_res = gemv.fused_linear_torch(x, w, **kwargs)
        for tile in [WholeRowTile(4, 4, 1), WholeRowTile(2, 1, 3), WholeRowTile(16, 4, 1)]:
            out, out_res = gemv.fused_linear(x, w, tile=tile, **kwargs)
            torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))
            if "residual" in kwargs:
                torch.testing.assert_close(out_res, ref_res, rtol=0, atol=0)
            elif "norm_weight" in kwargs:
                assert out_res is x
    table, ids = _randn(5, k, dtype=dtype, gen=gen), torch.tensor([3], dtype=torch.int64, device=DEVICE)
    out, out_res = gemv.fused_linear(table, w, tile=WholeRowTile(4, 4, 1), norm_weight=norm, eps=1e-5, ids=ids)
    ref, _ = gemv.fused_linear_torch(table, w, norm_weight=norm, eps=1e-5, ids=ids)
    torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))
    assert torch.equal(out_res, table[3:4])


def test_fused_linear_whole_row_tiles_name_their_limits():
    gemv = _gemv()
    x, w = torch.zeros(1, 256, device=DEVICE), torch.zeros(64, 256, device=DEVICE)
    with pytest.raises(ValueError, match="row block of 256 x 256 weights is over the 32768"):
        gemv.fused_linear(x, w, tile=WholeRowTile(256, 4, 1))
    with pytest.raises(ValueError, match="row block of 256 x 256 weights"):   # gate and up rows
        gemv.fused_linear(torch.zeros(1, 256, device=DEVICE), torch.zeros(512, 256, device=DEVICE),
                          tile=WholeRowTile(128, 4, 1), silu=True)
    kernels = KernelConfig(tiles={(64, 256, False): WholeRowTile(256, 4, 1)})   # a table entry falls back
    torch.testing.assert_close(gemv.fused_linear(x, w, kernels=kernels)[0], torch.zeros(1, 64, device=DEVICE))


@pytest.mark.parametrize("silu,bias", [(False, True), (True, False)])
def test_fused_linear_gathers_its_input_from_the_embedding_table(silu, bias):
    # the first product of a step: the input is row ids[0] of the table, returned as the residual too
    gemv = _gemv()
    gen = _gen(23)
    n, k = 44, 200
    table, w = _randn(9, k, gen=gen), _randn(n, k, gen=gen) / 8
    ids = torch.tensor([6], dtype=torch.int64, device=DEVICE)
    kwargs = dict(bias=_randn(n, gen=gen) if bias else None, norm_weight=_randn(k, gen=gen), eps=1e-5, silu=silu)
    out, res = gemv.fused_linear(table, w, tile=RegisterTile(4, 32, 4, 1), ids=ids, **kwargs)
    ref, ref_res = gemv.fused_linear_torch(table, w, ids=ids, **kwargs)
    torch.testing.assert_close(out, ref, rtol=_tol(torch.float32), atol=_tol(torch.float32))
    row = table[6:7].clone()      # the same kernel on the row given: the same sums
    torch.testing.assert_close(out, gemv.fused_linear(row, w, tile=RegisterTile(4, 32, 4, 1), **kwargs)[0], rtol=0, atol=0)
    assert torch.equal(res, table[6:7]) and torch.equal(ref_res, res)
    with pytest.raises(ValueError, match="need a norm, no residual"):
        gemv.fused_linear(table, w, ids=ids)
    with pytest.raises(ValueError, match="ids must be int64"):
        gemv.fused_linear(table, w, ids=ids.int(), **kwargs)


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU every one-token step takes this path anyway")
def test_single_token_layers_give_the_composed_layers_tokens(model_dir, monkeypatch):
    """Every one-token step through the fused single-token layer (norms folded into the products,
    SiLU-and-mul into gate_up, the residual carried by the kernels) gives the tokens of the composed
    layer, for each architecture (qkv bias, q/k norm, GQA group 5)."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.models import llama
    gemv = _gemv()
    prompts = [[5, 9, 31, 7, 200, 3, 3, 41], [12]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    config = dict(device="cpu", dtype="float32", max_num_seqs=1)
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, **config).generate(prompts, params)]
    calls = []

    def fused(*args, **kwargs):
        calls.append(kwargs.get("silu", False))
        return gemv.fused_linear(*args, tile=RegisterTile(32, 64, 4, 2), **kwargs)
    monkeypatch.setattr(llama, "single_token_linear", lambda h, kernels: fused if h.shape[0] == 1 else None)
    got = [o.outputs[0].token_ids for o in LLM(model_dir, **config).generate(prompts, params)]
    assert got == expected
    assert calls.count(True) > 0 and len(calls) == 4 * calls.count(True)


# ------------------------------------------------------------------------------------ greedy argmax


def _argmax_module():
    if not HAS_CUDA:
        _use_interpreter()
    from tokenmill.layers.kernels import argmax
    return argmax


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("rows,vocab,block", [(1, 1000, 128), (3, 4096, 512), (2, 77, 4096)])
def test_greedy_argmax_matches_torch_first_of_equals(dtype, rows, vocab, block):
    argmax = _argmax_module()
    gen = _gen(11)
    logits = _randn(rows, vocab, dtype=dtype, gen=gen)
    # ties across chunks and within one: the first index must win, as torch's argmax picks it
    top = logits.float().max() + 1
    logits[0, [5, 700 % vocab, vocab - 1]] = top.to(dtype)
    if rows > 1:
        logits[1, :] = -1.0
        logits[1, [vocab - 2, vocab - 1]] = 3.0
    expect = logits.argmax(-1)
    for _ in range(2):     # the counters are left zeroed: a second launch gives the same tokens
        got = argmax.greedy(logits, block=block)
        assert got.dtype == torch.int64
        torch.testing.assert_close(got, expect, rtol=0, atol=0)
    from tokenmill.layers.kernels import counters
    assert all(int(c.abs().sum()) == 0 for bufs in counters._kept.values() for c in bufs)


def test_greedy_argmax_on_a_strided_view_into_given_output():
    argmax = _argmax_module()
    logits = _randn(4, 600, gen=_gen(12))[1:3, :500]
    out = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    assert argmax.greedy(logits, out, block=64) is out
    torch.testing.assert_close(out, logits.argmax(-1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="unit last stride"):
        argmax.greedy(logits.t())


def test_greedy_argmax_publishes_into_the_turns_row():
    # the tokens also go into row `turn` of a pinned host table, the turn read on the device at run time
    argmax = _argmax_module()
    logits = _randn(3, 900, gen=_gen(14))
    host = torch.full((2, 4), -7, dtype=torch.int64)
    if HAS_CUDA:
        host = host.pin_memory()
    for turn in (1, 0):
        got = argmax.greedy(logits, block=256, publish=(host, torch.tensor([turn], dtype=torch.int32,
                                                                             device=DEVICE)))
        if HAS_CUDA:
            torch.cuda.synchronize()
        assert host[turn, :3].tolist() == got.tolist() == logits.argmax(-1).tolist()
    assert host[:, 3].tolist() == [-7, -7]                   # past the rows: untouched
    with pytest.raises(ValueError, match="int64 \\[turns, >= 3\\]"):
        argmax.greedy(logits, publish=(host[:, :2], torch.zeros(1, dtype=torch.int32, device=DEVICE)))


# ------------------------------------------------------------------------------------ step staging


def _staging_module():
    if not HAS_CUDA:
        _use_interpreter()
    from tokenmill.layers.kernels import staging
    return staging


@pytest.mark.parametrize("n_ids,with_prev", [(1, True), (5, False), (1500, True)])
def test_stage_copies_the_span_and_fills_placeholders(n_ids, with_prev):
    staging = _staging_module()
    gen = _gen(13)
    ids_bytes, nbytes = 8 * 1600, 8 * 1600 + 4 * 2500
    src = torch.randint(0, 255, (nbytes + 64,), generator=gen, dtype=torch.uint8)
    ids = torch.randint(0, 1000, (n_ids,), generator=gen)
    prev = torch.randint(0, 1000, (7,), generator=gen).to(DEVICE)
    if with_prev:
        ids[::3] = -(torch.arange(len(ids[::3])) % 7) - 1      # placeholders -(row + 1), rows 0..6
    src[:n_ids * 8].view(torch.int64).copy_(ids)
    if HAS_CUDA:
        src = src.pin_memory()
    want = torch.full((nbytes + 64,), 9, dtype=torch.uint8, device=DEVICE)
    got = want.clone()
    staging.stage_torch(want, src, nbytes, ids_bytes, n_ids, prev if with_prev else None)
    staging.stage(got, src, nbytes, ids_bytes, n_ids, prev if with_prev else None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    filled = want[:n_ids * 8].view(torch.int64).cpu()
    if with_prev:
        assert (filled[::3] == prev.cpu()[(-ids[::3] - 1)]).all()
    assert (filled >= 0).all() and (want[n_ids * 8:ids_bytes] == 9).all() and (want[nbytes:] == 9).all()
    torch.testing.assert_close(want[ids_bytes:nbytes].cpu(), src[ids_bytes:nbytes], rtol=0, atol=0)


@pytest.mark.parametrize("n_ids", [0, 1, 1500])
def test_fill_placeholders_resolves_them_in_place(n_ids):
    # the copy-engine path's fill: ids already on the device, placeholders -(row + 1) replaced by prev[row]
    staging = _staging_module()
    gen = _gen(19)
    prev = torch.randint(0, 1000, (7,), generator=gen).to(DEVICE)
    ids = torch.randint(0, 1000, (n_ids + 3,), generator=gen)
    ids[::2] = -(torch.arange(len(ids[::2])) % 7) - 1
    want = torch.where(ids < 0, prev.cpu()[(-ids - 1).clamp(min=0)], ids)
    got = ids.to(DEVICE)
    staging.fill_placeholders(got[:n_ids], prev)
    assert torch.equal(got[:n_ids].cpu(), want[:n_ids])
    assert torch.equal(got[n_ids:].cpu(), ids[n_ids:])          # past the span: untouched
    with pytest.raises(ValueError, match="contiguous int64"):
        staging.fill_placeholders(got[::2], prev)


def test_stage_rejects_bad_layouts_and_publish_copies_tokens():
    staging = _staging_module()
    dst = torch.zeros(64, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="whole int32 words"):
        staging.stage(dst, torch.zeros(64, dtype=torch.uint8), 62, 16, 1, None)
    with pytest.raises(ValueError, match="whole int32 words"):
        staging.stage(dst, torch.zeros(64, dtype=torch.uint8), 64, 16, 3, None)
    with pytest.raises(ValueError, match="at least 128 bytes"):
        staging.stage(dst, torch.zeros(64, dtype=torch.uint8), 128, 16, 1, None)
    tokens = torch.arange(5, dtype=torch.int64, device=DEVICE) * 3
    host = torch.zeros(8, dtype=torch.int64)
    if HAS_CUDA:
        host = host.pin_memory()
    staging.publish(tokens, host)
    if HAS_CUDA:
        torch.cuda.synchronize()
    assert host.tolist() == [0, 3, 6, 9, 12, 0, 0, 0]


def test_fused_linear_rejects_bad_inputs():
    gemv = _gemv()
    x, w = torch.zeros(1, 8, device=DEVICE), torch.zeros(6, 8, device=DEVICE)
    with pytest.raises(ValueError, match="M <= 1"):
        gemv.fused_linear(torch.zeros(2, 8, device=DEVICE), w)
    with pytest.raises(ValueError, match="share K"):
        gemv.fused_linear(torch.zeros(1, 7, device=DEVICE), w)
    with pytest.raises(ValueError, match="needs a norm"):
        gemv.fused_linear(x, w, residual=x)
    with pytest.raises(ValueError, match="even number"):
        gemv.fused_linear(x, torch.zeros(5, 8, device=DEVICE), silu=True)
    with pytest.raises(ValueError, match="no bias"):
        gemv.fused_linear(x, w, torch.zeros(6, device=DEVICE), silu=True)


def _prologue_reference(qkv, positions, cos_sin, q_weight, k_weight, eps, k_cache, v_cache, slots,
                        num_heads, num_kv_heads, head_dim):
    """The unfused attention prologue: split, per-head RMSNorm, RoPE, KV-cache store."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    if q_weight is not None:
        q, _ = rms_norm_torch(q, q_weight, eps)
        k, _ = rms_norm_torch(k, k_weight, eps)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    q, k = apply_rotary_torch(q, cos, sin), apply_rotary_torch(k, cos, sin)
    store_kvcache_torch(k, v, k_cache, v_cache, slots)
    return q


def _check_prologue(ops, gen, num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                    dtype, qk_norm, max_pos, tol):
    rope = RotaryEmbedding(head_dim, max_pos, 10000.0).to(DEVICE)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn(num_tokens, width + 8, dtype=dtype, gen=gen)[:, 3:3 + width]  # row stride != width
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:2]] = -1
    slots = slots.to(DEVICE)
    q_weight = _randn(head_dim, dtype=dtype, gen=gen) if qk_norm else None
    k_weight = _randn(head_dim, dtype=dtype, gen=gen) if qk_norm else None
    poison = 777.0
    caches = [torch.full((num_blocks, block_size, num_kv_heads, head_dim), poison, dtype=dtype, device=DEVICE)
              for _ in range(4)]
    ref_q = _prologue_reference(qkv, positions, rope.cos_sin, q_weight, k_weight, 1e-6, caches[0],
                                caches[1], slots, num_heads, num_kv_heads, head_dim)
    q = ops.qk_norm_rope_store(qkv, positions, rope.cos_sin, q_weight, k_weight, 1e-6, caches[2],
                               caches[3], slots, num_heads, num_kv_heads, head_dim)
    assert q.shape == (num_tokens, num_heads, head_dim) and q.is_contiguous()
    torch.testing.assert_close(q, ref_q, rtol=tol, atol=tol)
    torch.testing.assert_close(caches[2], caches[0], rtol=tol, atol=tol)
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    for cache in caches[2:]:
        assert torch.all(cache.view(-1, num_kv_heads, head_dim)[untouched] == poison)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,qk_norm", [
    (4, 2, 16, 1, torch.float32, True),
    (4, 2, 32, 4, HALF, True),
    (5, 1, 16, 4, torch.float32, False),
    (5, 1, 32, 1, HALF, False),
    (5, 1, 32, 4, HALF, True),
])
def test_qk_norm_rope_store_matches_reference(num_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm):
    _, ops = _kernels()
    _check_prologue(ops, _gen(9), num_tokens=6, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, block_size=block_size, num_blocks=-(-8 // block_size), dtype=dtype,
                    qk_norm=qk_norm, max_pos=64, tol=_tol(dtype))


def test_qk_norm_rope_store_rejects_bad_inputs():
    _, ops = _kernels()
    rope = RotaryEmbedding(16, 8, 10000.0).to(DEVICE)
    qkv = torch.zeros(3, (4 + 2 * 2) * 16, device=DEVICE)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    weight = torch.ones(16, device=DEVICE)

    def call(qkv=qkv, positions=positions, q_weight=weight, k_weight=weight, k_cache=cache, heads=(4, 2)):
        ops.qk_norm_rope_store(qkv, positions, rope.cos_sin, q_weight, k_weight, 1e-6, k_cache, cache,
                               slots, *heads, 16)

    with pytest.raises(ValueError, match=r"qkv must be \[T, 112\]"):
        call(heads=(3, 2))
    with pytest.raises(ValueError, match=r"unit last stride"):
        call(qkv=torch.zeros(128, 3, device=DEVICE).t())
    with pytest.raises(TypeError, match="unsupported dtype torch.int32"):
        call(qkv=qkv.int())
    with pytest.raises(ValueError, match=r"positions must be int32/int64 \[3\]"):
        call(positions=positions[:2])
    with pytest.raises(ValueError, match="both be given or both be None"):
        call(k_weight=None)
    with pytest.raises(ValueError, match=r"q_weight must be torch.float32 \[16\]"):
        call(q_weight=torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match=r"k_cache must be torch.float32 \[num_blocks, block_size, 2, 16\]"):
        call(k_cache=cache.half())


def _decode_attention():
    if not HAS_CUDA:
        _use_interpreter()
    from tokenmill.layers.kernels import decode_attention
    return decode_attention


def _decode_positions(table, ctx, block_size):
    """Each sequence's new token: position ctx - 1 and its cache slot; slot -1 for ctx 0 (padding)."""
    positions = (ctx - 1).clamp(min=0).long()
    pages = table.long().gather(1, (positions // block_size)[:, None])[:, 0]
    return positions, torch.where(ctx > 0, pages * block_size + positions % block_size, -1)


def _fused_decode_reference(qkv, positions, cos_sin, q_weight, k_weight, k_cache, v_cache, slots, table,
                            ctx, num_heads, num_kv_heads, head_dim):
    """The unfused decode attention on copies of the cache: prologue (norm, RoPE, store), then attention
    over the cache. Returns (out, k_cache, v_cache)."""
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q = _prologue_reference(qkv, positions, cos_sin, q_weight, k_weight, 1e-6, ref_k, ref_v, slots,
                            num_heads, num_kv_heads, head_dim)
    qsl = torch.arange(qkv.shape[0] + 1, dtype=torch.int32, device=DEVICE)
    return paged_attention_torch(q, ref_k, ref_v, table, ctx, qsl, head_dim ** -0.5), ref_k, ref_v


def _check_fused_decode(gen, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm,
                        num_splits, config, tol):
    """The one-kernel decode attention against the unfused reference. Context length 0 is a padded
    slot (slot -1, zero output)."""
    da = _decode_attention()
    batch = len(seq_lens)
    k_cache, v_cache, table = _paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    positions, slots = _decode_positions(table, ctx, block_size)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0).to(DEVICE)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn(batch, width + 8, dtype=dtype, gen=gen)[:, 5:5 + width]  # row stride != width
    q_weight = _randn(head_dim, dtype=dtype, gen=gen) if qk_norm else None
    k_weight = _randn(head_dim, dtype=dtype, gen=gen) if qk_norm else None
    ref, ref_k, ref_v = _fused_decode_reference(qkv, positions, rope.cos_sin, q_weight, k_weight, k_cache,
                                                v_cache, slots, table, ctx, num_heads, num_kv_heads, head_dim)
    for _ in range(2):  # the second launch finds the split counters reset by the first
        out = da.fused_decode_attention(qkv, positions, rope.cos_sin, q_weight, k_weight, 1e-6, k_cache,
                                        v_cache, slots, table, ctx, head_dim ** -0.5, num_heads,
                                        num_kv_heads, head_dim, num_splits=num_splits,
                                        config=config or da.SHIPPED)
        assert out.shape == (batch, num_heads, head_dim)
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(k_cache, ref_k, rtol=tol, atol=tol)
    assert torch.equal(v_cache, ref_v)
    from tokenmill.layers.kernels import counters
    assert all(int(c.abs().sum()) == 0 for bufs in counters._kept.values() for c in bufs)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,qk_norm,num_splits,min_split", [
    (4, 2, 16, 4, torch.float32, True, 1, 16),
    (4, 2, 32, 16, HALF, True, 3, 16),
    (5, 1, 32, 1, torch.float32, False, 4, 16),
    (8, 2, 16, 4, HALF, False, None, 16),
    (4, 1, 16, 4, torch.float32, True, 4, 32),
    (4, 1, 16, 16, torch.float32, True, 16, 16),
])
def test_fused_decode_attention_equals_prologue_then_attention(num_heads, num_kv_heads, head_dim, block_size,
                                                                dtype, qk_norm, num_splits, min_split):
    # one split or several of >= min_split positions (merged in the kernel, 10 splits in two chunks of 8
    # at most); the new token first, last and inside a split, alone, and in a split of its own
    _check_fused_decode(_gen(31), [1, 37, 0, 16, 70, 33, 150], num_heads, num_kv_heads, head_dim, block_size,
                        dtype, qk_norm, num_splits, DecodeAttentionConfig(16, min_split_len=min_split), _tol(dtype))


def test_fused_decode_attention_stages_follow_the_split_count(monkeypatch):
    """A launch with `many_splits` splits (the most there are, at batch 1) runs its tile loop without
    software pipelining (one stage); one with fewer keeps the configured stages. Both stay correct."""
    da = _decode_attention()
    kernel, stages = da._fused_decode_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                stages.append(kwargs["num_stages"])
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(da, "_fused_decode_kernel", Recorder())
    config = DecodeAttentionConfig(16, min_split_len=16)
    for num_splits, want in ((da.SHIPPED.many_splits, da.SHIPPED.many_splits_stages),
                             (4, da.SHIPPED.num_stages)):
        stages.clear()
        _check_fused_decode(_gen(33), [1, 70, 150], 4, 1, 16, 16, torch.float32, True, num_splits, config,
                            _tol(torch.float32))
        assert stages == [want, want]
    assert da.SHIPPED.many_splits_stages != da.SHIPPED.num_stages


def test_fused_decode_attention_rejects_bad_inputs():
    da = _decode_attention()
    rope = RotaryEmbedding(16, 8, 10000.0).to(DEVICE)
    qkv = torch.zeros(2, (4 + 2 * 2) * 16, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    slots = torch.arange(2, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    table = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    ctx = torch.ones(2, dtype=torch.int32, device=DEVICE)

    def call(qkv=qkv, positions=positions, slots=slots, table=table, ctx=ctx, heads=(4, 2)):
        da.fused_decode_attention(qkv, positions, rope.cos_sin, None, None, 1e-6, cache, cache, slots, table,
                                  ctx, 0.25, *heads, 16)

    with pytest.raises(ValueError, match=r"fused_decode_attention: qkv must be \[T, 112\]"):
        call(heads=(3, 2))
    with pytest.raises(ValueError, match=r"one token per sequence: qkv has 1 rows, block_tables 2"):
        call(qkv=qkv[:1], positions=positions[:1], slots=slots[:1])
    with pytest.raises(ValueError, match=r"seq_lens must be int32 \[2\]"):
        call(ctx=ctx.long())
    with pytest.raises(ValueError, match=r"block_tables must be int32"):
        call(table=table.long())


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU every decode step takes this path anyway")
def test_engine_decode_through_the_one_kernel_attention(model_dir, monkeypatch):
    """Every decode step with its attention in the one fused kernel (split-K with the in-kernel merge)
    gives the tokens of the composed attention, for each architecture (qkv bias, q/k norm, GQA 5)."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.models import llama
    da = _decode_attention()
    prompts = [[5, 9, 31, 7, 200, 3, 3, 41] * 4, [12], [7, 7, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    config = dict(device="cpu", dtype="float32", block_size=4)
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, **config).generate(prompts, params)]
    batches = []

    def fused(qkv, *args, **kwargs):
        batches.append(qkv.shape[0])
        return da.fused_decode_attention(qkv, *args, num_splits=3, config=DecodeAttentionConfig(16, min_split_len=16),
                                         **kwargs)
    monkeypatch.setattr(llama, "decode_attention_kernel",
                        lambda h, meta, kernels: fused if meta.is_pure_decode(h.shape[0]) else None)
    got = [o.outputs[0].token_ids for o in LLM(model_dir, **config).generate(prompts, params)]
    assert got == expected
    assert batches and max(batches) > 1


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU every eager step with prefill tokens takes this path anyway")
def test_engine_eager_prefill_attention_through_a_tile_map(qwen3_dir, monkeypatch):
    """A step with prefill tokens that runs eagerly hands the prefill kernel a tile map of every
    sequence's query blocks (as graphs do): through that map the kernel gives the tokens of the
    reference attention, with long prompts chunked beside decode rows."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.attention import PagedAttention
    pa, _ = _kernels()
    prompts = [[5, 9, 31, 7, 200, 3, 3, 41] * 20, [12], [7, 7, 8] * 30, [3, 1, 4, 1, 5]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    config = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=200)
    expected = [o.outputs[0].token_ids for o in LLM(qwen3_dir, **config).generate(prompts, params)]
    reference, steps = PagedAttention.attend, []

    def attend(self, q, meta):
        if meta.is_pure_decode(q.shape[0]):
            return reference(self, q, meta)
        steps.append((meta.prefill_tiles, meta.query_start_loc.diff().tolist()))
        return pa.paged_prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, meta.max_query_len, self.scale,
                                          tiles=meta.prefill_tiles)
    monkeypatch.setattr(PagedAttention, "attend", attend)
    got = [o.outputs[0].token_ids for o in LLM(qwen3_dir, **config).generate(prompts, params)]
    assert got == expected
    assert all(tiles is not None for tiles, _ in steps)
    # a chunk of two query blocks beside other sequences took place, one tile per block
    assert any(len(lens) > 1 and max(lens) > 64 for _, lens in steps)
    assert all(tiles.shape[1] == sum(-(-n // 64) for n in lens) for tiles, lens in steps)


# ----------------------------------------------------------------------- GPU, realistic bf16 sizes


gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (20, 4)])
def test_gpu_prefill_realistic(num_q_heads, num_kv_heads):
    pa, _ = _kernels()
    gen = _gen(11)
    q_lens, seq_lens = [512, 300, 1, 512], [512, 1400, 900, 2000]
    k_cache, v_cache, table = _paged_cache(seq_lens, 16, num_kv_heads, 128, torch.bfloat16, gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = _randn(sum(q_lens), num_q_heads, 128, dtype=torch.bfloat16, gen=gen)
    ref = paged_attention_torch(q, k_cache, v_cache, table, ctx, qsl, 128 ** -0.5)
    out = pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, max(q_lens), 128 ** -0.5)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
def test_gpu_fused_ops_realistic():
    _, ops = _kernels()
    gen = _gen(12)
    bf16 = torch.bfloat16
    x, res = _randn(300, 2560, dtype=bf16, gen=gen), _randn(300, 2560, dtype=bf16, gen=gen)
    weight = _randn(2560, dtype=bf16, gen=gen)
    ref, ref_res = rms_norm_torch(x, weight, 1e-5, res)
    out, out_res = ops.rms_norm(x, weight, 1e-5, res)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out_res, ref_res, rtol=0, atol=0)
    up = _randn(300, 2 * 9728, dtype=bf16, gen=gen)
    torch.testing.assert_close(ops.silu_and_mul(up), silu_and_mul_torch(up), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qk_norm", [False, True])
def test_gpu_qk_norm_rope_store_realistic(qk_norm):
    _, ops = _kernels()
    _check_prologue(ops, _gen(14), num_tokens=300, num_heads=32, num_kv_heads=8, head_dim=128,
                    block_size=16, num_blocks=40, dtype=torch.bfloat16, qk_norm=qk_norm, max_pos=4096,
                    tol=2e-2)


def _check_tile_cases(gemv, x, w, tile, cases):
    # a tile at layer sizes against the reference, for each set of options; the residual out exactly
    for kwargs in cases:
        got, got_res = gemv.fused_linear(x, w, tile=tile, **kwargs)
        ref, ref_res = gemv.fused_linear_torch(x, w, **kwargs)
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
        if "residual" in kwargs:
            torch.testing.assert_close(got_res, ref_res, rtol=0, atol=0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k,tile", [(6144, 2560, WholeRowTile(2, 4, 6)), (6144, 2560, WholeRowTile(4, 4, 4)),
                                      (2570, 4096, WholeRowTile(2, 4, 4)), (1001, 9728, WholeRowTile(2, 8, 1)),
                                      (19458, 2560, WholeRowTile(2, 4, 4))])
def test_gpu_fused_linear_whole_row_tiles(n, k, tile):
    """("whole", ...) tiles at layer sizes against the reference, with and without a norm, residual and
    bias and SiLU-and-mul (even n), the last block cut short (2570, 1001, and 9729 gate
    rows), K of two loads (2560, 9728) or one."""
    gemv = _gemv()
    gen = _gen(18)
    bf16 = torch.bfloat16
    x, w = _randn(1, k, dtype=bf16, gen=gen), _randn(n, k, dtype=bf16, gen=gen) / 50
    norm, res = 1 + _randn(k, dtype=bf16, gen=gen) / 10, _randn(1, k, dtype=bf16, gen=gen)
    cases = [{}, dict(bias=_randn(n, dtype=bf16, gen=gen)), dict(norm_weight=norm, eps=1e-6, residual=res)]
    if n % 2 == 0:
        cases.append(dict(norm_weight=norm, eps=1e-6, residual=res, silu=True))
    _check_tile_cases(gemv, x, w, tile, cases)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k,tile", [(3584, 2560, SmemTile(4, 512, 4)), (2560, 4096, SmemTile(8, 1024, 8)),
                                      (1000, 9728, SmemTile(2, 512, 2)), (2570, 2560, SmemTile(8, 256, 4))])
def test_gpu_fused_linear_shared_memory_tiles(n, k, tile):
    """The ("smem", ...) tiles (gemv_smem: whole row blocks copied to shared memory before the wait)
    against the reference, with and without a norm, residual, SiLU-and-mul and bias, including a last
    row block that is cut short (n = 1000 and 2570 are not multiples of the block rows)."""
    gemv = _gemv()
    gen = _gen(17)
    bf16 = torch.bfloat16
    x, w = _randn(1, k, dtype=bf16, gen=gen), _randn(n, k, dtype=bf16, gen=gen) / 50
    norm, res = 1 + _randn(k, dtype=bf16, gen=gen) / 10, _randn(1, k, dtype=bf16, gen=gen)
    bias = _randn(n, dtype=bf16, gen=gen)
    cases = [{}, dict(bias=bias), dict(norm_weight=norm, eps=1e-6), dict(norm_weight=norm, eps=1e-6, residual=res),
             dict(norm_weight=norm, eps=1e-6, residual=res, silu=True)]
    _check_tile_cases(gemv, x, w, tile, cases)
    with pytest.raises(ValueError, match="shared memory"):
        gemv.fused_linear(x, w, tile=SmemTile(64, 512, 4), silu=True)


@pytest.mark.gpu
@gpu
def test_gpu_fused_linear_chain_in_a_cuda_graph():
    """A decoder layer's four single-token products at qwen3-4b sizes, chained as in a decode step and
    replayed from a CUDA graph (programmatic dependent launch on Hopper): each matches the reference
    computed from the previous product's graph output, so a kernel that read its input before the
    previous one finished would fail here."""
    gemv = _gemv()
    gen = _gen(15)
    bf16 = torch.bfloat16
    hidden, inter, qkv_n = 2560, 9728, 6144
    w_qkv, w_o = _randn(qkv_n, hidden, dtype=bf16, gen=gen) / 50, _randn(hidden, 4096, dtype=bf16, gen=gen) / 64
    w_gu, w_down = _randn(2 * inter, hidden, dtype=bf16, gen=gen) / 50, _randn(hidden, inter, dtype=bf16, gen=gen) / 99
    n1, n2 = 1 + _randn(hidden, dtype=bf16, gen=gen) / 10, 1 + _randn(hidden, dtype=bf16, gen=gen) / 10
    x, res = _randn(1, hidden, dtype=bf16, gen=gen), _randn(1, hidden, dtype=bf16, gen=gen)

    def layer():
        qkv, r = gemv.fused_linear(x, w_qkv, norm_weight=n1, eps=1e-6, residual=res)
        o, _ = gemv.fused_linear(qkv[:, :4096].contiguous(), w_o)
        h, r2 = gemv.fused_linear(o, w_gu, norm_weight=n2, eps=1e-6, residual=r, silu=True)
        return qkv, r, o, h, r2, gemv.fused_linear(h, w_down)[0]
    layer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layer()
    for _ in range(3):
        x.copy_(_randn(1, hidden, dtype=bf16, gen=gen))
        graph.replay()
        qkv, r, o, h, r2, down = outs
        ref_qkv, ref_r = gemv.fused_linear_torch(x, w_qkv, norm_weight=n1, eps=1e-6, residual=res)
        torch.testing.assert_close(qkv, ref_qkv, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(r, ref_r, rtol=0, atol=0)
        torch.testing.assert_close(o, gemv.fused_linear_torch(qkv[:, :4096], w_o)[0], rtol=2e-2, atol=2e-2)
        ref_h, ref_r2 = gemv.fused_linear_torch(o, w_gu, norm_weight=n2, eps=1e-6, residual=r, silu=True)
        torch.testing.assert_close(h, ref_h, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(r2, ref_r2, rtol=0, atol=0)
        torch.testing.assert_close(down, gemv.fused_linear_torch(h, w_down)[0], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (20, 4)])
@pytest.mark.parametrize("batch", [1, 33])
def test_gpu_fused_decode_realistic(num_q_heads, num_kv_heads, batch):
    gen = _gen(16)
    seq_lens = torch.randint(1, 2100, (batch,), generator=gen).tolist()
    _check_fused_decode(gen, seq_lens, num_q_heads, num_kv_heads, 128, 16, torch.bfloat16,
                        num_q_heads == 32, None, None, 2e-2)


@pytest.mark.gpu
@gpu
def test_gpu_fused_decode_cuda_graph_replay_with_new_lengths():
    """Captured once, replayed with new lengths, slots and inputs: the split merge, its counters and the
    cache store all follow the device tensors."""
    da = _decode_attention()
    gen = _gen(17)
    bf16, batch, hq, hkv = torch.bfloat16, 4, 32, 8
    k_cache, v_cache, table = _paged_cache([600] * batch, 16, hkv, 128, bf16, gen)
    rope = RotaryEmbedding(128, 4096, 1e6).to(DEVICE)
    qkv = _randn(batch, (hq + 2 * hkv) * 128, dtype=bf16, gen=gen)
    q_weight, k_weight = _randn(128, dtype=bf16, gen=gen), _randn(128, dtype=bf16, gen=gen)
    ctx = torch.full((batch,), 3, dtype=torch.int32, device=DEVICE)
    positions, slots = _decode_positions(table, ctx, 16)

    def step():
        return da.fused_decode_attention(qkv, positions, rope.cos_sin, q_weight, k_weight, 1e-6, k_cache,
                                         v_cache, slots, table, ctx, 128 ** -0.5, hq, hkv, 128)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ([1, 600, 17, 333], [600, 2, 0, 64]):
        ctx.copy_(torch.tensor(lengths, dtype=torch.int32))
        new_positions, new_slots = _decode_positions(table, ctx, 16)
        positions.copy_(new_positions)
        slots.copy_(new_slots)
        qkv.copy_(_randn(batch, (hq + 2 * hkv) * 128, dtype=bf16, gen=gen))
        ref, ref_k, ref_v = _fused_decode_reference(qkv, positions, rope.cos_sin, q_weight, k_weight,
                                                    k_cache, v_cache, slots, table, ctx, hq, hkv, 128)
        graph.replay()
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(k_cache, ref_k, rtol=2e-2, atol=2e-2)
        assert torch.equal(v_cache, ref_v)
