"""The kernels' configuration: frozen dataclasses, set once (`EngineConfig.kernels`) and handed to the model
by the runner. No Triton here, so the CPU path reads it without a Triton backend.

A single-token product (`kernels/gemv.py`) runs one of three tiles, picked by its weight shape (N, K) and
whether the gated activation (SiLU- or GELU-and-mul) follows; `KernelConfig()` holds the shipped table, the
fastest tiles on an H200 for the qwen3-4b and nanbeige4.1-3b products inside the batch-1 decode graph
(docs/BENCHMARKS.md), and the register tile for every other shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Union


@dataclass(frozen=True)
class RegisterTile:
    """`gemv._gemv_kernel`: a program holds a block_n x block_k weight chunk in registers and walks K in
    such chunks, its first chunk requested before the programmatic-dependent-launch wait."""
    block_n: int
    block_k: int
    num_warps: int
    programs_per_sm: int


@dataclass(frozen=True)
class WholeRowTile:
    """`gemv_whole._gemv_whole_kernel`: a row block's whole rows (block_n x K, with the gated activation as many up
    rows again) in one round trip to HBM, the first block's before the wait and each next block's issued ahead."""
    block_n: int
    num_warps: int
    programs_per_sm: int


@dataclass(frozen=True)
class SmemTile:
    """`gemv_smem`: one program per block of block_n rows copies them whole into shared memory (as K //
    block_k chunks) before the wait, so a product launched during a short kernel has its weights on chip
    when its input is ready."""
    block_n: int
    block_k: int
    num_warps: int


Tile = Union[RegisterTile, WholeRowTile, SmemTile]

# ((N, K, gated), tile) pairs (gated: the gated activation follows, whichever it is); each the fastest of the
# whole-row tiles timed inside the batch-1 decode graph (scripts/device/decode_tiles.py --weights bf16), or a
# register or shared-memory tile that beat them all there
SHIPPED_TILES: tuple[tuple[tuple[int, int, bool], Tile], ...] = tuple({
    (6144, 2560, False): WholeRowTile(block_n=2, num_warps=4, programs_per_sm=4),     # qwen3-4b qkv
    (2560, 4096, False): WholeRowTile(block_n=2, num_warps=4, programs_per_sm=4),     # qwen3-4b o_proj
    (19456, 2560, True): WholeRowTile(block_n=1, num_warps=4, programs_per_sm=6),     # qwen3-4b gate_up
    (2560, 9728, False): WholeRowTile(block_n=1, num_warps=16, programs_per_sm=2),    # qwen3-4b down_proj
    (3584, 2560, False): WholeRowTile(block_n=2, num_warps=4, programs_per_sm=5),     # nanbeige4.1-3b qkv
    (2560, 2560, False): SmemTile(block_n=8, block_k=512, num_warps=8),               # nanbeige4.1-3b o_proj
    (20992, 2560, True): WholeRowTile(block_n=1, num_warps=4, programs_per_sm=6),     # nanbeige4.1-3b gate_up
    (2560, 10496, False): WholeRowTile(block_n=1, num_warps=16, programs_per_sm=2),   # nanbeige4.1-3b down_proj
}.items())

# the FP8 products' whole-row tiles where an H200 sweep found one faster than `gemv_whole.fp8_tile` of the 16-bit
# tile, timed inside the batch-1 decode graph (scripts/device/decode_tiles.py --weights fp8; nanbeige4.1-3b's
# down_proj tile is an isolated sweep's, scripts/device/fp8_products.py, which held in the graph);
# docs/BENCHMARKS.md
SHIPPED_FP8_TILES: tuple[tuple[tuple[int, int, bool], Tile], ...] = tuple({
    (6144, 2560, False): WholeRowTile(block_n=4, num_warps=4, programs_per_sm=3),     # qwen3-4b qkv
    (19456, 2560, True): WholeRowTile(block_n=2, num_warps=4, programs_per_sm=5),     # qwen3-4b gate_up
    (3584, 2560, False): WholeRowTile(block_n=4, num_warps=4, programs_per_sm=3),     # nanbeige4.1-3b qkv
    (2560, 2560, False): WholeRowTile(block_n=4, num_warps=4, programs_per_sm=5),     # nanbeige4.1-3b o_proj
    (20992, 2560, True): WholeRowTile(block_n=2, num_warps=4, programs_per_sm=5),     # nanbeige4.1-3b gate_up
    (2560, 10496, False): WholeRowTile(block_n=2, num_warps=4, programs_per_sm=3),    # nanbeige4.1-3b down_proj
}.items())


@dataclass(frozen=True)
class DecodeAttentionConfig:
    """`decode_attention.fused_decode_attention`, and a mixed step's decode rows
    (`decode_rows.launch_decode_rows`). A tile is block_n positions; a split holds at least
    min_split_len of them (a multiple of block_n), so contexts up to that length take one program per
    (sequence, kv head) and need no merge. A launch with many_splits splits or more (a batch of one
    sequence, two with 4 kv heads) has splits of one or two tiles, which software pipelining only slows:
    it takes many_splits_stages; launches with fewer, longer splits take num_stages (3: two tiles of K and V
    in flight a program, 1-6% faster than one on an H200 at 256 sequences). maxnreg caps the registers of
    the one-kernel decode, rows_maxnreg those of the decode rows (None: uncapped). one_split, where given,
    is the one-kernel decode's launch when each program takes a whole context (one split: enough
    sequences to fill the GPU); filled, where given, its launch of several splits from a quarter of an
    SM's worth of (sequence, kv head) programs on (`decode_attention.takes_filled_launch`;
    `decode_num_splits` then splits to eight programs an SM). The KV cache's dtype picks the configuration
    (`KernelConfig.decode_attention_for`)."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    min_split_len: int = 64
    many_splits: int = 32
    many_splits_stages: int = 1
    maxnreg: int | None = None
    rows_maxnreg: int | None = None
    one_split: DecodeAttentionConfig | None = None
    filled: DecodeAttentionConfig | None = None

    def __post_init__(self):
        if self.min_split_len % self.block_n:
            raise ValueError(f"decode attention: min_split_len {self.min_split_len} is not a multiple of "
                             f"block_n {self.block_n}")


