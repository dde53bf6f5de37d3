"""Continuous-batching scheduler: one loop over `num_computed_tokens`.

Each step gives every scheduled request a number of new tokens to compute: the rest of its known
tokens (prompt, or prompt + outputs after a preemption) capped by the step's token budget. A decode
is simply 1 new token; a long prompt is split over several steps (chunked prefill) without a separate
phase. Running requests are served first, then waiting ones are admitted while the budget, the
sequence cap and the free blocks allow.

Policies: `fcfs` orders by arrival; `priority` orders by `priority` (lower is served first, as in
vLLM) minus an aging credit for time spent waiting, so no request starves. When blocks run out, the
running request that the policy ranks last is preempted: its blocks are freed and it is recomputed
later (its tokens so far become its prompt for the recomputation).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs", aging_per_second: float = 1.0):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.aging_per_second = aging_per_second
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue management ---------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Removes a request from whichever queue holds it and frees its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished and request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.finished_time = time.time()
        self.block_manager.free(request)

    def _rank(self, request: Request, now: float) -> tuple:
        """Smaller ranks are served first and preempted last."""
        if self.policy == "priority":
            return (request.priority - self.aging_per_second * (now - request.arrival_time),
                    request.arrival_time)
        return (request.arrival_time,)

    # ---- the step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.time()
        if self.policy == "priority":
            self.running.sort(key=lambda r: self._rank(r, now))

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.done_generating or req.num_tokens >= self.max_model_len:
                i += 1      # its last token is in flight; the engine finishes it when it lands
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(req, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.requests.append(req)
                out.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
                continue
            break   # req itself was preempted: everything after it is gone as well

        if not out.preempted:
            if self.policy == "priority":
                self.waiting.sort(key=lambda r: self._rank(r, now))
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                computed = []
                if req.num_computed_tokens == 0 and req.params.prompt_logprobs is None:
                    # a request scoring its prompt computes all of it (cached blocks have no logits)
                    computed = self.block_manager.get_computed_blocks(req)
                num_cached = len(computed) * self.block_manager.block_size
                num_new = min(req.num_tokens - req.num_computed_tokens - num_cached, budget)
                if not self.block_manager.allocate_slots(req, num_new, computed):
                    break
                self.waiting.pop(0)
                if req.status == RequestStatus.WAITING:
                    req.num_cached_tokens = num_cached
                req.num_computed_tokens += num_cached
                req.status = RequestStatus.RUNNING
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                self.running.append(req)
                out.requests.append(req)
                out.num_new_tokens.append(num_new)
                budget -= num_new
        return out

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, request)
        out.preempted.append(request)

    def update_after_step(self, out: SchedulerOutput, sample_rows=()) -> None:
        """Advances `num_computed_tokens` of the scheduled requests and hashes their full blocks; each
        request of `sample_rows` (rows of `out.requests` that the launched step samples, in its order)
        gets a placeholder for its token (`Request.append_placeholder`), resolved once the step is read."""
        for j, row in enumerate(sample_rows):
            out.requests[row].append_placeholder(j)
        for req, n in zip(out.requests, out.num_new_tokens):
            req.num_computed_tokens += n
            self.block_manager.cache_full_blocks(req)
