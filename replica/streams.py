"""A replica's `generate` streams: slots by priority, a timeline per request, ITL samples.

Every replica that serves whole requests wraps its deltas in `Streams.serve`: the decode
replica (`decode/server.py`) and a prefill replica of a pool with `serves_decode`
(`prefill/server.py`, which takes whole requests while the decode pool is busier). A stream
first holds one of the replica's `max_num_seqs` slots (`replica/slot_gate.py`: waiters
admitted by priority, within the request's deadline), then its deltas flow through its
`GenerationTrace` (spans, TTFT breakdown); the gaps between tokens feed the replica's ITL
signal (one-token deltas only); a spec with `delta_interval_s` gets them merged by the
engine (`Engine._emit`).
Event loop only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Callable

from engine.outputs import RequestOutput
from replica.generation_trace import GenerationTrace
from replica.protocol import GenerationSpec
from replica.signals import RecentSamples
from replica.slot_gate import SlotGate

MAX_ADMISSION_WAIT_S = 600.0  # for a slot, when the request has no deadline of its own
ADMISSION_MARGIN_S = 1.0  # past the request's deadline: the ingress's 504 comes first

Run = Callable[[GenerationSpec, GenerationTrace], AsyncGenerator[RequestOutput, None]]


class Streams:
    """The generate streams of one replica (`replica` and `pool` name it in traces)."""

    def __init__(self, replica: str, pool: str, max_num_seqs: int) -> None:
        self.replica = replica
        self.pool = pool
        self.admission = SlotGate(max_num_seqs)
        self.timelines: dict[str, GenerationTrace] = {}  # by request id
        self.itl_ms = RecentSamples()  # ms per token between a stream's deltas

    async def serve(self, spec: GenerationSpec, run: Run) -> AsyncGenerator[RequestOutput]:
        """Stream `run(spec, timeline)`'s deltas once `spec` holds a slot; its timeline
        ends with the stream (finish reason, or the error that ended it)."""
        last_token_at: float | None = None
        timeline = self.timelines[spec.request_id] = GenerationTrace(spec, self.replica, self.pool)
        finish_reason: str | None = None
        error: BaseException | None = None
        wait_s = MAX_ADMISSION_WAIT_S
        if spec.timeout_s is not None:
            wait_s = spec.timeout_s + ADMISSION_MARGIN_S
        try:
            # aclosing: when our caller goes away, the inner generator's cleanup runs now.
            async with (
                self.admission.slot(spec.priority, wait_s),
                contextlib.aclosing(run(spec, timeline)) as deltas,
            ):

                async def observed() -> AsyncGenerator[RequestOutput, None]:
                    nonlocal finish_reason, last_token_at
                    async for delta in deltas:
                        delta = timeline.on_delta(delta)
                        finish_reason = delta.finish_reason or finish_reason
                        if delta.new_token_ids:
                            now = time.perf_counter()
                            # Merged deltas (held output) say nothing of single gaps.
                            if last_token_at is not None and len(delta.new_token_ids) == 1:
                                self.itl_ms.add((now - last_token_at) * 1000)
                            last_token_at = now
                        yield delta

                out = observed()
                async with contextlib.aclosing(out):
                    async for delta in out:
                        yield delta
        except BaseException as exc:
            error = exc
            raise
        finally:
            if self.timelines.get(spec.request_id) is timeline:
                del self.timelines[spec.request_id]
            timeline.finish(finish_reason, error)
