"""An engine core without a model, for measuring the serving path alone: `tokenmill serve`'s API server(s),
the pipe and the benchmark client, with the engine's step held at a fixed time.

    FAKE_STEP_MS=8 PYTHONPATH=lab:src tokenmill serve src/tokenmill/assets/tiny --engine-factory fake_engine:make

Every step (at least FAKE_STEP_MS apart, default 8) gives each live request one token, a word of the
model's tokenizer chosen by the request's handle and position, until its max_tokens (16 without one);
there is no queue: every request runs from the step after it arrives, as the real scheduler admits all
that fit. So the engine holds every request the server has handed it, and any request the client keeps
open but the engine does not hold is waiting in the server or the client. `get_stats` reports the counts
that /metrics and the stats log read, the rest zero. With FAKE_STATS_OUT, the steps so far and the rows
(requests) they held are written there as "steps rows" about every second.
"""
from __future__ import annotations

import os
import time

import numpy as np

from tokenmill.engine.step_outputs import StepOutputs


class FakeEngine:
    def __init__(self, config):
        self.model_name = config.model
        self.max_model_len = 4096
        self.tokenizer_path = config.tokenizer or config.model
        self.step_s = float(os.environ.get("FAKE_STEP_MS", "8")) / 1e3
        self.live: dict[int, list] = {}        # handle -> [request id, tokens left, position]
        self.by_id: dict[str, int] = {}
        self.started: list[tuple] = []
        self.next_step = 0.0
        self.prompt_tokens = self.generation_tokens = 0
        self.words = np.arange(300, 2300)     # ids that decode to text in the bundled tokenizer
        self.steps = self.rows = 0
        self.stats_out = os.environ.get("FAKE_STATS_OUT")
        self.last_write = 0.0

    def add_request(self, request_id, prompt, params=None, priority=0, arrival_time=None, handle=None,
                    carries_tools=False):
        max_tokens = getattr(params, "max_tokens", None) or 16
        self.live[handle] = [request_id, max_tokens, 0]
        self.by_id[request_id] = handle
        self.started.append((handle, time.time(), 0))
        self.prompt_tokens += len(prompt)
        return handle

    def _drop(self, request_id) -> None:
        handle = self.by_id.pop(request_id, None)
        self.live.pop(handle, None)

    def abort_request(self, request_ids) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self._drop(rid)

    def stop_sequences(self, sequences) -> None:
        for rid, _ in sequences:
            self._drop(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> StepOutputs:
        wait = self.next_step - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        self.next_step = time.perf_counter() + self.step_s
        handles = np.fromiter(self.live, np.int64, len(self.live))
        positions = np.array([entry[2] for entry in self.live.values()], np.int64)
        tokens = self.words[(handles * 7 + positions) % len(self.words)]
        finished = []
        for j, (handle, entry) in enumerate(list(self.live.items())):
            entry[1] -= 1
            entry[2] += 1
            if entry[1] == 0:
                finished.append((int(handle), 0, "length", None, -1))
                del self.by_id[entry[0]]
                del self.live[handle]
        self.generation_tokens += len(tokens)
        self.steps += 1
        self.rows += len(tokens)
        if self.stats_out and self.next_step - self.last_write > 1.0:
            self.last_write = self.next_step
            with open(self.stats_out + ".tmp", "w") as f:
                f.write(f"{self.steps} {self.rows}\n")
            os.replace(self.stats_out + ".tmp", self.stats_out)
        out = StepOutputs(handles, np.zeros(len(handles), np.int32), tokens.astype(np.int64), self.started,
                          finished)
        self.started = []
        return out

    def get_stats(self) -> dict:
        stats = dict.fromkeys(("num_waiting", "kv_cache_usage", "num_free_blocks", "num_total_blocks",
                               "peak_blocks_used", "prefix_cache_queries", "prefix_cache_hits",
                               "num_preemptions", "num_swapped", "num_cpu_blocks", "num_free_cpu_blocks",
                               "cpu_cache_usage", "swapped_out_blocks", "swapped_in_blocks",
                               "swap_in_cached_blocks", "swap_out_bytes", "swap_in_bytes"), 0)
        stats.update(num_running=len(self.live), prompt_tokens=self.prompt_tokens,
                     generation_tokens=self.generation_tokens)
        return stats

    def shutdown(self) -> None:
        pass


def make(config):
    return FakeEngine(config)
