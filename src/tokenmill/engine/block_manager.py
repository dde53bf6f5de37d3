"""Paged KV-cache block manager with prefix caching.

Invariants (checked by `check_invariants`, exercised by property tests):
- Every block is either in use (ref_count > 0, in at least one request's `block_ids`) or free
  (ref_count == 0, in `free_queue`), never both; ref counts equal the number of requests holding the
  block and are never negative.
- A block is hashed only once it is full of computed tokens whose values are known; its hash chains
  the parent's hash, so equal hashes mean equal prefixes. A hit is still verified against the stored
  tokens and parent hash. The chain starts from a random value of each block manager: Python's hash of a
  tuple of ints is the same in every process, so without it a client could compute a prefix's hashes and
  craft one whose chain collides with another client's prefix (vLLM's CVE-2025-25183). A request with a
  `cache_salt` starts its chain from the root hashed with its salt instead, so requests of different salts
  (or one salted and one not) never share a block, while those of one salt share as any others do.
- `cached` maps a hash to the one block registered under it; a free block that is hashed stays
  reusable until it is evicted. Free blocks are evicted least-recently-freed first (LRU), and a
  request's blocks are freed tail first, so the ends of prefixes go before their beginnings.
- Swap space (`num_cpu_blocks` blocks of host memory, their contents owned by the model runner): a CPU
  block is free or held by exactly one SWAPPED request (`Request.cpu_block_ids`), never shared; a
  request holds GPU blocks or CPU blocks, never both. Swapping out frees the GPU blocks as `free` does,
  so a hashed one stays in the prefix cache with its contents intact until it is reallocated (which
  clears its hash); the runner orders the copy before any reuse. Swapping in takes the request's leading
  blocks that the prefix cache still holds as they are and copies only the others back.
"""
from __future__ import annotations

import os
from collections import OrderedDict

