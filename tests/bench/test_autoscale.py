"""`pdserve bench autoscale`'s load ramp and arrivals (pure; the run itself is a benchmark)."""

from __future__ import annotations

import pytest

from bench.autoscale import Ramp, arrival_times

RAMP = Ramp(rate=2.0, peak=4.0, low_s=10.0, ramp_s=10.0, peak_s=20.0)


def test_ramp_shape() -> None:
    assert RAMP.duration_s == 60.0
    assert RAMP.rate_at(5.0) == 2.0  # low
    assert RAMP.rate_at(15.0) == pytest.approx(5.0)  # halfway up
    assert RAMP.rate_at(25.0) == 8.0 and RAMP.rate_at(39.9) == 8.0  # peak: 4x
    assert RAMP.rate_at(45.0) == pytest.approx(5.0)  # halfway down
    assert RAMP.rate_at(55.0) == 2.0  # low again
    assert RAMP.rate_at(60.0) == 0.0 and RAMP.rate_at(-1.0) == 0.0


def test_arrivals_follow_the_ramp() -> None:
    times = arrival_times(RAMP, seed=1)
    assert times == sorted(times) and times[0] >= 0 and times[-1] < RAMP.duration_s
    assert times == arrival_times(RAMP, seed=1)  # reproducible
    # Expected counts: 40 in the two low phases (20 s at 2/s), 160 at the peak (20 s at 8/s).
    low = sum(1 for t in times if t < 10 or t >= 50)
    peak = sum(1 for t in times if 20 <= t < 40)
    assert 25 <= low <= 60 and 120 <= peak <= 200
    assert peak > 2.5 * low
