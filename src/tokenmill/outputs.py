"""What the engine returns: cumulative outputs per request, in vLLM's shape."""
from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int                       # 1 = most likely under the model
    decoded_token: str | None = None


class FlatLogprobs(Sequence):
    """The logprob entries of a run of tokens, read as vLLM's list of `dict[int, Logprob] | None` (a
    position's token at its rank, then the most likely ones, ranks 1, 2, ...) but held as flat arrays: an API
    server's request may hold millions of entries, which as objects took the event loop ~0.1 s a 1,000
    prompt tokens to build and made every full garbage collection walk them (~220 ms each for n = 128 x
    200 tokens x 21). A position's dict is built when it is read, where a response is encoded.

    Position i's ids and logprobs are `[starts[i], starts[i + 1])` of the flat arrays, its own token's
    first; rank 0 marks a position with no entry (None: a prompt's first token)."""
    __slots__ = ("_starts", "_ranks", "_token_ids", "_logprobs", "_token_text")

    def __init__(self, token_text: Callable[[int], str | None] | None = None):
        self._starts = array("q", [0])
        self._ranks = array("q")
        self._token_ids = array("q")
        self._logprobs = array("d")
        self._token_text = token_text     # a token's decoded_token, looked up as entries are built

    def append(self, token: int, logprob: float, rank: int, top_ids: Sequence[int], top_logprobs: Sequence[float]
               ) -> None:
        ids, values = self._token_ids, self._logprobs
        ids.append(token)
        ids.extend(top_ids)
        values.append(logprob)
        values.extend(top_logprobs)
        self._ranks.append(rank)
        self._starts.append(len(ids))

    def append_none(self) -> None:
        self._ranks.append(0)
        self._starts.append(len(self._token_ids))

    def __len__(self) -> int:
        return len(self._ranks)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._entry(j) for j in range(*i.indices(len(self._ranks)))]
        return self._entry(range(len(self._ranks))[i])

    def __iter__(self):
        return (self._entry(j) for j in range(len(self._ranks)))

    def _entry(self, i: int) -> dict[int, Logprob] | None:
        rank = self._ranks[i]
        if rank == 0:
            return None
        a, b = self._starts[i], self._starts[i + 1]
        ids, values = self._token_ids[a:b], self._logprobs[a:b]
        text = self._token_text or (lambda _: None)
        entry = {ids[0]: Logprob(values[0], rank, text(ids[0]))}
        for r in range(1, len(ids)):
            if ids[r] not in entry:
                entry[ids[r]] = Logprob(values[r], r, text(ids[r]))
        return entry


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # per generated token: sampled token + top alternatives (`FlatLogprobs` in an API server, lists from `LLM`)
    logprobs: list[dict[int, Logprob]] | FlatLogprobs | None
    finish_reason: str | None = None            # "stop" | "length" | "abort"
    stop_reason: int | str | None = None        # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # with SamplingParams.prompt_logprobs: per prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[dict[int, Logprob] | None] | FlatLogprobs | None = None
    extra: dict = field(default_factory=dict)
