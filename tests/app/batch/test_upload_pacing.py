"""Uploads within the size limit, and the pace of a job's lines (both without Ray)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from app.batch.execute import line_is_spare
from app.batch.pacing import GAP_WEIGHT, MAX_QUIET_FACTOR, Load, Pacer, queued_ahead
from app.batch.upload import read_upload
from app.config import BatchSettings
from app.errors import BadRequestError, PayloadTooLargeError
from app.routing.pool_router import RouteDecision

BOUNDARY = "b0undary"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def form(content: bytes, purpose: str = "batch") -> bytes:
    return (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"'
            "\r\nContent-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + content
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


async def chunks(data: bytes, size: int = 7) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def upload(body: bytes, limit: int, declared: str | None = None):  # type: ignore[no-untyped-def]
    return asyncio.run(read_upload(CONTENT_TYPE, declared, chunks(body), limit))


def test_upload_keeps_the_bytes_exactly() -> None:
    content = b'{"a": 1}\r\n{"b": "\xc3\xa9"}\n\r\n'
    result = upload(form(content), limit=1024)
    assert (result.filename, result.purpose, result.content) == ("in.jsonl", "batch", content)


def test_upload_over_the_limit_is_413() -> None:
    with pytest.raises(PayloadTooLargeError, match="file limit of 10 bytes"):
        upload(form(b"x" * 11), limit=10)
    with pytest.raises(PayloadTooLargeError):  # the declared length alone refuses it
        upload(b"", limit=10, declared=str(10**9))


def test_malformed_upload_is_400() -> None:
    with pytest.raises(BadRequestError, match="no file field"):
        upload(f"--{BOUNDARY}--\r\n".encode(), limit=10)
    with pytest.raises(BadRequestError, match="multipart/form-data"):
        asyncio.run(read_upload("application/json", None, chunks(b"{}"), 10))


def test_pacer_opens_when_idle_and_backs_off_for_more_important_work() -> None:
    settings = BatchSettings(min_concurrency=1, busy_concurrency=4, max_concurrency=64, quiet_s=3.0)
    pacer = Pacer(settings)
    assert not pacer.idle  # nothing seen yet
    limits = [pacer.next_limit(Load(0, False, now=t)) for t in range(6)]
    assert limits == [64] * 6  # quiet: the whole window at once
    assert pacer.idle  # (short lines then prefill where they decode)
    assert pacer.next_limit(Load(3, False, now=10)) == 4  # interactive running: busy at once
    assert not pacer.idle
    assert pacer.next_limit(Load(0, True, now=11)) == 2  # interactive queued: halve
    assert pacer.next_limit(Load(0, True, now=12)) == 1
    assert pacer.next_limit(Load(0, True, now=13)) == 1
    assert pacer.next_limit(Load(1, False, now=14)) == 2
    assert pacer.refused() == 1
    # Quiet for less than quiet_s: up by one, no further than busy; then the whole window.
    assert [pacer.next_limit(Load(0, False, now=t)) for t in (15, 16, 16.5)] == [2, 3, 4]
    assert not pacer.idle
    assert pacer.next_limit(Load(0, False, now=17.5)) == 64
    assert pacer.idle
    pacer.refused()  # a line refused for load: not idle until the next quiet look
    assert not pacer.idle


def test_quiet_period_follows_the_gap_between_more_important_arrivals() -> None:
    """At one arrival a second, a 3 s gap is no sign of an idle service: the window opens
    only after five recent gaps without an arrival; a single request after a long idle
    spell lengthens it no further than MAX_QUIET_FACTOR x quiet_s."""
    settings = BatchSettings(min_concurrency=1, busy_concurrency=2, max_concurrency=64, quiet_s=3.0)
    pacer = Pacer(settings)
    assert pacer.quiet_period_s == 3.0  # no rate seen yet
    for t in range(10):  # one arrival a second, each finished by the next look
        pacer.next_limit(Load(1, False, now=float(t), num_arrived=1))
    assert pacer.gap_s == pytest.approx(1.0)
    assert pacer.quiet_period_s == pytest.approx(5.0)
    assert pacer.report()["quiet_period_s"] == pytest.approx(5.0)
    # 4 s without an arrival: under a fixed quiet_s of 3 s the window would open here.
    assert pacer.next_limit(Load(0, False, now=13.0)) == 2
    assert not pacer.idle
    assert pacer.next_limit(Load(0, False, now=14.5)) == 64  # 5.5 s: idle
    assert pacer.idle and pacer.report()["idle"]
    # One request after an hour: the gap counts as at most the longest quiet period's share.
    pacer.next_limit(Load(1, False, now=3600.0, num_arrived=1))
    assert pacer.quiet_period_s <= MAX_QUIET_FACTOR * settings.quiet_s
    assert pacer.gap_s == pytest.approx(1.0 + GAP_WEIGHT * (6.0 - 1.0))


def test_queued_ahead_reads_more_important_waiters_only() -> None:
    decode = {"admission": {"num_waiting_by_priority": {"10": 5}}}
    prefill = {"pending_tokens_by_priority": {"10": 900.0, "0": 0}}
    assert not queued_ahead([decode, prefill], priority=10)
    assert queued_ahead([{"admission": {"num_waiting_by_priority": {0: 1}}}], priority=10)
    assert queued_ahead([{"pending_tokens_by_priority": {"0": 12}}], priority=10)


def test_only_idle_lines_computed_whole_on_a_decode_pool_are_spare() -> None:
    placed = RouteDecision("short", "decode", False, 10, "64 tokens: short")
    local = placed.prefilled_locally("a batch line")
    pools = {"decode"}
    assert line_is_spare(local, idle=True, decode_pools=pools)
    assert not line_is_spare(local, idle=False, decode_pools=pools)  # something else runs
    assert not line_is_spare(placed, idle=True, decode_pools=pools)  # a prefill pool computes
    overflowed = RouteDecision(None, "short", True, 10, "decode overflow onto short")
    assert not line_is_spare(overflowed, idle=True, decode_pools=pools)  # a prefill replica
