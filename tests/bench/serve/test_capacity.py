"""The capacity probe (`bench/serve/capacity.py`): the saturation search stops where doubling the
concurrency stops paying (twice, so one low point on a busy machine does not stop it) and
reports the best throughput; the closed loop keeps exactly its
concurrency in flight, gives every request its own index and returns only once all ended."""

from __future__ import annotations

import asyncio

import pytest

from bench.serve.capacity import Capacity, LoadPoint, closed_loop, find_saturation


def _point(concurrency: int, throughput: float) -> LoadPoint:
    return LoadPoint(concurrency, duration_s=10.0, completed=round(throughput * 10))


def _search(curve: dict[int, float], **kwargs: int | float) -> tuple[Capacity, list[int]]:
    asked: list[int] = []

    async def measure(concurrency: int) -> LoadPoint:
        asked.append(concurrency)
        return _point(concurrency, curve[concurrency])

    return asyncio.run(find_saturation(measure, **kwargs)), asked  # type: ignore[arg-type]


def test_saturation_stops_once_doubling_stops_paying_twice() -> None:
    capacity, asked = _search({1: 4.0, 2: 7.0, 4: 9.0, 8: 9.5, 16: 9.6, 32: 9.7})
    assert asked == [1, 2, 4, 8, 16]  # 8 and 16 each gained < 10% over the best before
    assert capacity.saturated and capacity.requests_per_s == 9.6
    assert [p.concurrency for p in capacity.points] == asked
    capacity, asked = _search({1: 4.0, 2: 7.0, 4: 7.1, 8: 7.2}, patience=1)
    assert asked == [1, 2, 4] and capacity.requests_per_s == 7.1


def test_one_low_point_does_not_end_the_search() -> None:
    # A point that came out low (a busy moment on a shared machine), then the knee.
    capacity, asked = _search({1: 5.0, 2: 4.5, 4: 7.5, 8: 7.6, 16: 7.0, 32: 8.0})
    assert asked == [1, 2, 4, 8, 16]
    assert capacity.saturated and capacity.requests_per_s == 7.6


def test_a_dip_past_the_knee_keeps_the_best_throughput() -> None:
    capacity, asked = _search({1: 5.0, 2: 8.0, 4: 6.0, 8: 7.0})
    assert asked == [1, 2, 4, 8]
    assert capacity.saturated and capacity.requests_per_s == 8.0


def test_unsaturated_at_the_concurrency_cap() -> None:
    capacity, asked = _search({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}, max_concurrency=8)
    assert asked == [1, 2, 4, 8]
    assert not capacity.saturated and capacity.requests_per_s == 8.0
    capacity, asked = _search({6: 5.0, 12: 7.0, 24: 8.0}, start=6, max_concurrency=24)
    assert asked == [6, 12, 24] and not capacity.saturated
    # At the cap after a doubling that lost throughput: past the knee, if only once.
    capacity, asked = _search(
        {16: 30.0, 32: 33.0, 64: 38.0, 128: 25.0}, start=16, max_concurrency=128
    )
    assert asked == [16, 32, 64, 128]
    assert capacity.saturated and capacity.requests_per_s == 38.0


def test_search_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        _search({}, start=0)
    with pytest.raises(ValueError):
        _search({}, start=4, max_concurrency=2)
    with pytest.raises(ValueError):
        _search({}, min_gain=-0.1)
    with pytest.raises(ValueError):
        _search({}, patience=0)


def test_point_throughput_and_record() -> None:
    point = LoadPoint(4, duration_s=5.0, completed=20, failed=1, sent=26, mean_latency_s=0.9)
    assert point.throughput == 4.0
    assert point.to_dict()["throughput"] == 4.0 and point.to_dict()["sent"] == 26
    assert LoadPoint(1, duration_s=0.0, completed=0).throughput == 0.0
    capacity = Capacity(4.0, [point], saturated=True).to_dict()
    assert capacity["requests_per_s"] == 4.0 and capacity["points"][0]["completed"] == 20


def test_closed_loop_keeps_its_concurrency_in_flight() -> None:
    indices: list[int] = []
    in_flight = most = 0

    async def send(index: int) -> bool:
        nonlocal in_flight, most
        indices.append(index)
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.005)
        in_flight -= 1
        return index % 5 != 0  # every fifth request fails

    point = asyncio.run(closed_loop(send, 3, duration_s=1.0, warmup_s=0.05, first_index=100))
    assert most == 3 and in_flight == 0  # all ended before it returned
    assert point.concurrency == 3 and point.duration_s == 1.0
    assert point.sent == len(indices) and sorted(indices) == list(range(100, 100 + point.sent))
    # Only requests ending inside the window count: not those of the warm-up, nor each
    # worker's last one (it ends past the window, which is why the worker stops).
    assert 0 < point.completed + point.failed < point.sent
    assert point.failed > 0 and point.mean_latency_s is not None


def test_closed_loop_arguments_are_checked() -> None:
    async def send(index: int) -> bool:
        return True

    with pytest.raises(ValueError):
        asyncio.run(closed_loop(send, 0, 1.0))
    with pytest.raises(ValueError):
        asyncio.run(closed_loop(send, 1, 0.0))
