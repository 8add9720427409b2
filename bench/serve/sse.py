"""Streamed completions as the bench clients read them: `stream_completion` posts one and
times its chunks (the load generator and the multi-turn client both use it), over
`sse_lines`, the lines of a server-sent event stream split where the SSE format splits them.

An event stream's lines end with CRLF, LF or CR, and nowhere else. httpx's `aiter_lines`
splits like `str.splitlines`, also at U+0085, U+2028, U+2029 and a few control characters,
which a JSON string in a `data:` line may hold unescaped (pdserve writes generated text with
`ensure_ascii=False`, and a byte-level model can generate any of them): the bench clients
would then read half an event and fail a request the server answered correctly.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

COMPLETIONS = "/v1/completions"

_LINE_END = re.compile(r"\r\n|\r|\n")


class LineSplitter:
    """Text in, complete lines out (without their ends), chunk by chunk."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, text: str) -> list[str]:
        """The lines `text` completes. A CR at the end is held back: it may be half a CRLF."""
        self._pending += text
        held = 1 if self._pending.endswith("\r") else 0
        *lines, rest = _LINE_END.split(self._pending[: len(self._pending) - held])
        self._pending = rest + self._pending[len(self._pending) - held :]
        return lines

    def flush(self) -> list[str]:
        """The lines left when the stream ends (the last one may lack its end)."""
        lines = _LINE_END.split(self._pending)
        self._pending = ""
        if lines[-1] == "":
            lines.pop()
        return lines


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """Each line of `response`'s event stream, as the SSE format splits them."""
    splitter = LineSplitter()
    async for text in response.aiter_text():
        for line in splitter.feed(text):
            yield line
    for line in splitter.flush():
        yield line


@dataclass(slots=True)
class Streamed:
    """What came back for one streamed completion; times are seconds from `t0`."""

    route: str | None = None  # the x-pdserve-route header
    first_token_s: float | None = None
    end_s: float | None = None  # when the stream ended ([DONE] or its close)
    chunk_times_s: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # each choice's text, in order
    usage: dict[str, Any] | None = None
    error: str | None = None


async def stream_completion(
    client: httpx.AsyncClient,
    body: Mapping[str, Any],
    t0: float,
    headers: Mapping[str, str] | None = None,
) -> Streamed:
    """POST `body` to the completions route and read its event stream. Never raises for
    the server's or the network's failures: they land in `error` (an HTTP status with the
    body's start, an error event, a broken stream or bad JSON)."""
    out = Streamed()
    try:
        async with client.stream("POST", COMPLETIONS, json=dict(body), headers=headers) as response:
            out.route = response.headers.get("x-pdserve-route")
            if response.status_code != 200:
                raw = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {raw[:300]}"
                return out
            async for line in sse_lines(response):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return out
                if chunk.get("choices"):
                    out.first_token_s = out.first_token_s if out.first_token_s else now
                    out.chunk_times_s.append(now)
                    out.texts += [c.get("text") or "" for c in chunk["choices"]]
                if chunk.get("usage"):
                    out.usage = chunk["usage"]
        out.end_s = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    return out
