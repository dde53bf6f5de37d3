"""Which of N data-parallel engine cores a new request goes to: prefix-cache affinity, bounded by load.

Each core has a prefix cache of its own (engine/block_manager.py), so a request whose prompt starts
with blocks another request already sent to core c is cheapest on c. The router keeps its own picture
of that, independent of the cores' hashing: the prompt's full blocks are hashed as a chain (a block's
hash covers its tokens and its parent's hash, so equal hashes mean equal prefixes, up to collisions,
which cost only a worse choice), and a bounded LRU map sends each hash to the core that last received
that prefix. It can be wrong (a core evicts blocks the router still counts): a wrong guess costs a
recomputed prefix, never a wrong answer.
"""
from __future__ import annotations

from collections import OrderedDict

DEFAULT_MAX_ENTRIES = 100_000


def block_hashes(prompt: list[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The chained hashes of the prompt's full blocks (a partial last block is not hashed); a salted
    prompt's chain starts from its salt, as the cores' does, so it has no affinity to another salt's."""
    hashes, parent = [], cache_salt
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = hash((parent, tuple(prompt[start:start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixRouter:
    """Chooses a core per request from its prompt and the cores' loads (sequences in flight to each).

    The rule: the core that last received the longest prefix of the prompt, where that prefix is more
    than half of the prompt's tokens, unless its load exceeds the least-loaded core's by more than
    `max(min_imbalance, imbalance_ratio x that load)`; otherwise the least-loaded core, ties taken in turn
    so that a lightly loaded server still uses every core. Every chosen prompt's blocks are then recorded
    as the chosen core's. A shorter match saves too little prefill to leave a core idle for it: every chat
    prompt of a model whose template starts with a default system prompt shares its first block, and
    with any match counting, up to 9 concurrent chats all ran on one core while the others idled."""

    def __init__(self, num_cores: int, block_size: int, max_entries: int = DEFAULT_MAX_ENTRIES,
                 min_imbalance: int = 8, imbalance_ratio: float = 0.25):
        if num_cores < 1 or block_size < 1 or max_entries < 1:
            raise ValueError(f"num_cores, block_size and max_entries must be >= 1, got "
                             f"{num_cores}, {block_size}, {max_entries}")
        self.num_cores, self.block_size, self.max_entries = num_cores, block_size, max_entries
        self.min_imbalance, self.imbalance_ratio = min_imbalance, imbalance_ratio
        self._owner: OrderedDict[int, int] = OrderedDict()     # block hash -> core, least recent first
        self._turn = 0

    def __len__(self) -> int:
        return len(self._owner)

    def affinity(self, hashes: list[int]) -> tuple[int | None, int]:
        """(core, matched blocks) of the longest recorded prefix of `hashes`; (None, 0) if none."""
        core, matched = None, 0
        owner = self._owner
        for i, h in enumerate(hashes):           # a chain: once a block misses, no longer prefix was recorded
            c = owner.get(h)
            if c is None:
                break
            core, matched = c, i + 1
        return core, matched

    def choose(self, prompt: list[int], loads: list[int], cache_salt: str | None = None) -> int:
        """The core for `prompt` given each core's load; records the prompt's blocks as that core's."""
        hashes = block_hashes(prompt, self.block_size, cache_salt)
        least = min(loads)
        core, matched = self.affinity(hashes)
        if (core is None or 2 * matched * self.block_size <= len(prompt)
                or loads[core] - least > max(self.min_imbalance, self.imbalance_ratio * least)):
            n = self.num_cores
            core = next(c for c in ((self._turn + k) % n for k in range(n)) if loads[c] == least)
            self._turn = (core + 1) % n
        self._record(hashes, core)
        return core

    def _record(self, hashes: list[int], core: int) -> None:
        owner = self._owner
        for h in hashes:
            owner[h] = core
            owner.move_to_end(h)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)
