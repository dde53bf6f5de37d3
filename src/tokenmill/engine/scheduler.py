"""Continuous-batching scheduler: one loop over `num_computed_tokens`.

Each step gives every scheduled request a number of new tokens to compute: the rest of its known
tokens (prompt, or prompt + outputs after a preemption) capped by the step's token budget. A decode
is simply 1 new token; a long prompt is split over several steps (chunked prefill) without a separate
phase. Running requests are served first, then waiting ones are admitted while the budget, the
sequence cap and the free blocks allow. When blocks run out, the running request that the policy ranks
last is preempted, in one of two ways (`preemption_mode`):
- swap: its blocks are copied to CPU swap space (`SchedulerOutput.swap_out`, made by the runner before
  any of those GPU blocks is written again) and it waits in `swapped`, keeping `num_computed_tokens`.
  Swapped requests resume before any waiting prompt is admitted, best ranked first, as soon as their
  blocks and the slot of their next token fit (`SchedulerOutput.swap_in`); a resumed request joins the
  running batch from the next step on, so that its copy back overlaps a step of the others instead of
  holding that step up. A request whose blocks do not fit in the free swap space is recomputed instead
  (and one whose last token is in flight is not swapped: it finishes when that token lands);
- recompute: its blocks are freed and it is recomputed later (its tokens so far become its prompt for
  the recomputation).
A preempted request's token in flight (a placeholder) has no K/V yet and is not among its computed
tokens, so either way it is computed once the request runs again.

Policies: `fcfs` orders by arrival. `priority` orders by the rank

    priority - tool_boost * carries_tools - short_boost * (max_tokens <= short_max_tokens)
             - aging_per_second * seconds since arrival

(lower is served first and preempted last, as vLLM's `priority`; ties go to the earlier arrival). Nothing
starves: two requests age at the same rate, so the gap between their ranks is fixed when the second
arrives. A request A (priority p_A, arrived at t_A) therefore ranks ahead of every request N that arrives
after t_A + (p_A - p_N + tool_boost + short_boost) / aging_per_second, whatever N's boosts. Only the
requests that arrive before that time can be served ahead of A; each of them finishes (its max_tokens is
bounded), and a preempted request keeps its arrival time and so the credit it has earned.

Two optional controls shape the steps (both off by default, and then the schedule is as without them):
- a batching window (`delay_factor` F, vLLM's `--scheduler-delay-factor`): while a step runs other
  requests, new prompts wait until the oldest waiting one has waited F times the last step's time, so
  that prompts arriving close together share one prefill;
- a latency target (`target_itl_ms`): `step_time.LatencyTarget` caps the prefill tokens and the number of
  running sequences so that each step's predicted time stays under the target.
Both read the step times that the engine reports through `observe_step`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.step_time import LatencyTarget

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # (GPU block, CPU block) copies of the requests swapped out this step, and (CPU block, GPU block)
    # copies of those swapped back in; the runner makes them before this step's forward may need them
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # the GPU blocks released by this step's swap-outs that requests of this step took: this step's forward
    # may write them, so it waits for their copies (and the next step for the others)
    swap_out_reused: list[int] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs", aging_per_second: float = 1.0, *,
                 tool_boost: float = 5.0, short_boost: float = 2.0, short_max_tokens: int = 100,
                 delay_factor: float = 0.0, target_itl_ms: float | None = None,
                 preemption_mode: str | None = None, clock: Callable[[], float] = time.time):
        """`clock` gives the time on the scale of `Request.arrival_time` (wall-clock seconds).
        `preemption_mode` None: swap when the block manager has swap space, else recompute."""
        if preemption_mode is None:
            preemption_mode = "swap" if block_manager.num_cpu_blocks > 0 else "recompute"
        if preemption_mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {preemption_mode!r}")
        self.preemption_mode = preemption_mode
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.aging_per_second = aging_per_second
        self.tool_boost = tool_boost
        self.short_boost = short_boost
        self.short_max_tokens = short_max_tokens
        self.delay_factor = delay_factor
        self.latency = None if target_itl_ms is None else LatencyTarget(target_itl_ms / 1000.0)
        self.clock = clock
        self.last_step_seconds = 0.0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.num_preemptions = 0
        self.num_swap_outs = 0              # preemptions that swapped (the others recomputed)
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_swap_in_cached_blocks = 0     # blocks a swap-in found in the prefix cache: no copy
        self._first_sequences: dict[str, Request] = {}   # n > 1: parent id -> its first sequence, computing the prompt

    @classmethod
    def from_config(cls, config: EngineConfig, block_manager: BlockManager, max_model_len: int) -> Scheduler:
        return cls(block_manager, config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                   config.scheduling_policy, config.priority_aging_per_second,
                   tool_boost=config.priority_tool_boost, short_boost=config.priority_short_boost,
                   short_max_tokens=config.priority_short_max_tokens,
                   delay_factor=config.scheduler_delay_factor, target_itl_ms=config.target_itl_ms,
                   preemption_mode=config.preemption_mode)

    # ---- queue management ---------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Removes a request from whichever queue holds it and frees its blocks (GPU or swap space)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif not request.status.finished and request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.finished_time = self.clock()
        self.block_manager.free(request)
        if self._first_sequences.get(request.parent_id) is request:
            del self._first_sequences[request.parent_id]

    def observe_step(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        """The engine's report of a finished step: its tokens (all of `SchedulerOutput.total_tokens`), its
        sequences (`len(SchedulerOutput.requests)`) and the seconds it took as its requests saw it."""
        self.last_step_seconds = seconds
        if self.latency is not None:
            self.latency.observe(num_tokens, num_seqs, seconds)

    def _rank(self, request: Request, now: float) -> tuple:
        """Smaller ranks are served first and preempted last."""
        if self.policy == "priority":
            credit = self.aging_per_second * (now - request.arrival_time)
            if request.carries_tools:
                credit += self.tool_boost
            if request.max_tokens <= self.short_max_tokens:
                credit += self.short_boost
            return (request.priority - credit, request.arrival_time)
        return (request.arrival_time,)

    # ---- the step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = self.clock()
        if self.policy == "priority":
            self.running.sort(key=lambda r: self._rank(r, now))

        # latency target: the tokens this step may compute beyond one per running sequence go to prefill
        # chunks; a decode is never held back by it, and a chunk still gets `floor` tokens when the room
        # is gone, so every running request progresses every step
        room = None if self.latency is None else self.latency.token_cap(len(self.running)) - len(self.running)
        floor = self.block_manager.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.done_generating or req.num_tokens >= self.max_model_len:
                i += 1      # its last token is in flight; the engine finishes it when it lands
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if room is not None and num_new > 1:
                num_new = min(num_new, max(1 + room, floor))
                room -= num_new - 1
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

        if not out.preempted and self.swapped:
            self._swap_in(out, now)
        if not out.preempted and not self.swapped and self.waiting and not self._hold_prompts(out, budget, now):
            self._admit(out, budget, now)
        if out.swap_out:
            # every swapped-out block held again after this schedule: one freed at its swap-out, or one it
            # shared with a victim recomputed since, may have been taken by a request of this step, whose
            # forward writes it (one still shared with a running request only costs a wait)
            blocks = self.block_manager.blocks
            out.swap_out_reused = [g for g, _ in out.swap_out if blocks[g].ref_count > 0]
        return out

    def _swap_in(self, out: SchedulerOutput, now: float) -> None:
        """Resumes swapped requests, best ranked first, while their blocks fit and seats are left; they
        join `running` after this step's requests were chosen, so they run from the next step on."""
        if self.policy == "priority":
            self.swapped.sort(key=lambda r: self._rank(r, now))
        bm = self.block_manager
        resumed, reserved = [], 0
        while self.swapped and len(self.running) + len(resumed) < self.max_num_seqs:
            req = self.swapped[0]
            if not bm.can_swap_in(req, reserved):
                break
            self.swapped.pop(0)
            pairs = bm.swap_in(req)
            # the slot of its next token stays free for it: a request resumed after it in this step that
            # took it would be preempted (swapped out again) by the next step
            reserved += max(bm.blocks_needed(req.num_computed_tokens + 1) - len(req.block_ids), 0)
            out.swap_in.extend(pairs)
            self.num_swapped_in_blocks += len(pairs)
            self.num_swap_in_cached_blocks += len(req.block_ids) - len(pairs)
            req.status = RequestStatus.RUNNING
            resumed.append(req)
        self.running.extend(resumed)

    def _hold_prompts(self, out: SchedulerOutput, budget: int, now: float) -> bool:
        """The batching window: True while the waiting prompts should wait for more to join them. Only a
        step that already runs other requests holds them (so holding never idles the engine), only until
        the oldest waiting request has waited `delay_factor` x the last step's time, and only while more
        prompts could still make the prefill bigger (seats and budget left over). A preempted request
        resumes without waiting."""
        if self.delay_factor <= 0.0 or not out.requests:
            return False
        if len(self.waiting) >= self.max_num_seqs - len(self.running):
            return False
        oldest, tokens = now, 0
        for r in self.waiting:
            if r.status == RequestStatus.PREEMPTED:
                return False
            oldest = min(oldest, r.arrival_time)
            tokens += r.num_tokens - r.num_computed_tokens
        return now - oldest < self.delay_factor * self.last_step_seconds and tokens < budget

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Moves waiting requests, best ranked first, into the step while the budget, the seats and the free
        blocks allow; stops at the first that does not fit, so that none overtakes a better-ranked one.
        The sequences of an n > 1 request after its first wait (passed over, not stopping the others) until
        the first has computed the prompt: its blocks are hashed then, and they share them instead of
        computing and holding a copy each."""
        if self.policy == "priority":
            self.waiting.sort(key=lambda r: self._rank(r, now))
        max_seqs = self.max_num_seqs
        if self.latency is not None:     # at least one seat, so that an idle engine admits a request
            max_seqs = min(max_seqs, max(self.latency.seq_cap(len(self.running)), 1))
        step_tokens = self.max_num_batched_tokens - budget
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < max_seqs:
            req = self.waiting[i]
            if self._awaits_first_sequence(req):
                i += 1
                continue
            computed = []
            looked_up = req.num_computed_tokens == 0 and not req.scores_prompt
            if looked_up:
                # a request scoring its prompt computes all of it (cached blocks have no logits)
                computed = self.block_manager.get_computed_blocks(req)
            num_cached = len(computed) * self.block_manager.block_size
            num_new = min(req.num_tokens - req.num_computed_tokens - num_cached, budget)
            if self.latency is not None:
                room = self.latency.token_cap(len(out.requests) + 1) - step_tokens
                if room < 1:
                    if self.running:
                        break       # the step is full by the latency target
                    room = self.block_manager.block_size     # an idle engine still admits one request
                num_new = min(num_new, room)
            if not self.block_manager.allocate_slots(req, num_new, computed):
                break
            self.waiting.pop(i)
            if looked_up and self.block_manager.enable_prefix_caching and req.status == RequestStatus.WAITING:
                # a preempted request's lookups again are not the cache's queries (vLLM counts them apart)
                self.block_manager.record_lookup(req.num_tokens, num_cached)
            if req.index == 0 and req.params.n > 1 and req.status == RequestStatus.WAITING:
                self._first_sequences[req.parent_id] = req
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
            step_tokens += num_new

    def _awaits_first_sequence(self, req: Request) -> bool:
        """Whether `req`, a later sequence of an n > 1 request not yet started, waits for the first one to
        compute the prompt (never while prefix caching is off, where the prompt is scored in full, or where it
        holds no full block before its last token)."""
        bm = self.block_manager
        if req.index == 0 or req.status != RequestStatus.WAITING or not bm.enable_prefix_caching \
                or req.num_prompt_tokens <= bm.block_size:
            return False            # nothing to share: a prompt's last token is always computed
        first = self._first_sequences.get(req.parent_id)
        if first is not None and first.status == RequestStatus.RUNNING and \
                first.num_computed_tokens < first.num_prompt_tokens:
            return True
        self._first_sequences.pop(req.parent_id, None)
        return False

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        # a request whose last token is in flight finishes when it lands: its blocks are never read again
        if self.preemption_mode == "swap" and not request.done_generating and \
                self.block_manager.can_swap_out(request):
            pairs = self.block_manager.swap_out(request)
            out.swap_out.extend(pairs)
            self.num_swap_outs += 1
            self.num_swapped_out_blocks += len(pairs)
            request.status = RequestStatus.SWAPPED
            self.swapped.insert(0, request)     # victims go lowest ranked first: the last one ranks best
            return
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.insert(0, request)

    def update_after_step(self, out: SchedulerOutput, sample_rows=()) -> None:
        """Advances `num_computed_tokens` of the scheduled requests and hashes their full blocks; each
        request of `sample_rows` (rows of `out.requests` that the launched step samples, in its order)
        gets a placeholder for its token (`Request.append_placeholder`), resolved once the step is read."""
        for j, row in enumerate(sample_rows):
            out.requests[row].append_placeholder(j)
        for req, n in zip(out.requests, out.num_new_tokens):
            req.num_computed_tokens += n
            self.block_manager.cache_full_blocks(req)