from tokenmill.engine.request import Request


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0):
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        # free CPU blocks: those freed so far, then every id from `_cpu_next` on (never used), so that a
        # swap space of millions of blocks costs nothing to set up
        self._cpu_free: list[int] = []
        self._cpu_next = 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}
        self.root_hash = int.from_bytes(os.urandom(8), "little")     # the first block's parent
        self.prefix_queries = 0                        # tokens looked up
        self.prefix_hits = 0                           # tokens found
        self.peak_blocks_used = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free) + self.num_cpu_blocks - self._cpu_next

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of the request's tokens. At least one token is always left
        to compute, so the last step has logits to sample from."""
        if not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        return self._cached_prefix(tokens, (len(tokens) - 1) // self.block_size, self._root(request))

    def _root(self, request: Request) -> int:
        """The parent hash of the request's first block: the manager's root, mixed with its salt if it has one."""
        salt = request.params.cache_salt
        return self.root_hash if salt is None else hash((self.root_hash, salt))

    def record_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Counts one admitted request's lookup (its tokens, those the cache held): a request that waits
        for blocks is looked up again each step, and counted once, when it is admitted."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_cached

    def _cached_prefix(self, tokens: list[int], max_blocks: int, root: int) -> list[int]:
        """The cached blocks holding `tokens`' first full blocks, at most `max_blocks` of them, in the chain
        that starts from `root` (`_root`)."""
        bs = self.block_size
        hits: list[int] = []
        parent = root
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash((parent, chunk))
            bid = self.cached.get(h)
            if bid is None:
                break
            block = self.blocks[bid]
            if block.token_ids != chunk or block.parent_hash != parent:
                break
            hits.append(bid)
            parent = h
        return hits

    # ---- allocation ------------------------------------------------------------------------------
    def _take_cached(self, request: Request, block_ids: list[int]) -> None:
        """Adds a reference of `request` to each cached block (out of the free queue if none held it) and
        records its hash among the request's."""
        hashes = request.block_hashes
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_queue[bid]
            block.ref_count += 1
            hashes.append(block.block_hash)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Makes room for `num_new_tokens` more tokens after `request.num_computed_tokens` (plus the
        tokens of `computed_blocks`, prefix-cache hits for a request that holds no blocks yet).
        Returns False, changing nothing, when there are not enough free blocks."""
        if not computed_blocks and \
                request.num_computed_tokens + num_new_tokens <= len(request.block_ids) * self.block_size:
            return True     # the common decode step: the last block still has room
        computed_blocks = computed_blocks or []
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        needed = self.blocks_needed(num_tokens) - len(request.block_ids) - len(computed_blocks)
        reclaimed = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if needed > len(self.free_queue) - reclaimed:
            return False
        if computed_blocks:
            self._take_cached(request, computed_blocks)
            request.block_ids.extend(computed_blocks)
        for _ in range(max(needed, 0)):
            request.block_ids.append(self._take_free_block())
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_used_blocks)
        return True

    def _take_free_block(self) -> int:
        """The least recently freed block, evicted from the prefix cache, with ref_count 1."""
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == bid:
                del self.cached[block.block_hash]
            block.block_hash = block.parent_hash = block.token_ids = None
        block.ref_count = 1
        return bid

    # ---- swap space --------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return 0 < len(request.block_ids) <= self.num_free_cpu_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Gives the request CPU blocks for all its GPU blocks and frees the GPU ones. Returns the copies
        to make, (GPU block, CPU block) pairs. A block shared with other holders stays theirs (it is full,
        so its copy is exact), until they free it too."""
        n = len(request.block_ids)
        cpu = [self._cpu_free.pop() for _ in range(min(n, len(self._cpu_free)))]
        fresh = n - len(cpu)
        cpu += range(self._cpu_next, self._cpu_next + fresh)
        self._cpu_next += fresh
        pairs = list(zip(request.block_ids, cpu))
        self.free(request)
        request.cpu_block_ids = cpu
        return pairs

    def can_swap_in(self, request: Request, reserved: int) -> bool:
        """Its blocks fit, and so does the slot of its next token, beside `reserved` free blocks kept for the
        next-token slots of requests swapped in before it: a request that came back only to be preempted
        again by its own first step would move its blocks twice for nothing. (Conservative: blocks found
        in the prefix cache at swap-in need no free block, or one that this counts.)"""
        need = max(len(request.cpu_block_ids), self.blocks_needed(request.num_computed_tokens + 1))
        return need + reserved <= len(self.free_queue)

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Gives a SWAPPED request GPU blocks for its CPU blocks and frees those (their copies are queued
        before any later copy that could overwrite them). Its first blocks that the prefix cache still
        holds (its own, freed at swap-out and not reallocated since, or a prompt prefix shared with other
        requests) are taken as they are, without a copy, as `allocate_slots` takes prefix hits; the others
        are fresh blocks. Returns the copies to make, (CPU block, GPU block) pairs."""
        cpu = request.cpu_block_ids
        hits = []
        if self.enable_prefix_caching:
            full = min(len(cpu), request.num_computed_tokens // self.block_size)
            hits = self._cached_prefix(request.all_token_ids, full, self._root(request))
        self._take_cached(request, hits)
        pairs = [(c, self._take_free_block()) for c in cpu[len(hits):]]
        request.block_ids = hits + [g for _, g in pairs]
        self._free_cpu(request)
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_used_blocks)
        return pairs

    def _free_cpu(self, request: Request) -> None:
        self._cpu_free.extend(request.cpu_block_ids)
        request.cpu_block_ids = []

    def cache_full_blocks(self, request: Request) -> None:
        """Hashes the request's blocks that became full of computed tokens whose values are known: a
        block that ends in a token still in flight (a placeholder) waits for a later call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = request.block_hashes
        full = min(request.num_computed_tokens, request.num_tokens - request.num_pending) // bs
        if len(hashes) >= full:
            return
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else self._root(request)
        for i in range(len(hashes), full):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash((parent, chunk))
            hashes.append(h)
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is None and h not in self.cached:
                block.block_hash, block.parent_hash, block.token_ids = h, parent, chunk
                self.cached[h] = block.block_id
            parent = h

    def free(self, request: Request) -> None:
        """Returns every block the request holds, GPU or CPU."""
        if request.cpu_block_ids:
            self._free_cpu(request)
        for bid in reversed(request.block_ids):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[bid] = None
        request.block_ids = []
        request.block_hashes = []

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_count == 0 and block.block_hash is not None:
                block.block_hash = block.parent_hash = block.token_ids = None
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].block_hash == h}

    def check_invariants(self, requests: list[Request]) -> None:
        holders = [0] * self.num_blocks
        for req in requests:
            for bid in req.block_ids:
                holders[bid] += 1
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} but held {holders[block.block_id]} times")
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), (
                f"block {block.block_id}: ref_count {block.ref_count}, in free queue: "
                f"{block.block_id in self.free_queue}")
        for h, bid in self.cached.items():
            assert self.blocks[bid].block_hash == h, f"cached hash of block {bid} is stale"
        # CPU ids below `_cpu_next` have been used: each is now held by one request or in `_cpu_free`
        held = [c for req in requests for c in req.cpu_block_ids]
        free = self._cpu_free
        assert not any(req.cpu_block_ids and req.block_ids for req in requests), "a request holds GPU and CPU blocks"
        assert len(set(held)) == len(held), "a CPU block is held twice"
        assert len(set(free)) == len(free), "a CPU block is free twice"
        assert all(0 <= c < self._cpu_next for c in held + free), "a CPU block id out of range"
        assert not set(free) & set(held), "a CPU block is both free and held"
        assert len(held) + len(free) == self._cpu_next, (
            f"CPU blocks leaked: {len(held)} held + {len(free)} free of {self._cpu_next} used")
