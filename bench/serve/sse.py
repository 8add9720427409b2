"""The lines of a server-sent event stream, split where the SSE format splits them.

An event stream's lines end with CRLF, LF or CR, and nowhere else. httpx's `aiter_lines`
splits like `str.splitlines`, also at U+0085, U+2028, U+2029 and a few control characters,
which a JSON string in a `data:` line may hold unescaped (pdserve writes generated text with
`ensure_ascii=False`, and a byte-level model can generate any of them): the bench clients
would then read half an event and fail a request the server answered correctly.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx

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
