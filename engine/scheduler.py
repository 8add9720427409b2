"""Continuous-batching scheduler shared by the prefill and decode pools. Pure Python.

Lifecycle, as queues:

    waiting ──admit (KV fits)──▶ running ──finished──▶ (freed, or held for KV hand-off)
       ▲                            │
       └─────── preempt (recompute) ┘
    waiting_for_kv ──KV received──▶ running      (decode pool: prompt prefilled elsewhere)

Each step spends at most `max_num_batched_tokens`: running requests first (one token each
when decoding, a chunk when still prefilling), then admissions from `waiting`. When KV runs
out, the least important running request is preempted: its blocks are freed and it is
recomputed from scratch later (its output so far is kept and recomputed as prompt).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
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
        self.num_preemptions = 0  # since start, for stats and tests

    # ---- admission -------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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

        Returns the destination block ids (the request waits in WAITING_FOR_KV), or None
        when the KV does not fit now (nothing is held).
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if self.kv.allocate_slots(request, request.num_prompt_tokens) is None:
            return None
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
        prefix cache (reported in usage).
        """
        request = self.waiting_for_kv.pop(request_id)
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
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

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

        if not out.preempted_ids:
            self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed, num_cached = self.kv.get_computed_blocks(request)
            num_new = min(
                request.num_tokens - num_cached, budget, self.config.long_prefill_token_threshold
            )
            if self.kv.allocate_slots(request, num_new, computed) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(
                ScheduledRequest(request, num_new, self.kv.block_table(request.request_id))
            )
            budget -= num_new

    def _pick_victim(self, first_unscheduled: int) -> Request:
        """The least important request not yet scheduled this step (highest priority value,
        then latest arrival); requests already in this step's batch are never taken back."""
        return max(self.running[first_unscheduled:], key=lambda r: (r.priority, r.arrival_time))

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
            request = item.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_blocks(request)
            if request.request_id not in sampled:
                continue
            token_id, logprobs = sampled[request.request_id]
            request.append_output_token(token_id, logprobs)
            status = self.check_stop(request, token_id)
            if status is not None:
                self.finish_request(request.request_id, status)
                finished.append(request)
        return finished

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

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request in any state (also aborts); frees its blocks unless held for hand-off."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_KV:
            del self.waiting_for_kv[request_id]
        request.status = status
        if status == RequestStatus.FINISHED_PREFILLED:
            self.held[request_id] = request
        else:
            self.kv.free(request)
        return request

    def release_held(self, request_id: str) -> None:
        """Prefill pool: the KV hand-off ended (in any state); free the held blocks."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv.free(request)
