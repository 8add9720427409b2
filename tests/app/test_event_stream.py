"""`EventStreamResponse`: a streamed response cancelled anywhere closes its generators at
once, so what their `finally` frees (quota slots, KV blocks) is freed when the client goes
away, not when the garbage collector runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from app.responses import EventStreamResponse

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}}


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("blocked_in", ["send", "source"])
def test_cancelled_response_closes_its_generators(blocked_in: str) -> None:
    closed: list[str] = []

    async def scenario() -> None:
        waiting = asyncio.Event()

        async def source() -> AsyncGenerator[str]:
            try:
                while True:
                    if blocked_in == "source":
                        waiting.set()
                        await asyncio.Event().wait()  # the next token never comes
                    yield "token"
            finally:
                closed.append("source")

        tokens = source()

        async def events() -> AsyncGenerator[str]:
            try:
                async for token in tokens:
                    yield f"data: {token}\n\n"
            finally:
                closed.append("events")

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and blocked_in == "send":
                waiting.set()
                await asyncio.Event().wait()  # a client that stopped reading

        response = EventStreamResponse(events(), {}, source=tokens)
        task = asyncio.create_task(response(SCOPE, _never, send))
        await asyncio.wait_for(waiting.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Checked before the loop ends: asyncio's shutdown would close them anyway.
        assert sorted(closed) == ["events", "source"]

    asyncio.run(scenario())


def test_response_never_started_closes_its_source() -> None:
    closed: list[str] = []

    async def scenario() -> None:
        async def source() -> AsyncGenerator[str]:
            try:
                yield "token"
            finally:
                closed.append("source")

        tokens = source()
        await anext(tokens)  # the first token was read before the response was built

        async def events() -> AsyncGenerator[str]:
            async for token in tokens:
                yield token

        async def send(message: dict[str, Any]) -> None:
            raise OSError("connection reset")

        response = EventStreamResponse(events(), {}, source=tokens)
        with pytest.raises(Exception):  # noqa: B017, PT011 - Starlette's ClientDisconnect
            await response(SCOPE, _never, send)
        assert closed == ["source"]

    asyncio.run(scenario())
