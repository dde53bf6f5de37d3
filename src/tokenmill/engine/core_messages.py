"""What an engine core and its clients say over their pipe (`core_proc`, `core_client`, `async_engine`): the
commands a client sends, a list a message, and the core's answers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.step_outputs import StepOutputs


# Commands, client -> core (each message is a list of them).
@dataclass
class AddRequest:
    request_id: str
    prompt: list[int]
    params: Any
    priority: int = 0
    arrival_time: float | None = None
    handle: int = 0                 # the number by which reports name the request (see `_Client`)
    carries_tools: bool = False


@dataclass
class StopSequences:
    sequences: list[tuple[str, int]]     # (request id, index): a stop string ended them in the client


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass                            # the client leaves; the core stops once every client has


# Messages, core -> client.
@dataclass
class CoreReady:
    model_name: str
    max_model_len: int
    tokenizer_path: str | None      # where the client loads the tokenizer from; None: the model has none
    pid: int
    vocab_size: int | None = None
    # the engine's --scheduling-policy, by which a frontend refuses a priority before it answers (None: an engine
    # that has none, which refuses or ignores priorities itself)
    scheduling_policy: str | None = None


@dataclass
class CoreUpdate:
    outputs: StepOutputs | None = None
    errors: list[tuple[str, str, str | None]] = field(default_factory=list)   # (request_id, message, param)
    # requests the core could not take now, to be retried (a 503): (request_id, message)
    busy: list[tuple[str, str]] = field(default_factory=list)
    stats: dict | None = None
    time: float = 0.0


@dataclass
class CoreFatal:
    message: str
