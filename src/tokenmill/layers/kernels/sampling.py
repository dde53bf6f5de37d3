"""Random sampling on the device without a sort: one program per row of the logits, one launch per step.

A row's token is the exponential race over its kept tokens: argmax of e_i / E_i, where
e_i = exp((x_i - max x) / T) (proportional to p_i, the normaliser does not change the argmax) and E_i ~ Exp(1)
comes from the counter-based hash of `runner/sampler.py::seeded_exponential`, bit for bit, so a row's draw
is a pure function of (seed, output position, token id). Every row uses its request's seed (the engine gives
each request one); greedy rows (temperature < 1e-5) take the argmax, first of equals.

The kept set is {x_i >= cut-off}; the boundary rule, shared with the torch reference
(`sampler._top_k_top_p_min_p`), keeps ties at the cut-off together. Token i is kept iff
  top-k:  fewer than k tokens have a strictly larger logit (ties with the k-th largest all stay);
  top-p:  the mass of the tokens with strictly larger logits is below top_p of the mass of the tokens
          min-p and top-k keep (vLLM's and Hugging Face's order: the nucleus of the top-k survivors);
  min-p:  e_i >= min_p (p_i >= min_p * p_max).
The largest logit always stays. With top-k and top-p both on, the top-k survivors' mass is needed only
where the race's first winner is not settled by a lower bound of it (the winner's mass and all above it):
then a bisection finds the top-k cut-off and one pass sums the mass above it.

Passes over the row (each a masked reduction, no sort):
  1. the maximum, and the race over all tokens but those below min-p of the maximum so far, a superset of
     the min-p survivors (online: the best ratio rescales when the maximum grows);
  2. if the race's winner w is kept, it is also the race's winner over the kept set: done. A row with top-p
     0.95 stops here 95% of the time or more. Deciding needs one pass: count and mass above x_w;
  3. otherwise (top-p and min-p rows) the race again over the tokens above the dropped winner, {x > x_w}, a
     superset of the kept set: its winner, if kept, is the kept set's winner too (the same noise, every
     kept token in the race), which one probe at its value decides. A race over a superset of the nucleus
     ends outside it with probability at most 1 - top_p, so one retry settles nearly every such row in two
     passes where bisection took a dozen; after RETRIES dropped winners (and for rows with top-k, whose
     kept set may hold a sliver of the mass above x_w), step 4;
  4. bisection over the value for the cut-off: each probe one pass (count, mass, the nearest values
     on both sides); the bracket (lo, hi] always holds the cut-off and shrinks to a single distinct value
     (then every token in it shares {x > value} with hi and is kept, so kept = {x > lo}, exactly), snapping
     its ends to the nearest token values; then the race over the kept tokens.
Steps 3 and 4 draw the same token: both are the race's winner over the kept set, given the same noise.
The race skips the exact noise (a float64 log) wherever a cheap lower bound E >= w + w^2 / 2, w = 1 - u,
already shows a token cannot beat the best so far, so the log runs on a few blocks per row.

Reference: `runner/sampler.py`'s torch path given the same noise (tests/kernels/test_sampling_kernel.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Launch shapes (BLOCK columns a step of a pass, warps a program). A step's sampling lasts as long as its
# slowest row, and with top-k or top-p one row in a few dozen bisects, a pass per probe: such batches take
# wide programs, whose passes keep more bytes in flight (1.3-1.6x faster at 64-256 rows of 152K-166K
# logits on an H200, docs/BENCHMARKS.md); batches that only race (two passes at most) keep narrow ones,
# which the wide lose to by 12-18% at 256 rows.
RACE_SHAPE = (2048, 8)
FILTER_SHAPE = (8192, 32)
# value-space halvings of the bracket; finite float32 logits converge in far fewer (~10-20 for a 152k
# vocabulary). A row still unresolved after them keeps its bracket's undecided tokens, which then lie within
# 2^-64 of the bracket's first width of each other.
MAX_PROBES = 64
# races over a superset of the nucleus before bisecting (step 3)
RETRIES = 3
_LOG2E = 1.4426950408889634


@triton.jit
def _mix(a, b):
    """fmix32(b ^ fmix32(a)) on uint32, murmur3's finaliser as `sampler._fmix32`: a row's hash key is
    _mix(position * 0x9E3779B1 + seed_hi, seed_lo), a token's bits _mix(key ^ id * 0x27D4EB2F, key)."""
    x = a
    for i in tl.static_range(2):
        if i == 1:
            x = x ^ b
        x = x ^ (x >> 16)
        x = x * 0x85EBCA6B
        x = x ^ (x >> 13)
        x = x * 0xC2B2AE35
        x = x ^ (x >> 16)
    return x


