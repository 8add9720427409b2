"""Recent-latency windows and the load signals a replica reports for autoscaling.

Pure Python, no Ray: the servers record samples on their event loop and hand the dicts
built here to Serve's `record_autoscaling_stats`; `app/serve/autoscaling.py` reads them back by
the same names. Each pool's signal names are listed once, below.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Mapping

# Window of the latency percentiles and the measured prefill rate: long enough to hold
# several requests at low load, short enough to follow a load change within a minute.
SIGNAL_WINDOW_S = 30.0
MAX_SAMPLES = 4096
# A latency window with fewer samples reports no latency (0.0): one request is no evidence
# (after a quiet spell, or a fresh replica's first, cold request). The policies also ignore
# a latency breach while the pool's load is low (`app/serve/autoscaling.py`).
MIN_SAMPLES = 2
MIN_BUSY_SPAN_S = 1.0  # `busy_share` judges a younger replica over at least its first second

PREFILL_SIGNALS = ("queued_prompt_tokens", "prefill_tokens_per_s", "ttft_p90_ms")
DECODE_SIGNALS = (
    "kv_blocks_used",
    "kv_blocks_total",
    "num_running",
    "num_waiting",
    "num_waiting_for_kv",
    "itl_p90_ms",
)


def percentile(values: Iterable[float], q: float) -> float:
    """The `q`-quantile (0..1) of `values` by nearest rank; 0.0 when there are none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = max(math.ceil(q * len(ordered)), 1)
    return ordered[rank - 1]


class RecentSamples:
    """Timestamped values of the last `window_s` seconds (at most `MAX_SAMPLES` kept).

    Appended and read by one thread (the replica's event loop).
    """

    def __init__(self, window_s: float = SIGNAL_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def add(self, value: float, now: float | None = None) -> None:
        """Record `value` at `now` (monotonic seconds; default: the current time)."""
        self._samples.append((time.monotonic() if now is None else now, value))

    def values(self, now: float | None = None) -> list[float]:
        """The values recorded within the window ending at `now`, oldest first."""
        since = (time.monotonic() if now is None else now) - self.window_s
        while self._samples and self._samples[0][0] < since:
            self._samples.popleft()
        return [value for _, value in self._samples]

    def p90(self, now: float | None = None) -> float:
        """90th percentile of the window's values; 0.0 (no evidence) with fewer than
        `MIN_SAMPLES` of them."""
        values = self.values(now)
        return percentile(values, 0.9) if len(values) >= MIN_SAMPLES else 0.0


PromptStep = tuple[float, float, int, int]  # perf_counter start, seconds, prompt tokens, all


def prompt_tokens_per_s(prompt_steps: Iterable[PromptStep], since: float) -> float:
    """Prompt tokens computed per second of the steps that computed them, over the steps
    started at or after `since` (`Engine.prompt_steps`: (perf_counter start, seconds,
    prompt tokens, all tokens)); 0.0 when there are none. Steps that only decode do not
    count, so a replica that also serves whole requests reports the speed of its prompts,
    not less."""
    tokens = seconds = 0.0
    for start, duration, num_tokens, _ in prompt_steps:
        if start >= since:
            tokens += num_tokens
            seconds += duration
    return tokens / seconds if seconds > 0 else 0.0


def busy_share(
    prompt_steps: Iterable[PromptStep],
    now: float,
    window_s: float,
    observed_since: float | None = None,
) -> float:
    """Share of the last `window_s` seconds before `now` spent in steps that computed
    prompts (`Engine.prompt_steps`), 0..1: a stream decoding on the replica waits that share
    of the time, so its TPOT is its decode step's over (1 - share).

    The share is of the time observed: a replica that started `observed_since` (its engine's
    start) less than `window_s` ago is judged over its life so far, at least
    `MIN_BUSY_SPAN_S`. Dividing by the whole window would read a replica 8 s old and
    computing prompts all the time as 27% busy, so decode overflow would send whole requests
    to a freshly started (or scaled-up) prefill replica saturated with prompts.

    A step that also decoded counts for its prompt tokens' share of its tokens only: a
    replica serving chat turns whole has a short prompt chunk in most steps at load, and
    counting those whole read it as always busy while its streams hardly waited."""
    since = now - window_s
    if observed_since is not None:
        since = max(since, min(observed_since, now - MIN_BUSY_SPAN_S))
    busy = sum(
        duration * num_prompt / max(num_tokens, num_prompt, 1)
        for start, duration, num_prompt, num_tokens in prompt_steps
        if start >= since
    )
    return min(busy / (now - since), 1.0)


def prefill_signals(
    occupancy: Mapping[str, int],
    tokens_per_s: float,
    ttft_ms: RecentSamples,
    now: float | None = None,
) -> dict[str, float]:
    """A prefill replica's signals: prompt tokens not yet computed, its prefill rate
    (`prompt_tokens_per_s`; 0.0 until measured), and recent TTFT p90 (`prefill` call to KV
    delivered, ms; 0.0 below `MIN_SAMPLES`)."""
    return {
        "queued_prompt_tokens": float(occupancy["queued_tokens"]),
        "prefill_tokens_per_s": tokens_per_s,
        "ttft_p90_ms": ttft_ms.p90(now),
    }


def decode_signals(
    occupancy: Mapping[str, int], itl_ms: RecentSamples, now: float | None = None
) -> dict[str, float]:
    """A decode replica's signals: KV blocks in use and in total, running sequences,
    requests queued for admission (`num_waiting`) or for their KV to land
    (`num_waiting_for_kv`), and recent ITL p90 (ms between a stream's tokens; 0.0 below
    `MIN_SAMPLES`)."""
    num_blocks = occupancy["num_blocks"]
    return {
        "kv_blocks_used": float(num_blocks - occupancy["num_free_blocks"]),
        "kv_blocks_total": float(num_blocks),
        "num_running": float(occupancy["num_running"]),
        "num_waiting": float(occupancy["num_waiting"]),
        "num_waiting_for_kv": float(occupancy["num_waiting_for_kv"]),
        "itl_p90_ms": itl_ms.p90(now),
    }
