"""vLLM's `thinking_token_budget` on the engine core's side: at most that many generated tokens inside a
sequence's thinking block, then `</think>` as its next token.

The block is the one the reasoning parsers read (server/reasoning.py), one per output: open from the first
generated token where the prompt leaves one open (`SamplingParams.in_think`; where that is None, the prompt's
last think tag is `<think>`), else opened by a `<think>` as the output's first token. Every generated token
inside it counts, up to its first `</think>`; the tags themselves never count (a `<think>` as the first token
repeats the prompt's opening). Once the count reaches the budget with the block still open, the sequence
must take `</think>` next: its sampler row keeps that one token (`forced_rows`, applied after every other
mask and bias of the row, so the budget wins over allowed_token_ids, bad words and logit_bias). The forced
token is an output token like any other: it counts toward max_tokens, streams, is reported with its logprob
under the model's distribution (logprobs are read before the row's constraints, as vLLM's raw_logprobs),
and ends the block; what follows is free, or the grammar's: a budgeted request's grammar holds the answer
after the same block (`grammar_after_block`; `SequenceGrammar` reads the tags). A grammar that spells the
reasoning out itself is held to the budget too: where it then refuses `</think>`, its request ends as after
any token the grammar refuses.

The state is a function of the output's tokens alone, advanced by the engine as it resolves each token
(`ThinkingBudget.accept`), so it lives on the request and survives a preemption, swapped or recomputed. A
token still in flight when the next step's sampling tensors are built (at most one) is read on the device:
whether the row must close then depends on that token being `<think>`, `</think>` or another.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from tokenmill.engine.tokenizer import think_tag_ids
from tokenmill.sampling_params import SamplingParamError, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from tokenmill.engine.request import Request


def think_tags_unresolved(params: SamplingParams) -> bool:
    """A thinking_token_budget without the think tags it counts by: `resolve_think_tags` needs a tokenizer."""
    return params.thinking_token_budget is not None and params.think_tags is None


def resolve_think_tags(params: SamplingParams, tokenizer) -> SamplingParams:
    """`params` with `think_tags` filled from the tokenizer where a thinking_token_budget needs them (a server
    sets its reasoning parser's); a copy where filled, as `SamplingParams.resolve_bad_words` makes one."""
    if not think_tags_unresolved(params):
        return params
    if tokenizer is None:
        raise SamplingParamError("thinking_token_budget", "thinking_token_budget needs the model's tokenizer, which "
                                 "names the <think> and </think> tokens, and this model has none")
    try:
        tags = think_tag_ids(tokenizer, "thinking_token_budget")
    except ValueError as e:
        raise SamplingParamError("thinking_token_budget", str(e)) from None
    resolved = copy.copy(params)
    resolved.think_tags = tags
    return resolved


def starts_in_think(params: SamplingParams, prompt: list[int]) -> bool:
    """Whether generation starts inside a thinking block: `params.in_think`, else whether the prompt's last
    think tag is `<think>`."""
    if params.in_think is not None:
        return params.in_think
    open_tag, close_tag = params.think_tags
    for token in reversed(prompt):
        if token == open_tag or token == close_tag:
            return token == open_tag
    return False


def grammar_after_block(spec: StructuredOutputsParams | None, think_tags: tuple[int, int], in_think: bool
                        ) -> StructuredOutputsParams | None:
    """A budgeted request's grammar spec: one that names no think tags (offline, completions) holds the answer
    after the block the budget counts, as a server's chat has its grammar read the reasoning parser's block.
    A copy where changed (not revalidated: only the tags differ)."""
    if spec is None or spec.think_tags is not None:
        return spec
    after = copy.copy(spec)
    after.think_tags, after.in_think = think_tags, in_think
    return after


class ThinkingBudget:
    """One sequence's thinking block: whether it is open, and how many tokens it holds so far."""

    __slots__ = ("open_tag", "close_tag", "budget", "thinking", "first", "count")

    def __init__(self, think_tags: tuple[int, int], budget: int, in_think: bool):
        self.open_tag, self.close_tag = think_tags
        self.budget = budget
        self.thinking = in_think     # inside the block
        self.first = True            # the next token is the output's first, which may open the block
        self.count = 0               # the block's tokens so far

    def accept(self, token_id: int) -> None:
        if self.first and token_id == self.open_tag:
            self.thinking = True
        elif self.thinking:
            if token_id == self.close_tag:
                self.thinking = False
            else:
                self.count += 1
        self.first = False

    def must_close(self) -> bool:
        """The next token must be `</think>`: the block is open and holds its budget."""
        return self.thinking and self.count >= self.budget

    def must_close_after(self, token_id: int) -> bool:
        """`must_close` once `token_id` is accepted (this state is left as it is)."""
        if self.first and token_id == self.open_tag:
            return self.budget == 0
        return self.thinking and token_id != self.close_tag and self.count + 1 >= self.budget


def forced_rows(requests: list[Request], device: torch.device, prev_tokens: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The sampler rows of `requests` that must or may have to take `</think>` (`SamplingTensors.forced`):
    their rows, their `</think>` ids and whether each must, on `device`; None where no row may. A row whose
    last token is still in flight is decided on the device, from that token in `prev_tokens` (the sampled
    tokens of the step in flight) against the outcomes the host computed for `<think>`, `</think>` and any
    other token."""
    known: list[tuple[int, int]] = []          # (row, its </think>) of the rows that must close
    # (row, </think>, <think>, its token's row in the step in flight, must close after <think>, after </think>,
    # after any other token)
    waiting: list[tuple[int, int, int, int, bool, bool, bool]] = []
    for i, r in enumerate(requests):
        b = r.thinking
        if b is None:
            continue
        if not r.num_pending:
            if b.must_close():
                known.append((i, b.close_tag))
            continue
        outcomes = (b.must_close_after(b.open_tag), b.must_close_after(b.close_tag), b.must_close_after(-1))
        if any(outcomes):
            waiting.append((i, b.close_tag, b.open_tag, r.pending_row, *outcomes))
    if not known and not waiting:
        return None
    rows, ids = zip(*known, *(w[:2] for w in waiting))
    must = torch.ones(len(known), dtype=torch.bool).to(device, non_blocking=True)
    if waiting:
        if prev_tokens is None:
            raise RuntimeError("thinking budget: a request's last token is in flight but no step in flight samples it")
        columns = list(zip(*waiting))
        close_tags, open_tags, in_flight = (torch.tensor(c, dtype=torch.int64).to(device, non_blocking=True)
                                            for c in columns[1:4])
        if_open, if_close, otherwise = (torch.tensor(c, dtype=torch.bool).to(device, non_blocking=True)
                                        for c in columns[4:])
        token = prev_tokens[in_flight].long()
        must = torch.cat((must, torch.where(token == open_tags, if_open,
                                            torch.where(token == close_tags, if_close, otherwise))))
    return (torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True), must)