@triton.jit
def _race(e, key, offs, best_r, best_id):
    """One block of the race argmax(e / E): the best ratio and its token so far, updated.

    E = -log(u), u = (bits + 0.5) / 2^32 for the token's hash bits, in float64 then rounded to float32, as
    `seeded_exponential`. With
    w = 1 - u, E >= w + w^2 / 2; a token whose e is at most that bound times the best ratio (less a margin of
    2^-10, far above the float32 error of e, w and the bound) cannot win, and a block without any other token
    skips the log. Ties go to the lower token id (blocks run in order, so a later block must beat the best)."""
    bits = _mix(key ^ (offs.to(tl.uint32) * 0x27D4EB2F), key)
    w = ((bits ^ 0xFFFFFFFF).to(tl.float32) + 0.5) * 2.3283064365386963e-10
    cand = e > (w + 0.5 * w * w) * (best_r * 0.9990234375)
    if tl.max(cand.to(tl.int32), 0) > 0:
        u = (bits.to(tl.float64) + 0.5) * 2.3283064365386963e-10
        noise = (-tl.log(u)).to(tl.float32)
        r = tl.where(cand, tl.math.div_rn(e, noise), 0.0)
        top = tl.max(r, 0)
        if top > best_r:
            best_id = tl.min(tl.where(r == top, offs, 2147483647), 0)
            best_r = top
    return best_r, best_id


