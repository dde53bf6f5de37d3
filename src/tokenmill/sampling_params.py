"""Per-request sampling parameters, validated on construction (vLLM's names and meanings)."""
from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamError(ValueError):
    """A sampling parameter out of its range; `param` names it (the OpenAI error's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16         # None: up to the model's context length
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None         # number of top alternatives per token (0: the sampled one only)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (vLLM's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self):
        def bad(name, value, limit):
            raise SamplingParamError(name, f"{name} must be {limit}, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, ">= 1")
        if self.temperature < 0:
            bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k < 0:
            bad("top_k", self.top_k, "0 or -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", self.repetition_penalty, "> 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", self.logprobs, "in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", self.prompt_logprobs, "in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", self.seed, "an integer")
        if any(not s for s in self.stop):
            bad("stop", self.stop, "a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
