"""The attention kernels' software pipelining, compiled for sm90 on the CPU: each loop loads a tile's pages
a tile ahead of its K and V (`attention_common.tile_pages`), so that at the shipped stage count (3) the
pipeliner keeps two tiles of K and V in flight, each in its own shared-memory buffer. With the pages
loaded in the same iteration as the K and V that need them, it kept one buffer in these kernels whatever
the stage count (docs/BENCHMARKS.md, "Attention with each tile's pages loaded a tile ahead"); the bf16
prefill, which kept two before, is left out. The deeper buffers cost shared memory: every attention kernel
at its shipped configuration with a bf16 cache (an FP8 cache's take less), compiled for sm89, still fits
the 99 KB that sm86 and sm89 GPUs give a program (both take the same mma.sync path; sm86 compiled to the
same bytes when this was written)."""
from __future__ import annotations

import pytest
import sm90

from tokenmill.layers.kernel_config import SHIPPED_DECODE, SHIPPED_FP8_DECODE, PrefillAttentionConfig

_COMPILE = sm90.ATTENTION + r'''
import json, re, sys
got = []
for name, fp8, stages, arch, maxnreg, block_n, num_warps in json.loads(sys.argv[1]):
    compiled = compile_attention(name, fp8, arch=arch, num_stages=stages, num_warps=num_warps,
                                 const=dict(BLOCK_N=block_n),
                                 **({"maxnreg": maxnreg} if maxnreg else {}))
    # the depth of each multi-buffered K/V tile (a [depth, block_n positions, width] buffer), and the bytes
    depths = {int(d) for d in re.findall(rf"local_alloc : \(\) -> !ttg.memdesc<(\d+)x{block_n}x\d+x",
                                         compiled.asm["ttgir"])}
    got.append([sorted(depths), compiled.metadata.shared])
print(json.dumps(got))
'''
_PREFILL = PrefillAttentionConfig()


def _case(name, fp8, arch, cfg, maxnreg):
    # (kernel, FP8 cache, stages, sm, register cap, block_n, num_warps) as the shipped configuration
    # launches it (the prefill's positions a tile: block_n)
    return (name, fp8, cfg.num_stages, arch, maxnreg or 0, cfg.block_n, cfg.num_warps)


_SM90 = [_case("decode", False, 90, SHIPPED_DECODE, SHIPPED_DECODE.maxnreg),
         _case("decode", True, 90, SHIPPED_FP8_DECODE, SHIPPED_FP8_DECODE.maxnreg),
         _case("decode", True, 90, SHIPPED_FP8_DECODE.one_split, SHIPPED_FP8_DECODE.one_split.maxnreg),
         _case("decode_rows", True, 90, SHIPPED_FP8_DECODE, SHIPPED_FP8_DECODE.rows_maxnreg),
         _case("prefill", True, 90, _PREFILL, _PREFILL.fp8_maxnreg)]
# the one-warp launches of contexts split across SMs that they fill, at two stages (`filled`)
_FILLED = [_case("decode", False, 90, SHIPPED_DECODE.filled, None),
           _case("decode", True, 90, SHIPPED_FP8_DECODE.filled, None)]
# bf16 only: an FP8 cache's tiles are half the bytes
_SMALL = [_case("decode", False, 89, SHIPPED_DECODE, None), _case("decode_rows", False, 89, SHIPPED_DECODE, None),
          _case("prefill", False, 89, _PREFILL, None)]
_SMALL_GPU_SHARED = 99 * 1024


@pytest.fixture(scope="module")
def compiled(sm90_compiler):
    cases = _SM90 + _FILLED + _SMALL
    return dict(zip(map(tuple, cases), sm90_compiler.run(_COMPILE, *cases, timeout=600)))


@pytest.mark.parametrize("case", _SM90, ids=lambda c: f"{c[0]}-{'fp8' if c[1] else 'bf16'}-{c[5]}x{c[6]}")
def test_k_and_v_tiles_in_flight_at_the_shipped_stages(compiled, case):
    depths, _ = compiled[case]
    assert depths == [case[2] - 1] == [2]


@pytest.mark.parametrize("case", _FILLED, ids=lambda c: f"{'fp8' if c[1] else 'bf16'}-{c[5]}x{c[6]}")
def test_filled_launches_keep_a_tile_in_flight_at_two_stages(compiled, case):
    depths, _ = compiled[case]
    assert depths == [case[2] - 1] == [1]


@pytest.mark.parametrize("case", _SMALL, ids=lambda c: f"{c[0]}-sm{c[3]}")
def test_attention_fits_the_shared_memory_of_sm89(compiled, case):
    _, shared = compiled[case]
    assert 0 < shared <= _SMALL_GPU_SHARED
