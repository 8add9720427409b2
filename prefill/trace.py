"""One prefill call's timeline: its phases for the TTFT breakdown and its trace spans.

The call's span (`prefill`) continues the decode replica's trace from the request's W3C
carrier and gets `prefill.queue` (handshake and waiting for the engine), `prefill.compute`
(first scheduled to first token sampled) and `kv.transfer` (first layer sent to the
transfer's terminal state: bytes, GB/s, state) as children, built afterwards from
timestamps, plus one `layer_sent` event per layer. The engine thread only appends a
timestamp per layer, and only while the span is recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from engine.request import Request
from replica.protocol import PrefillRequest
from replica.spans import RequestSpan

_tracer = trace.get_tracer("pdserve.prefill")


@dataclass(frozen=True, slots=True)
class PrefillPhases:
    """A finished call's time by phase, in milliseconds (see `PrefillResult`)."""

    queue_ms: float
    compute_ms: float
    transfer_ms: float


class PrefillTrace:
    """Timestamps and spans of one `PrefillServer.prefill` call (event loop, except
    `layer_sent`)."""

    def __init__(self, spec: PrefillRequest, replica: str, num_bytes: int) -> None:
        self._num_bytes = num_bytes
        self._sampled: float | None = None
        self._timeline = RequestSpan(
            _tracer,
            "prefill",
            spec.trace_context,
            {
                "pdserve.request_id": spec.request_id,
                "pdserve.replica": replica,
                "pdserve.num_prompt_tokens": len(spec.prompt_token_ids),
                "pdserve.tenant": spec.tenant,
            },
        )
        self._start = self._timeline.start
        self.span: Span = self._timeline.span
        # Appended by the engine thread (list.append is atomic); None: nobody records.
        self.layer_sent_ns: list[int] | None = [] if self.span.is_recording() else None

    def layer_sent(self) -> None:
        """Engine thread: the next layer's KV went out."""
        if self.layer_sent_ns is not None:
            self.layer_sent_ns.append(time.time_ns())

    def sampled(self) -> None:
        """The first token came back from the engine: the prompt is computed."""
        self._sampled = time.monotonic()

    def finish(
        self, request: Request, state: str, error: BaseException | None = None
    ) -> PrefillPhases:
        """End the spans (`state`: the transfer's terminal state) and return the phases."""
        end = time.monotonic()
        scheduled = request.first_scheduled_time
        sampled = self._sampled if self._sampled is not None else end
        scheduled = min(scheduled if scheduled is not None else sampled, sampled)
        phases = PrefillPhases(
            queue_ms=(scheduled - self._start) * 1000,
            compute_ms=(sampled - scheduled) * 1000,
            transfer_ms=(end - sampled) * 1000 if self._sampled is not None else 0.0,
        )
        if self.span.is_recording():
            self._record(scheduled, sampled, end, state, request.num_cached_tokens)
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        self.span.set_attribute("pdserve.transfer_state", state)
        self.span.end(end_time=self._ns(end))
        return phases

    def _ns(self, monotonic: float) -> int:
        return self._timeline.ns(monotonic)

    def _record(
        self, scheduled: float, sampled: float, end: float, state: str, num_cached: int
    ) -> None:
        parent = trace.set_span_in_context(self.span)
        self.span.set_attribute("pdserve.num_cached_tokens", num_cached)
        self._timeline.child("prefill.queue", self._start, scheduled)
        self._timeline.child("prefill.compute", scheduled, sampled)
        layers = list(self.layer_sent_ns or ())
        for index, at in enumerate(layers):
            self.span.add_event("layer_sent", {"layer": index}, timestamp=at)
        start_ns = layers[0] if layers else self._ns(sampled)
        end_ns = max(self._ns(end), start_ns)
        seconds = (end_ns - start_ns) / 1e9
        moved = self._num_bytes if state == "done" else 0
        transfer = _tracer.start_span(
            "kv.transfer",
            context=parent,
            start_time=start_ns,
            attributes={
                "pdserve.transfer.bytes": moved,
                "pdserve.transfer.gb_per_s": moved / seconds / 1e9 if seconds > 0 else 0.0,
                "pdserve.transfer.state": state,
                "pdserve.transfer.num_layers_sent": len(layers),
            },
        )
        if state != "done":
            transfer.set_status(Status(StatusCode.ERROR, state))
        transfer.end(end_time=end_ns)