# A bf16 cache: 64-position tiles, four warps, uncapped (capping measured 1-3% slower). Split contexts of
# 5 sequences or more (8 kv heads, 132 SMs) take 32-position tiles of one warp at two stages, as an FP8
# cache's do (up to 21% faster from 5 to 64 sequences on an H200, but 8% slower at 48 short ones; at one
# split, 96-256 sequences, neither one-warp launch won everywhere: docs/BENCHMARKS.md).
SHIPPED_DECODE = DecodeAttentionConfig(filled=DecodeAttentionConfig(block_n=32, num_warps=1, num_stages=2))
# An FP8 cache, whose loop is bound by its latency (the widening, and the softmax's exchanges between
# warps), not by its bytes. Batch 1-4 (fewer (sequence, kv head) programs than a quarter of the SMs, many
# short splits) and the decode rows: as bf16, the one-kernel decode capped at 128 registers and the rows at
# 96 (uncapped the decode takes 134 on sm90, three programs an SM where its shared memory allows four).
# Programs that fill the SMs take 32-position tiles of one warp, uncapped: no exchanges between warps, 8
# programs an SM. At one split three stages (18% faster than 64 x 4 x 3 at 256 sequences of 100-1,000
# positions on an H200, 11% at 1,000-2,000); split, from 5 sequences, two (13-43% faster from 5 to 64
# sequences, where three stages lost up to 12% at long contexts); one-warp launches lost at batch 1 and 3
# (docs/BENCHMARKS.md).
SHIPPED_FP8_DECODE = DecodeAttentionConfig(maxnreg=128, rows_maxnreg=96,
                                           one_split=DecodeAttentionConfig(block_n=32, num_warps=1),
                                           filled=DecodeAttentionConfig(block_n=32, num_warps=1, num_stages=2))


def shipped_decode_attention(fp8_cache: bool) -> DecodeAttentionConfig:
    """The shipped decode attention launch for a bf16 or an FP8 KV cache (the kernels' default when their
    caller names none; `KernelConfig.decode_attention_for` picks among a config's own)."""
    return SHIPPED_FP8_DECODE if fp8_cache else SHIPPED_DECODE


@dataclass(frozen=True)
class PrefillAttentionConfig:
    """`paged_attention.paged_prefill_attention`: block_m query rows by block_n cached positions a tile.
    fp8_maxnreg caps the FP8-cache variant's registers: at 168 three programs share an SM where its 185
    allowed two (4% faster on a 2,048-token prefill); the bf16 variant needs its 192 (its shared memory
    allows two programs anyway). num_stages 3 keeps two tiles of K and V in flight a program (bf16 on
    sm90, whose products read them from shared memory, three; 114,688 bytes). On a 2,048-token prefill on
    an H200, bf16: 168 us against 174 at two stages (and 187 before the pages went a tile ahead); FP8 the
    same within 1% (docs/BENCHMARKS.md)."""
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    fp8_maxnreg: int | None = 168


@dataclass(frozen=True)
class KernelConfig:
    """`tiles`: ((N, K, gated), tile) pairs (a mapping is accepted and kept as pairs), so the config stays
    immutable and pickles with `EngineConfig` into the engine core's process. `fp8_tiles`: the same for
    products with FP8 weights; a shape not there takes `gemv_whole.fp8_tile` of its 16-bit tile.
    `decode_attention` and `fp8_decode_attention`: the decode attention's launch for each KV cache."""
    tiles: tuple[tuple[tuple[int, int, bool], Tile], ...] = SHIPPED_TILES
    fp8_tiles: tuple[tuple[tuple[int, int, bool], Tile], ...] = SHIPPED_FP8_TILES
    default_tile: RegisterTile = RegisterTile(block_n=4, block_k=1024, num_warps=4, programs_per_sm=8)
    decode_attention: DecodeAttentionConfig = SHIPPED_DECODE
    fp8_decode_attention: DecodeAttentionConfig = SHIPPED_FP8_DECODE
    prefill_attention: PrefillAttentionConfig = field(default_factory=PrefillAttentionConfig)

    def __post_init__(self):
        for name in ("tiles", "fp8_tiles"):
            if isinstance(getattr(self, name), Mapping):
                object.__setattr__(self, name, tuple(getattr(self, name).items()))
        object.__setattr__(self, "_by_shape", dict(self.tiles))
        object.__setattr__(self, "_fp8_by_shape", dict(self.fp8_tiles))

    def decode_attention_for(self, fp8_cache: bool) -> DecodeAttentionConfig:
        """The decode attention's launch for a bf16 or an FP8 KV cache."""
        return self.fp8_decode_attention if fp8_cache else self.decode_attention

    def tile(self, n: int, k: int, gated: bool) -> Tile:
        """The tile for a product with weight [n, k] (the gated activation after it when `gated`)."""
        return self._by_shape.get((n, k, gated), self.default_tile)

    def fp8_tile(self, n: int, k: int, gated: bool) -> Tile | None:
        """The measured tile for that product with FP8 weights, or None."""
        return self._fp8_by_shape.get((n, k, gated))
