"""A constrained sequence's grammar as the engine steps it, and one step's grammar bitmask.

`SequenceGrammar` is one sequence's matcher, made from a compiled grammar by
`StructuredOutputManager.sequence_grammar` (structured_output.py): it accepts the sequence's tokens and fills
its row of allowed-token bits, each fill's host CPU time held to MAX_FILL_SECONDS. Nothing here imports
xgrammar: the matcher comes built.

Each step, the sampler asks `BatchBitmask` for the bitmask of the rows that are constrained: packed
allowed-token bits filled on the host after the forward pass is launched (so the fill overlaps the device's
work), copied to the device and applied to those rows only; the other rows' logits are untouched.
Invariant: a constrained sequence's previous token has been accepted before its next mask is filled; the
engine processes every step holding a constrained sequence before it launches the next one.

A row whose grammar, with its request's allowed_token_ids and bad words, leaves no token to sample would draw
token 0 from a row of -inf (the sampler's fallback), which the grammar refuses: the fill notes it
(`no_token`) and the engine fails the request before it reads that token.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tokenmill.engine.request import Request

# One sequence's grammar may take at most this much host CPU time to compute one token's allowed tokens
# (`SequenceGrammar.fill`). Fills run inside the engine step, so every other request waits on them. A JSON
# schema's or a regex's fill takes well under a millisecond even on a 150k vocabulary; an ambiguous grammar
# (root ::= (x | x x)* with x matching one text in several ways) grows its parse with every token, and its
# fill with it (an 8k vocabulary, "a" after "a": 50 ms at token 20, 2.5 s at token 100) until the server
# stalls. A sequence whose fill takes longer fails (`slow_fill`); sane grammars stay far below it.
MAX_FILL_SECONDS = 0.1


class SequenceGrammar:
    """One sequence's position in its grammar. The matcher terminates once it accepts a stop token (EOS),
    which it allows only where the grammar is complete. With `think_tags` the grammar starts after the
    output's thinking block (`StructuredOutputsParams`): every token is free until `</think>` where the
    block is open (`in_think`), and the first token may open one with `<think>`, unless the grammar itself
    begins with `<think>` (a client's regex or grammar that spells out the reasoning governs it too)."""

    __slots__ = ("matcher", "keep", "open_tag", "close_tag", "thinking", "first", "accepted", "slow_fill",
                 "no_token", "allowed_ids")

    def __init__(self, matcher, keep: torch.Tensor | None = None, think_tags: tuple[int, int] | None = None,
                 in_think: bool = False):
        self.matcher = matcher
        self.keep = keep            # [W] int32: bits of the tokens this kind of output may ever hold
        self.open_tag, self.close_tag = think_tags or (None, None)
        self.thinking = think_tags is not None and in_think       # inside the block: the grammar waits
        self.first = think_tags is not None and not in_think      # the next token may open a block
        self.accepted = 0           # the sequence's tokens so far
        self.slow_fill = None       # (seconds, tokens accepted before it) of a fill over MAX_FILL_SECONDS
        # (tokens accepted before it, the grammar's tokens its request rules out: `no_token_left`) of a fill
        # that left no token to sample
        self.no_token = None
        self.allowed_ids = None     # its request's allowed_token_ids as an int64 array, made by the first fill

    def accept(self, token_id: int) -> bool:
        self.accepted += 1
        if self.thinking:
            self.thinking = token_id != self.close_tag
            return True
        if self.first:
            self.first = False
            if token_id == self.open_tag:
                self.thinking = True
                return True
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return not self.thinking and self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Fills the row's allowed-token bits; False where it allows every token, the matcher unasked."""
        if self.thinking or self.matcher.is_terminated():
            # thinking: any token; terminated while its next step was in flight: that token is dropped
            bitmask[row] = -1
            return False
        # the thread's CPU time: a fill descheduled on a busy host is not charged for the wait
        t0 = time.thread_time()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        seconds = time.thread_time() - t0
        if seconds > MAX_FILL_SECONDS and self.slow_fill is None:
            self.slow_fill = (seconds, self.accepted)
        if self.keep is not None:
            bitmask[row] &= self.keep
        if self.first:
            word, bit = divmod(self.open_tag, 32)
            if (int(bitmask[row, word]) >> bit) & 1:
                self.first = False          # the grammar begins with <think>: it holds the reasoning too
            else:
                bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)     # int32: bit 31 is the sign
        return True


