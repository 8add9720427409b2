"""Recent-latency windows and signal dicts (pure, no engine)."""

from __future__ import annotations

from replica.signals import (
    RecentSamples,
    busy_share,
    decode_signals,
    percentile,
    prefill_signals,
    prompt_tokens_per_s,
)


def test_percentile_nearest_rank() -> None:
    assert percentile([], 0.9) == 0.0
    assert percentile([5.0], 0.9) == 5.0
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 0.9) == 9.0
    assert percentile(reversed(values), 0.5) == 5.0
    assert percentile(values, 1.0) == 10.0


def test_recent_samples_forget_what_left_the_window() -> None:
    samples = RecentSamples(window_s=10.0)
    for t in range(20):
        samples.add(float(t), now=float(t))
    assert samples.values(now=19.0) == [float(t) for t in range(9, 20)]
    assert samples.p90(now=19.0) == 18.0
    assert samples.values(now=100.0) == [] and samples.p90(now=100.0) == 0.0
    samples.add(500.0, now=100.0)  # a lone (say, cold) sample: no percentile yet
    assert samples.p90(now=100.0) == 0.0
    samples.add(20.0, now=101.0)
    assert samples.p90(now=101.0) == 500.0


def test_prompt_rate_and_signal_dicts() -> None:
    steps = [(0.0, 1.0, 100, 100), (5.0, 0.5, 300, 300), (9.0, 0.25, 600, 600)]
    assert prompt_tokens_per_s(steps, since=4.0) == 1200.0  # 900 tokens in 0.75 s
    assert prompt_tokens_per_s(steps, since=10.0) == 0.0
    assert busy_share(steps, now=10.0, window_s=5.0) == 0.15  # 0.75 s of the last 5 s
    assert busy_share([(0.0, 30.0, 9, 9)], now=30.0, window_s=30.0) == 1.0
    # a step that also decoded 30 streams counts for its 10 prompt tokens' share: 1/4
    assert busy_share([(8.0, 2.0, 10, 40)], now=10.0, window_s=10.0) == 0.05
    # a replica 8 s old that computed prompts 6 s of them: 75% busy, not 6/30
    young = [(2.0, 3.0, 900, 900), (5.0, 3.0, 900, 900)]
    assert busy_share(young, now=10.0, window_s=30.0, observed_since=2.0) == 0.75
    assert busy_share(young, now=10.0, window_s=30.0) == 0.2  # the whole window: too low
    # older than the window: the window; just started: at least its first second
    assert busy_share(steps, now=10.0, window_s=5.0, observed_since=0.0) == 0.15
    assert busy_share([(5.0, 0.25, 8, 8)], now=5.5, window_s=30.0, observed_since=5.0) == 0.25
    ttft = RecentSamples(30.0)
    ttft.add(120.0, now=2.0)
    assert prefill_signals({"queued_tokens": 0}, 900.0, ttft, now=3.0)["ttft_p90_ms"] == 0
    ttft.add(80.0, now=2.5)  # one sample is no evidence; two are
    occupancy = {
        "queued_tokens": 42,
        "num_blocks": 100,
        "num_free_blocks": 75,
        "num_running": 3,
        "num_waiting": 1,
        "num_waiting_for_kv": 2,
    }
    assert prefill_signals(occupancy, 1800.0, ttft, now=3.0) == {
        "queued_prompt_tokens": 42.0,
        "prefill_tokens_per_s": 1800.0,
        "ttft_p90_ms": 120.0,
    }
    itl = RecentSamples(30.0)
    itl.add(10.0, now=1.0)
    itl.add(7.0, now=1.5)
    assert decode_signals(occupancy, itl, now=2.0) == {
        "kv_blocks_used": 25.0,
        "kv_blocks_total": 100.0,
        "num_running": 3.0,
        "num_waiting": 1.0,
        "num_waiting_for_kv": 2.0,
        "itl_p90_ms": 10.0,
    }
