"""A step's prefill chunks trimmed to the CUDA graph below it.

A step with prefill runs in the smallest mixed graph that holds its tokens (`cuda_graphs.MixedSizes`), so a
step of 536 tokens computes 640 rows: from a few hundred tokens on the products are compute-bound, and the
padding rows cost as much as real ones. When the step's tokens are just past a graph's, the scheduler hands
the excess back to the next step instead: `fit_to_graph` trims the prefill chunks to the graph below where
that defers no more tokens than it saves padding rows. A deferred token is computed by a later step at no
more than its own cost, so the trim never costs more rows than it saves; a request it trims computes the
rest of its chunk in the steps after (the next one, unless that is trimmed past the chunks after it).
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Protocol

# the least tokens of a graph a step is trimmed to: below about 300 rows the products (bf16 or FP8, on an
# H100 or H200) are bound by their weights' bytes, not their rows, and padding rows cost little
MIN_FIT_TOKENS = 256


class StepSizes(Protocol):
    tokens: tuple[int, ...]

    def padded(self, tokens: int, seqs: int) -> tuple[int, int] | None: ...


def fit_to_graph(num_new_tokens: list[int], sizes: StepSizes) -> int:
    """Trims the chunks of more than one token in `num_new_tokens` (a step's, one entry a sequence), the last
    first and each to one token at least, so that the step fills the largest graph below it, where the
    tokens this moves to the next step are no more than the padding rows it saves; otherwise changes
    nothing. Returns the tokens trimmed."""
    total, seqs = sum(num_new_tokens), len(num_new_tokens)
    padded = sizes.padded(total, seqs)
    if padded is None or padded[0] == total:
        return 0
    i = bisect_left(sizes.tokens, total) - 1
    below = sizes.tokens[i] if i >= 0 else 0
    # a graph below that holds the step's sequences (so at least one token is left to each)
    if below < MIN_FIT_TOKENS or sizes.padded(below, seqs) != (below, padded[1]):
        return 0
    excess = total - below
    if excess > padded[0] - total:
        return 0
    left = excess
    for i in range(seqs - 1, -1, -1):
        cut = min(num_new_tokens[i] - 1, left)
        num_new_tokens[i] -= cut
        left -= cut
        if left == 0:
            break
    return excess