@triton.jit
def _probe(row_ptr, V, tau, m, c, min_p, want_mass, TOTAL: tl.constexpr, BLOCK: tl.constexpr):
    """One pass at the probe value tau: the count and mass (sum of e) of tokens with x > tau, the smallest
    value above tau, the largest at or below it, and (TOTAL) the mass of the min-p survivors. The mass only
    where `want_mass` (top-p rows). Elementwise accumulators, reduced once at the end."""
    cnt = tl.zeros((BLOCK,), tl.int32)
    mass = tl.zeros((BLOCK,), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    above = tl.full((BLOCK,), float("inf"), tl.float32)
    below = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        gt = x > tau
        cnt += gt.to(tl.int32)
        above = tl.minimum(above, tl.where(gt, x, float("inf")))
        below = tl.maximum(below, tl.where(gt, float("-inf"), x))
        if want_mass:
            e = tl.exp2((x - m) * c)
            mass += tl.where(gt, e, 0.0)
            if TOTAL:
                total += tl.where(e >= min_p, e, 0.0)
    return tl.sum(cnt, 0), tl.sum(mass, 0), tl.min(above, 0), tl.max(below, 0), tl.sum(total, 0)


@triton.jit
def _bisect(row_ptr, V, lo, min_in, max_in, k, limit, use_k, use_p, m, c, min_p, BLOCK: tl.constexpr,
            MAX_PROBES: tl.constexpr):
    """The cut-off by bisection over the value: the bracket (lo, hi] holds it and its tokens span [min_in,
    max_in]; a probe's value is dropped where top-k (use_k: k tokens above it) or top-p (use_p: their mass
    at least `limit`) drops it. Returns lo, the kept set being {x > lo}."""
    probes = 0
    while (min_in < max_in) & (probes < MAX_PROBES):
        mid = min_in * 0.5 + max_in * 0.5
        mid = tl.where((mid >= max_in) | (mid < min_in), min_in, mid)
        cnt, mass, above, below, _ = _probe(row_ptr, V, mid, m, c, min_p, use_p, False, BLOCK)
        if (use_k & (cnt >= k)) | (use_p & (mass >= limit)):
            lo = mid
            min_in = above
        else:
            max_in = below
        probes += 1
    return lo


@triton.jit
def _top_k_mass(row_ptr, V, k, x0, cnt0, above0, row_min, m, c, min_p, BLOCK: tl.constexpr,
                MAX_PROBES: tl.constexpr):
    """The mass (sum of e) of the tokens top-k and min-p keep, given the probe at x0 (cnt0 tokens above it,
    the smallest of them above0): the top-k cut-off by bisection, as the kept set's (the bracket from the
    probe: above x0 where x0 is dropped, else at most x0), then one pass."""
    lo = float("-inf")
    min_in = row_min
    max_in = x0
    if cnt0 >= k:
        lo = x0
        min_in = above0
        max_in = m
    lo = _bisect(row_ptr, V, lo, min_in, max_in, k, 0.0, True, False, m, c, min_p, BLOCK, MAX_PROBES)
    mass = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        e = tl.exp2((x - m) * c)
        mass += tl.where((x > lo) & (e >= min_p), e, 0.0)
    return tl.sum(mass, 0)


@triton.jit
def _race_above(row_ptr, V, lo, m, c, min_p, key, BLOCK: tl.constexpr):
    """The race's winner over the tokens with x > lo and e >= min_p (at least one), the maximum m known."""
    best_r = 0.0
    best_id = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        e = tl.exp2((x - m) * c)
        keep = (x > lo) & (e >= min_p)
        if tl.max(keep.to(tl.int32), 0) > 0:
            best_r, best_id = _race(tl.where(keep, e, 0.0), key, offs, best_r, best_id)
    return best_id


@triton.jit
def _sample_kernel(logits_ptr, stride, out_ptr, V,
                   temp_ptr, temp_stride, top_k_ptr, top_k_stride, top_p_ptr, top_p_stride,
                   min_p_ptr, min_p_stride, seed_ptr, seed_stride, pos_ptr, pos_stride,
                   BLOCK: tl.constexpr, MAX_PROBES: tl.constexpr, RETRIES: tl.constexpr, LOG2E: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    temperature = tl.load(temp_ptr + row * temp_stride)
    k = tl.load(top_k_ptr + row * top_k_stride).to(tl.int32)
    top_p = tl.load(top_p_ptr + row * top_p_stride)
    min_p = tl.load(min_p_ptr + row * min_p_stride)
    seed = tl.load(seed_ptr + row * seed_stride)
    pos = tl.load(pos_ptr + row * pos_stride)
    random = temperature >= 1e-5
    c = LOG2E / tl.maximum(temperature, 1e-5)
    # the row's hash key, as `seeded_exponential`: only the low 32 bits of the position count
    key = _mix(pos.to(tl.uint32) * 0x9E3779B1 + (seed >> 32).to(tl.uint32), seed.to(tl.uint32))

    # pass 1: the maximum (and its first index, the greedy token) and the race over every token
    m = float("-inf")
    row_min = float("inf")
    first = 0
    best_r = 0.0
    best_id = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        row_min = tl.minimum(row_min, tl.min(tl.where(offs < V, x, float("inf")), 0))
        bmax = tl.max(x, 0)
        if bmax > m:
            first = tl.min(tl.where(x == bmax, offs, V), 0)
            best_r = best_r * tl.exp2((m - bmax) * c)
            m = bmax
        if random:
            e = tl.exp2((x - m) * c)
            if min_p > 0:
                # below min-p of the maximum so far is below it of the row's maximum: never kept
                e = tl.where(e >= min_p, e, 0.0)
            best_r, best_id = _race(e, key, offs, best_r, best_id)
    token = first
    if random:
        use_k = k < V
        use_p = top_p < 1.0
        x0 = tl.load(row_ptr + best_id).to(tl.float32)
        done = tl.exp2((x0 - m) * c) >= min_p
        lo = float("-inf")
        if use_k | use_p:
            # pass 2: is the race's winner kept by top-k and top-p?
            cnt, mass, above, below, total = _probe(row_ptr, V, x0, m, c, min_p, use_p, True, BLOCK)
            if use_k & use_p:
                # top-p of the top-k survivors' mass, which is at least the winner's and all above it when
                # top-k keeps the winner: enough to keep it where its mass above is below top_p of that
                e0 = tl.exp2((x0 - m) * c)
                total = mass + e0
                if (cnt >= k) | (mass >= top_p * total):
                    total = _top_k_mass(row_ptr, V, k, x0, cnt, above, row_min, m, c, min_p, BLOCK, MAX_PROBES)
            limit = top_p * total
            dropped = (use_k & (cnt >= k)) | (use_p & (mass >= limit))
            done = done & ~dropped
            min_in = m
            if dropped:
                lo = x0
                min_in = above
                # step 3: the race over x > lo, whose winner is the kept set's if it is kept
                retries = 0
                while dropped & ~use_k & (retries < RETRIES):
                    best_id = _race_above(row_ptr, V, lo, m, c, min_p, key, BLOCK)
                    x0 = tl.load(row_ptr + best_id).to(tl.float32)
                    cnt, mass, above, below, _ = _probe(row_ptr, V, x0, m, c, min_p, use_p, False, BLOCK)
                    dropped = mass >= limit
                    if dropped:
                        lo = x0
                        min_in = above
                    retries += 1
                done = ~dropped
            if dropped:
                lo = _bisect(row_ptr, V, lo, min_in, m, k, limit, use_k, use_p, m, c, min_p, BLOCK, MAX_PROBES)
        if done:
            token = best_id
        else:
            token = _race_above(row_ptr, V, lo, m, c, min_p, key, BLOCK)
    tl.store(out_ptr + row, tl.minimum(token, V - 1).to(tl.int64))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, filtered: bool = True,
           block: int | None = None) -> torch.Tensor:
    """int64 [rows]: one token per row of `logits` [rows, V] (any float dtype, unit last stride), by the
    per-row parameters (1-D, any stride): temperature float32 (< 1e-5: greedy), top_k integer (>= V: off),
    top_p float32 (1: off), min_p float32 (0: off), seeds and positions int64 (the noise's counter).
    `filtered`: whether any row has top-k or top-p on (the launch shape, not the result, depends on it);
    `block`: columns per step of a pass (a power of two) in place of the shape's."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"sample: logits must be [rows, V] with unit last stride, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    rows, vocab = logits.shape
    expect = {"temperature": (temperature, (torch.float32,)), "top_p": (top_p, (torch.float32,)),
              "min_p": (min_p, (torch.float32,)), "top_k": (top_k, (torch.int32, torch.int64)),
              "seeds": (seeds, (torch.int64,)), "positions": (positions, (torch.int64,))}
    for name, (t, dtypes) in expect.items():
        if t.dim() != 1 or t.shape[0] != rows or t.dtype not in dtypes or t.device != logits.device:
            raise ValueError(f"sample: {name} must be [{rows}] {' or '.join(map(str, dtypes))} on "
                             f"{logits.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    shape_block, warps = FILTER_SHAPE if filtered else RACE_SHAPE
    _sample_kernel[(rows,)](logits, logits.stride(0), out, vocab,
                            temperature, temperature.stride(0), top_k, top_k.stride(0), top_p, top_p.stride(0),
                            min_p, min_p.stride(0), seeds, seeds.stride(0), positions, positions.stride(0),
                            BLOCK=block or shape_block, MAX_PROBES=MAX_PROBES, RETRIES=RETRIES, LOG2E=_LOG2E,
                            num_warps=warps)
    return out
