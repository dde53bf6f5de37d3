"""What one engine-core step reports: the new token of each sequence that sampled, and the rare events.

This is all that crosses from the core to its frontend (the `OutputProcessor`, in the API server process
or beside the offline engine): token ids as three parallel NumPy arrays (no per-request objects, no text,
nothing cumulative), so the cost of a step's report grows with the tokens it made, never with the
lengths of the requests. Text, stop strings, logprob text and the cumulative outputs are the frontend's.
"""
from __future__ import annotations

import numpy as np

# vLLM's bounds for the tokens of one engine step: the core counts its steps into them (its stats) and
# the frontend renders them (engine/metrics.py); here because neither side may import the other (the
# core has no prometheus_client on a bare GPU machine, the API server no torch)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

_EMPTY_I64 = np.zeros(0, np.int64)
_EMPTY_I32 = np.zeros(0, np.int32)


class StepOutputs:
    """`handles[j]`, `indexes[j]`, `tokens[j]`: sequence `indexes[j]` of request `handles[j]` (the
    frontend's number for it) sampled `tokens[j]`, in the order the sequence made them.

    Events, each a list of tuples:
      started:         (handle, first scheduled time, prompt tokens served from the prefix cache)
      finished:        (handle, index, finish reason "stop" | "length", stop token id or None, the row j of
                       a last token that is not text (an end-of-sequence or stop token id ended the
                       sequence) or -1); the sequence's tokens of the same report come first
      logprobs:        {j: (logprobs of the token then the top k, their token ids, the token's rank)},
                       for the rows whose request asked
      prompt_logprobs: (handle, per prompt position None or (logprob, rank, top ids, top logprobs))
    """

    __slots__ = ("handles", "indexes", "tokens", "started", "finished", "logprobs", "prompt_logprobs")

    def __init__(self, handles=_EMPTY_I64, indexes=_EMPTY_I32, tokens=_EMPTY_I64, started=None, finished=None,
                 logprobs=None, prompt_logprobs=None):
        self.handles, self.indexes, self.tokens = handles, indexes, tokens
        self.started = started or []
        self.finished = finished or []
        self.logprobs = logprobs or {}
        self.prompt_logprobs = prompt_logprobs or []

    def __bool__(self) -> bool:
        return bool(len(self.tokens) or self.started or self.finished)

    def split(self, num_clients: int) -> list[StepOutputs]:
        """The report as each of `num_clients` frontends sees it: client c owns the handles h with
        h % num_clients == c (each allocates its handles so). Rows keep their order; the row numbers in
        `logprobs` and `finished` are renumbered into each part. The token arrays are split by NumPy
        masks; only the events (a few per request, not per token) are looped over."""
        owner = self.handles % num_clients
        rows = [np.flatnonzero(owner == c) for c in range(num_clients)]
        # a row's number within its own part
        local = np.empty(len(owner), np.int64)
        for r in rows:
            local[r] = np.arange(len(r))
        parts = [StepOutputs(self.handles[r], self.indexes[r], self.tokens[r]) for r in rows]
        for event in self.started:
            parts[event[0] % num_clients].started.append(event)
        for handle, index, reason, stop_reason, row in self.finished:
            parts[handle % num_clients].finished.append(
                (handle, index, reason, stop_reason, int(local[row]) if row >= 0 else -1))
        for row, entry in self.logprobs.items():
            parts[int(owner[row])].logprobs[int(local[row])] = entry
        for event in self.prompt_logprobs:
            parts[event[0] % num_clients].prompt_logprobs.append(event)
        return parts


class StepOutputsBuilder:
    """Gathers one step's report as it is processed (possibly over two processed steps)."""

    __slots__ = ("handles", "indexes", "tokens", "started", "finished", "logprobs", "prompt_logprobs")

    def __init__(self):
        self.handles: list[int] = []
        self.indexes: list[int] = []
        self.tokens: list[int] = []
        self.started: list[tuple] = []
        self.finished: list[tuple] = []
        self.logprobs: dict[int, tuple] = {}
        self.prompt_logprobs: list[tuple] = []

    def token(self, handle: int, index: int, token: int, logprobs: tuple | None = None) -> None:
        if logprobs is not None:
            self.logprobs[len(self.tokens)] = logprobs
        self.handles.append(handle)
        self.indexes.append(index)
        self.tokens.append(token)

    def build(self) -> StepOutputs:
        if not self.tokens:
            return StepOutputs(started=self.started, finished=self.finished,
                               prompt_logprobs=self.prompt_logprobs)
        return StepOutputs(np.array(self.handles, np.int64), np.array(self.indexes, np.int32),
                           np.array(self.tokens, np.int64), self.started, self.finished, self.logprobs,
                           self.prompt_logprobs)
