"""The bench clients read an event stream's lines as the SSE format ends them (CRLF, LF or
CR), so generated text holding U+2028, U+2029 or U+0085 unescaped stays inside its event."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from bench.serve.sse import LineSplitter, sse_lines

TEXT = "a\u2028b\u2029c\x85d\x0be"  # str.splitlines would cut this four times


def test_only_cr_and_lf_end_a_line() -> None:
    splitter = LineSplitter()
    event = "data: " + json.dumps({"text": TEXT}, ensure_ascii=False)
    assert splitter.feed(event[:10]) == []
    assert splitter.feed(event[10:] + "\n\n") == [event, ""]
    assert json.loads(event.removeprefix("data: "))["text"] == TEXT
    assert splitter.feed("one\r\ntwo\rthree\n") == ["one", "two", "three"]
    assert splitter.flush() == []


def test_a_crlf_split_across_chunks_is_one_line_end() -> None:
    splitter = LineSplitter()
    assert splitter.feed("data: x\r") == []  # the CR may be half a CRLF
    assert splitter.feed("\ndata: y\r") == ["data: x"]
    assert splitter.feed("data: z") == ["data: y"]  # a lone CR ends a line too
    assert splitter.flush() == ["data: z"]  # the last line, without its end


def test_sse_lines_of_a_streamed_response() -> None:
    event = "data: " + json.dumps({"choices": [{"text": TEXT}]}, ensure_ascii=False)
    payload = f"{event}\n\ndata: [DONE]\n\n".encode()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 7):  # cuts through the UTF-8 of TEXT too
            yield payload[i : i + 7]

    async def read() -> list[str]:
        response = httpx.Response(200, content=chunks())
        return [line async for line in sse_lines(response)]

    lines = asyncio.run(read())
    assert lines == [event, "", "data: [DONE]", ""]
    data = json.loads(lines[0].removeprefix("data: "))
    assert data["choices"][0]["text"] == TEXT
