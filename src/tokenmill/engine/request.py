"""The state of one sequence as the engine sees it."""
from __future__ import annotations

import enum
import time

from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    SWAPPED = 6         # preempted with its KV blocks copied to the CPU swap space (`cpu_block_ids`)

    @property
    def finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ABORTED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


PLACEHOLDER = -1


class Request:
    """One sequence. `all_token_ids` is prompt + output; the first `num_computed_tokens` of them have
    their K/V in the blocks `block_ids` (owned by the block manager).

    While a step is in flight, a token it will sample is already appended as `PLACEHOLDER` (so the next
    step can be scheduled before the value is known, and reads it on the device from row
    `pending_row` of the in-flight step's output). `num_pending` counts such trailing placeholders
    (up to 2: a step may be launched on a placeholder while the one before is in flight); a placeholder
    is never hashed, detokenized or reported."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, seed: int, priority: int = 0, arrival_time: float | None = None,
                 parent_id: str | None = None, index: int = 0, carries_tools: bool = False):
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.seed = seed
        self.priority = priority
        # the request offers the model tools (an agent's step): the priority policy may favour it
        self.carries_tools = carries_tools
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        # the hashes of its leading full blocks, each chaining the one before (the block manager's)
        self.block_hashes: list[int] = []
        # while SWAPPED: the swap-space blocks holding the K/V of its first `num_computed_tokens` tokens
        self.cpu_block_ids: list[int] = []
        self.stop_reason: int | str | None = None
        # per prompt position None or (logprob, rank, top ids, top logprobs), when asked; filled by the engine
        self.prompt_logprobs: list[tuple | None] | None = None
        self.handle = 0                  # the frontend's number of the request, which step reports carry
        # with min_tokens: the end-of-sequence and stop token ids its first min_tokens tokens may not be
        self.min_tokens_ids: list[int] = []
        self.reported_start = False      # its first scheduling was reported
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.num_preemptions = 0
        self.num_pending = 0
        self.pending_row = -1
        # structured output: this sequence's matcher (engine/grammar_bitmask.py), else None
        self.grammar = None
        # thinking_token_budget: this sequence's thinking block and its count (engine/thinking_budget.py), else None
        self.thinking = None

    @property
    def scores_prompt(self) -> bool:
        """It computes its prompt's logprobs: the first sequence of a request that asks for them. The n
        sequences share one prompt, whose logprobs are reported once, so the others score nothing (each
        of n = 128 sequences held its own copy in the engine core) and read the prompt from the prefix cache."""
        return self.index == 0 and self.params.prompt_logprobs is not None

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, counting one still in flight."""
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def done_generating(self) -> bool:
        """No further token may be scheduled: the length limit is reached (counting in-flight ones)."""
        return self.num_output_tokens >= self.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def append_placeholder(self, row: int) -> None:
        self.all_token_ids.append(PLACEHOLDER)
        self.num_pending += 1
        self.pending_row = row

    def resolve(self, position: int, token_id: int) -> None:
        self.all_token_ids[position] = token_id
        self.num_pending -= 1

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
