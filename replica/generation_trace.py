"""One `generate` call's timeline: the TTFT breakdown and its spans (on a decode replica, or
a prefill replica serving whole requests).

The call's span (`decode.generate`) continues the ingress's trace from the spec's W3C
carrier. Remote prefill adds `decode.reserve` (waiting for KV room), `decode.prefill_call`
(a client span whose context travels in `PrefillRequest.trace_context`, so the prefill
replica's spans hang below it) and `decode.first_step` (KV landed to first token
published); the stream's end is an event with the token count and finish reason.

Everything is recorded on the event loop from a few timestamps, except `published`, one
`time.monotonic()` on the engine thread when the first token of a remote prefill is
handed to the stream.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from engine.outputs import RequestOutput, TTFTBreakdown
from engine.request import Request
from replica.protocol import GenerationSpec, PrefillResult
from replica.spans import RequestSpan, propagator

_tracer = trace.get_tracer("pdserve.decode")


class GenerationTrace:
    """Timestamps and spans of one `DecodeServer.generate` call."""

    def __init__(
        self,
        spec: GenerationSpec,
        replica: str,
        pool: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` must read `time.monotonic`'s clock (as `first_scheduled_time` does)."""
        self._clock = clock
        self._timeline = RequestSpan(
            _tracer,
            "decode.generate",
            spec.trace_context,
            {
                "pdserve.request_id": spec.request_id,
                "pdserve.pool": pool,
                "pdserve.replica": replica,
                "pdserve.tenant": spec.tenant,
                "pdserve.num_prompt_tokens": len(spec.prompt_token_ids),
                "pdserve.prefill_pool": spec.prefill_pool or "",
            },
            clock,
        )
        self._start = self._timeline.start
        self.span: Span = self._timeline.span
        self.local_request: Request | None = None  # set when this replica prefills
        self.carrier: dict[str, str] = {}  # the current prefill call's trace context
        self._reserve_start: float | None = None
        self._reserved: float | None = None
        self._call: Span | None = None
        self._result: PrefillResult | None = None
        self._landed: float | None = None
        self._published: float | None = None
        self._first: TTFTBreakdown | None = None
        self._num_output_tokens = 0

    def _child(self, name: str, begin: float, end: float, **attributes: object) -> None:
        self._timeline.child(name, begin, end, **attributes)

    # ---- remote prefill --------------------------------------------------------------

    def reserve_started(self) -> None:
        self._reserve_start = self._clock()

    def reserved(self, transfer_id: str, got_room: bool) -> None:
        """The attempt's reservation answered (`got_room`: blocks held, ticket open)."""
        now = self._clock()
        self._reserved = now
        if self._reserve_start is not None and self.span.is_recording():
            self._child(
                "decode.reserve",
                self._reserve_start,
                now,
                **{"pdserve.transfer_id": transfer_id, "pdserve.got_room": int(got_room)},
            )

    def prefill_call_started(self, transfer_id: str, pool: str) -> dict[str, str]:
        """A client span for the prefill call; returns its W3C carrier."""
        self._call = _tracer.start_span(
            "decode.prefill_call",
            context=trace.set_span_in_context(self.span),
            kind=SpanKind.CLIENT,
            attributes={"pdserve.transfer_id": transfer_id, "pdserve.prefill_pool": pool},
        )
        self.carrier = {}
        propagator.inject(self.carrier, context=trace.set_span_in_context(self._call))
        return self.carrier

    def prefill_call_ended(self, result: PrefillResult | None, replica: str | None) -> None:
        """The call returned (`result`, the KV landed) or failed (None)."""
        call, self._call = self._call, None
        if result is not None:
            self._result = result
            self._landed = self._clock()
        if call is None:
            return
        if replica is not None:
            call.set_attribute("pdserve.prefill_replica", replica)
        if result is None:
            call.set_status(Status(StatusCode.ERROR, "prefill attempt failed"))
        else:
            call.set_attribute("pdserve.prefill_ms", result.prefill_ms)
        call.end()

    def published(self) -> None:
        """Engine thread: the remote prefill's first token went to the stream."""
        self._published = self._clock()

    # ---- the stream ------------------------------------------------------------------

    def on_delta(self, delta: RequestOutput) -> RequestOutput:
        """Count `delta`'s tokens; the first one carries the TTFT breakdown."""
        if delta.new_token_ids and self._first is None:
            self._first = self._breakdown(self._clock())
            if self.span.is_recording():
                self._record_first(self._first)
            delta = dataclasses.replace(delta, ttft=self._first)
        self._num_output_tokens = max(self._num_output_tokens, delta.num_output_tokens)
        return delta

    def _breakdown(self, now: float) -> TTFTBreakdown:
        result, landed = self._result, self._landed
        if result is None or landed is None or self.local_request_started():
            scheduled = self._local_scheduled(now)
            return TTFTBreakdown(
                queue_ms=(scheduled - self._start) * 1000, prefill_ms=(now - scheduled) * 1000
            )
        reserved = self._reserved if self._reserved is not None else self._start
        published = self._published if self._published is not None else now
        return TTFTBreakdown(
            queue_ms=(reserved - self._start) * 1000 + result.queue_ms,
            prefill_ms=result.compute_ms,
            transfer_ms=result.transfer_ms,
            handover_ms=max((landed - reserved) * 1000 - result.prefill_ms, 0.0),
            first_step_ms=(published - landed) * 1000,
            remote=True,
        )

    def local_request_started(self) -> bool:
        request = self.local_request
        return request is not None and request.first_scheduled_time is not None

    def _local_scheduled(self, now: float) -> float:
        request = self.local_request
        scheduled = request.first_scheduled_time if request is not None else None
        return min(max(scheduled, self._start), now) if scheduled is not None else now

    def _record_first(self, ttft: TTFTBreakdown) -> None:
        if ttft.remote and self._landed is not None:
            end = self._published if self._published is not None else self._landed
            self._child("decode.first_step", self._landed, end)
        self.span.add_event("first_token")
        for name in ("queue_ms", "prefill_ms", "transfer_ms", "handover_ms", "first_step_ms"):
            self.span.set_attribute(f"pdserve.ttft.{name}", getattr(ttft, name))
        self.span.set_attribute("pdserve.remote_prefill", ttft.remote)

    def finish(self, finish_reason: str | None, error: BaseException | None) -> None:
        """End the call's span with a `stream_end` event."""
        if self._call is not None:  # cancelled mid-call
            self.prefill_call_ended(None, None)
        self.span.add_event(
            "stream_end",
            {
                "pdserve.num_output_tokens": self._num_output_tokens,
                "pdserve.finish_reason": finish_reason or "",
            },
        )
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        self.span.end()
