"""What the engine returns: cumulative outputs per request, in vLLM's shape."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)          # one per logprob entry: a request may hold millions
class Logprob:
    logprob: float
    rank: int                       # 1 = most likely under the model
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None   # per generated token: sampled token + top alternatives
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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    extra: dict = field(default_factory=dict)