class BatchBitmask:
    """The allowed tokens of one step's constrained rows: `rows` (sampler rows) and their requests, whose
    grammars fill them and note a row that leaves its request no token (`no_token_left`). `apply` fills the
    packed bitmask [len(rows), ceil(vocab / 32)] int32 on the host and masks those rows."""

    def __init__(self, rows: list[int], requests: list[Request], vocab_size: int, device: torch.device):
        self.requests = requests
        self.vocab_size = vocab_size
        self.rows = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)

    @staticmethod
    def from_requests(requests: list[Request], vocab_size: int, device: torch.device) -> "BatchBitmask | None":
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        return BatchBitmask(rows, [requests[i] for i in rows], vocab_size, device)

    def host_bitmask(self) -> torch.Tensor:
        bitmask = torch.empty((len(self.requests), -(-self.vocab_size // 32)), dtype=torch.int32)
        words = bitmask.numpy().view(np.uint32)
        for i, req in enumerate(self.requests):
            g = req.grammar
            if g.fill(bitmask, i) and (req.params.allowed_token_ids is not None or req.params.bad_words_token_ids):
                if g.allowed_ids is None and req.params.allowed_token_ids is not None:
                    g.allowed_ids = np.asarray(req.params.allowed_token_ids, dtype=np.int64)
                ruled_out = no_token_left(words[i], req, g.accepted, g.allowed_ids)
                if ruled_out is not None and g.no_token is None:
                    g.no_token = (g.accepted, ruled_out)
        return bitmask

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [S, V] float with the tokens each constrained row's grammar forbids at -inf (a new
        tensor; the input is left as it was)."""
        bitmask = self.host_bitmask()
        if logits.is_cuda:
            bitmask = bitmask.pin_memory()
        bitmask = bitmask.to(logits.device, non_blocking=True)
        allowed = unpack_bitmask(bitmask, logits.shape[-1])
        masked = logits[self.rows].masked_fill(~allowed, float("-inf"))
        return logits.index_put((self.rows,), masked)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32, bit j of word w set where token 32 w + j is allowed -> [R, vocab_size] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def no_token_left(words: np.ndarray, req: Request, position: int, allowed: np.ndarray | None) -> list[int] | None:
    """None where a row whose grammar allows the tokens of `words` ([W] uint32, packed as the bitmask's) leaves
    `req` a token to sample at output `position`; else the grammar's tokens that its allowed_token_ids
    (`allowed`, as an array) let through and its bad words ban there (none: the grammar allows none of
    allowed_token_ids). Bit tests of allowed_token_ids and of the bad words' banned tokens; a row without
    allowed_token_ids whose grammar allows a banned token is scanned, its W words, for another."""
    banned = bad_words_at(req, position)
    if allowed is not None:
        through = allowed[((words[allowed >> 5] >> (allowed & 31).astype(np.uint32)) & 1).astype(bool)]
        left = through[~np.isin(through, list(banned))] if banned else through
        return None if len(left) else sorted(set(through.tolist()))
    hits = sorted(t for t in banned if (int(words[t >> 5]) >> (t & 31)) & 1)
    if not hits:
        return None
    rest = words.copy()
    for t in hits:
        rest[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    return None if rest.any() else hits


def bad_words_at(req: Request, position: int) -> set[int]:
    """The tokens `req`'s bad words ban at output `position`, by the sampler's rule (`sampling_tensors._bad_words`):
    each word's last token where the output's first `position` tokens end with the rest of the word. The host's
    view, for where those tokens are all known: a grammar's fill (it has accepted them) and a step's read."""
    tokens, end = req.all_token_ids, req.num_prompt_tokens + position
    return {w[-1] for w in req.params.bad_words_token_ids or ()
            if len(w) - 1 <= position and tokens[end - len(w) + 1:end] == w[:-1]}
