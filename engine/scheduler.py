"""Continuous-batching scheduler shared by the prefill and decode pools. Pure Python.

Lifecycle, as queues:

    waiting ──admit (KV fits)──▶ running ──finished──▶ (freed, or held for KV hand-off)
       ▲                            │
       └─────── preempt (recompute) ┘
    waiting_for_kv ──KV received──▶ running      (decode pool: prompt prefilled elsewhere)
    running ──in a failed step──▶ suspects ──alone, on trial──▶ running once it passes a step
                                                   that samples (or it fails alone: error)

Each step spends at most `max_num_batched_tokens`: running requests first (one token each
when decoding, a chunk when still prefilling), then admissions from `waiting`. When KV runs
out, the least important running request is preempted: its blocks are freed and it is
recomputed from scratch later (its output so far is kept and recomputed as prompt).

Quarantine: when a step with several requests raises, the engine cannot tell which one
caused it, so each is preempted the same way into `suspects`. Suspects then run one at a
time, each alone in its step (the "trial"), until it passes a step in which it samples; no
new request is admitted meanwhile, so the suspects get the blocks that running requests free.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.growth import GrowthReserve, OutputGrowth
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed for it this step
    block_table: list[int]

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        # Prefill pool: finished requests whose blocks stay until their KV is handed off.
        self.held: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.suspects: deque[Request] = deque()  # quarantined: each waits to run alone
        self.on_trial: Request | None = None  # the suspect now running alone, if any
        self.num_preemptions = 0  # since start, for stats and tests
        self.num_quarantined = 0
        self.growth = OutputGrowth(kv_manager.num_blocks_for)

    # ---- admission -------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv) + len(self.suspects)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.suspects)

    def add_request(self, request: Request) -> None:
        """Queue a request for local prefill then decode (or prefill-only hand-off)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        # FIFO within a priority level; more important (lower value) requests go first.
        for index, other in enumerate(self.waiting):
            if other.priority > request.priority and other.num_preemptions == 0:
                self.waiting.insert(index, request)
                return
        self.waiting.append(request)

    def reserve_for_kv(self, request: Request) -> list[int] | None:
        """Decode pool: reserve blocks for a prompt that is prefilled elsewhere.

        The leading blocks this pool's prefix cache holds for the request's tenant are
        pinned (one reference each, held until the request ends) and start its table;
        `request.num_computed_tokens` is the prompt tokens they cover, and only the blocks
        after them need KV from the transfer. Returns the request's whole block table (the
        request waits in WAITING_FOR_KV), or None when the KV does not fit now (nothing is
        held).
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        computed, num_cached = self.kv.get_computed_blocks(request)
        num_new = request.num_prompt_tokens - num_cached
        if (
            not self._has_room(request, computed, self.growth_reserve())
            or self.kv.allocate_slots(request, num_new, computed) is None
        ):
            self.kv.free(request)  # the block hashes `get_computed_blocks` kept for it
            return None
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.request_id] = request
        self.waiting_for_kv[request.request_id] = request
        return list(self.kv.block_table(request.request_id))

    def kv_received(
        self,
        request_id: str,
        first_token_id: int,
        logprobs: dict[int, float] | None = None,
        num_cached_tokens: int = 0,
    ) -> Request:
        """Decode pool: the prompt's KV is in our blocks; start decoding after `first_token_id`.

        `num_cached_tokens` is how much of the prompt the prefill replica reused from its
        prefix cache (reported in usage); the KV that moved covers the prompt after the
        prefix pinned at `reserve_for_kv` (`num_transferred_tokens`).
        """
        request = self.waiting_for_kv.pop(request_id)
        request.num_transferred_tokens = request.num_prompt_tokens - request.num_computed_tokens
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = num_cached_tokens
        request.append_output_token(first_token_id, logprobs)
        request.status = RequestStatus.RUNNING
        self.kv.cache_blocks(request)
        self.running.append(request)
        return request

    def kv_failed(self, request_id: str, fall_back_to_local: bool) -> bool:
        """Decode pool: the transfer ended without KV. Free the blocks; prefill locally or
        abort. Returns False (and does nothing) if the request no longer waits for KV."""
        request = self.waiting_for_kv.pop(request_id, None)
        if request is None:
            return False
        self.kv.free(request)
        if fall_back_to_local:
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        else:
            request.status = RequestStatus.FINISHED_ABORTED
            del self.requests[request_id]
        return True

    # ---- the step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.on_trial is not None or self.suspects:
            trial = self._schedule_trial()
            if trial is not None:
                return trial
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Most important first (stable: arrival order within a priority), so they take the
        # step's budget and new blocks first and preemption only takes from those after.
        self.running.sort(key=_importance)

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(
                request.num_uncomputed_tokens, budget, self.config.long_prefill_token_threshold
            )
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim(i)
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(
                    ScheduledRequest(request, num_new, self.kv.block_table(request.request_id))
                )
                budget -= num_new
                i += 1
                continue
            # `request` itself was preempted; the list shifted, `i` now points at the next.

        if not out.preempted_ids and not self.suspects:
            self._admit_waiting(out, budget)
        return out

    def _schedule_trial(self) -> SchedulerOutput | None:
        """A step holding only the suspect on trial (the first suspect starts one when its
        next chunk fits); None when no suspect fits now: the running requests go on."""
        out = SchedulerOutput()
        budget = min(self.config.max_num_batched_tokens, self.config.long_prefill_token_threshold)
        request = self.on_trial
        if request is None:
            request = self.suspects[0]
            computed, num_cached = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if self.kv.allocate_slots(request, num_new, computed) is None:
                return None
            self.suspects.popleft()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.on_trial = request
        else:
            num_new = min(request.num_uncomputed_tokens, budget)
            while self.kv.allocate_slots(request, num_new) is None:
                others = [r for r in self.running if r is not request]
                if not others:  # not even alone, now: wait in front of the suspects
                    self.quarantine(request)
                    out.preempted_ids.append(request.request_id)
                    return out
                victim = max(others, key=_importance)
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
        out.scheduled.append(
            ScheduledRequest(request, num_new, self.kv.block_table(request.request_id))
        )
        return out

    def quarantine(self, request: Request) -> None:
        """Engine, after a failed step with several requests: free `request`'s blocks (its
        output is kept) and queue it to be recomputed alone, as a suspect."""
        if self.on_trial is request:
            self.on_trial = None
            self.suspects.appendleft(request)
        else:
            self.suspects.append(request)
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_quarantined += 1
        request.status = RequestStatus.PREEMPTED

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Start waiting requests in queue order while each one's first chunk fits and it
        has room for its expected growth (`_has_room`). A request held back by that room
        lets only strictly more important ones behind it go first (a preempted batch line at
        the head must not hold back interactive requests); a chunk that does not fit stops
        admission."""
        if not self.waiting:
            return
        reserve = self.growth_reserve()
        index = 0
        bar: int | None = None  # once set, only requests more important than this start
        most_important = 0  # of the waiting requests, once `bar` is set
        while (
            index < len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[index]
            if bar is not None:
                if bar <= most_important:  # none behind it may pass it
                    break
                if request.priority >= bar:
                    index += 1
                    continue
            computed, num_cached = self.kv.get_computed_blocks(request)
            if not self._has_room(request, computed, reserve):
                if bar is None:
                    most_important = min(r.priority for r in self.waiting)
                bar = request.priority
                index += 1
                continue
            num_new = min(
                request.num_tokens - num_cached, budget, self.config.long_prefill_token_threshold
            )
            if self.kv.allocate_slots(request, num_new, computed) is None:
                break
            del self.waiting[index]
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            table = self.kv.block_table(request.request_id)
            out.scheduled.append(ScheduledRequest(request, num_new, table))
            self._count_growth(reserve, request, reclaimable=True)
            budget -= num_new

    def _has_room(self, request: Request, computed: list[int], reserve: GrowthReserve) -> bool:
        """Whether `request` (starting on the cached `computed` blocks) has room for all it
        is expected to take: within the free blocks and those less important running
        requests hold, less what `reserve` keeps for the growth of those at least as
        important (`engine/growth.py`); always when it keeps nothing for them."""
        room = reserve.room(request.priority, self.kv.num_free_blocks)
        if room is None:
            return True
        need = self.growth.growth_blocks(request, len(computed))
        return room >= need + self.kv.num_revived(computed)

    def growth_reserve(self) -> GrowthReserve:
        """The expected growth of every request holding blocks that will grow, and what
        the running ones hold."""
        reserve = GrowthReserve()
        for request in self.running:
            self._count_growth(reserve, request, reclaimable=True)
        for request in self.waiting_for_kv.values():
            self._count_growth(reserve, request, reclaimable=False)
        return reserve

    def _count_growth(self, reserve: GrowthReserve, request: Request, reclaimable: bool) -> None:
        """Add `request`'s expected growth to `reserve`, and the blocks it holds when
        preemption can take them back (`reclaimable`: a running request)."""
        held = len(self.kv.block_table(request.request_id))
        growth = self.growth.growth_blocks(request, held)
        reserve.add(request.priority, growth, held if reclaimable else 0)

    def _pick_victim(self, first_unscheduled: int) -> Request:
        """The least important request not yet scheduled this step (highest priority value,
        then latest arrival); requests already in this step's batch are never taken back."""
        return max(self.running[first_unscheduled:], key=_importance)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, tuple[int, dict[int, float] | None]],
    ) -> list[Request]:
        """Advance each scheduled request; append sampled tokens; return finished requests.

        `sampled` maps request id → (token id, logprobs) for requests that sampled this step.
        """
        finished: list[Request] = []
        for item in output.scheduled:
            if self.update_scheduled(item, sampled.get(item.request.request_id)):
                finished.append(item.request)
        return finished

    def update_scheduled(
        self, item: ScheduledRequest, sample: tuple[int, dict[int, float] | None] | None
    ) -> bool:
        """`update_from_output` for one scheduled request (`sample`: its token and logprobs,
        if it sampled). Returns True when the request finished with this step."""
        request = item.request
        if request.is_finished:  # aborted while the step ran
            return False
        request.num_computed_tokens += item.num_new_tokens
        self.kv.cache_blocks(request)
        if sample is None:
            return False
        if self.on_trial is request:  # passed a step that samples: no longer suspect
            self.on_trial = None
        token_id, logprobs = sample
        request.append_output_token(token_id, logprobs)
        status = self.check_stop(request, token_id)
        if status is None:
            return False
        self.finish_request(request.request_id, status)
        return True

    def check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """The finished status `token_id` (just appended) puts the request in, if any."""
        if request.prefill_only:
            return RequestStatus.FINISHED_PREFILLED
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(
        self, request_id: str, status: RequestStatus, hold: bool = False
    ) -> Request | None:
        """End a request in any state (also aborts); frees its blocks unless held for hand-off
        (FINISHED_PREFILLED, or `hold`: until `release_held`)."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if self.on_trial is request:
            self.on_trial = None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            if request in self.suspects:
                self.suspects.remove(request)
            else:
                self.waiting.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_KV:
            del self.waiting_for_kv[request_id]
        request.status = status
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.growth.finished(request)
        if status == RequestStatus.FINISHED_PREFILLED or hold:
            self.held[request_id] = request
        else:
            self.kv.free(request)
        return request

    def release_held(self, request_id: str) -> None:
        """Prefill pool: the KV hand-off ended (in any state); free the held blocks."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv.free(request)


def _importance(request: Request) -> tuple[int, float]:
    """Sort key: more important (lower priority value), then earlier, first."""
    return request.priority, request.arrival_time
