"""The bench clients read an event stream's lines as the SSE format ends them (CRLF, LF or
CR), so generated text holding U+2028, U+2029 or U+0085 unescaped stays inside its event."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from bench.serve.sse import LineSplitter, Streamed, sse_lines, stream_completion

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


def streamed(handler: httpx.MockTransport) -> Streamed:
    async def run() -> Streamed:
        async with httpx.AsyncClient(transport=handler, base_url="http://server") as client:
            return await stream_completion(client, {"model": "m", "prompt": "p"}, 0.0)

    return asyncio.run(run())


def test_a_streamed_completion_is_timed_chunk_by_chunk() -> None:
    events = [
        {"choices": [{"index": 0, "text": "a\u2028"}]},
        {"choices": [{"index": 0, "text": "b"}]},
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}},
    ]
    payload = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events)
    seen: list[dict[str, object]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        body = (payload + "data: [DONE]\n\n").encode()
        return httpx.Response(200, content=body, headers={"x-pdserve-route": "decode"})

    out = streamed(httpx.MockTransport(handle))
    assert seen == [{"model": "m", "prompt": "p"}] and out.error is None
    assert out.texts == ["a\u2028", "b"] and len(out.chunk_times_s) == 2
    assert out.first_token_s == out.chunk_times_s[0] and out.end_s is not None
    assert out.usage == {"prompt_tokens": 1, "completion_tokens": 2}
    assert out.route == "decode"


def test_a_failed_completion_says_why_and_never_raises() -> None:
    out = streamed(httpx.MockTransport(lambda r: httpx.Response(429, text="slow down")))
    assert out.error == "HTTP 429: slow down" and not out.chunk_times_s
    error_event = 'data: {"error": {"message": "boom", "code": 500}}\n\n'
    out = streamed(httpx.MockTransport(lambda r: httpx.Response(200, text=error_event)))
    assert out.error is not None and out.error.startswith("stream error:") and "boom" in out.error
    out = streamed(httpx.MockTransport(lambda r: httpx.Response(200, text="data: {bad\n\n")))
    assert out.error is not None and out.error.startswith("JSONDecodeError")

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    out = streamed(httpx.MockTransport(refuse))
    assert out.error is not None and out.error.startswith("ConnectError")
