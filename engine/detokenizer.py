"""Incremental detokenization with stop strings, one instance per request.

Per call, `update(new_token_ids)` turns the new tokens into text in O(new tokens):

1. Decode a small window instead of the whole output (the prefix/read offsets technique).
   `ids[prefix_offset:read_offset]` is context already turned into text, `ids[read_offset:]`
   is new. The delta is `decode(ids[prefix_offset:])` minus `decode(ids[prefix_offset:
   read_offset])`. Decoding with context keeps tokenizers that drop a word's leading space
   at the start of a decode (SentencePiece) right, so the window starts with the last few
   prompt tokens. If the window's text ends in U+FFFD, its last token(s) end in the middle
   of a UTF-8 character (byte-level BPE): nothing is emitted and the offsets wait for the
   next bytes.
2. Scan the new text for stop strings (a match may start in text held from earlier calls).
   On a match the output ends at the stop string, which is kept iff
   `include_stop_str_in_output`, and `finished` is set.
3. Hold back the longest tail of the text that is a proper prefix of some stop string: it
   may turn into a match later, and emitted text cannot be taken back. `flush()` returns it
   (and any undecodable tail) when generation ends for another reason.

Without a stop-string match, the concatenation of all `text_delta`s and `flush()` equals
`decode(prompt_tail + output_ids)` minus `decode(prompt_tail)`, which for byte-level
tokenizers (Llama 3, Qwen2, ours) is exactly `tokenizer.decode(output_ids)`.
`clean_up_tokenization_spaces` is always off: that cleanup looks across token boundaries
and cannot be applied incrementally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.request import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT_CHAR = "\ufffd"
_NUM_PROMPT_CONTEXT_TOKENS = 5


@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """What one `update()` produced.

    `text_delta` is new output text, safe to stream now. `stop_str` is the stop string that
    matched (if any); then `finished` is True and no more text will come.
    """

    text_delta: str
    stop_str: str | None = None
    finished: bool = False


class IncrementalDetokenizer:
    """Turns one request's output tokens into streamed text and detects its stop strings.

    Call `update()` with each step's new tokens, then `flush()` once when the request ends
    for a reason other than a stop string (length, eos, stop token, abort).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        # Window state: the last prompt tokens as context, then the output tokens.
        self._token_ids: list[int] = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids)
        self._pending = ""  # decoded text not emitted yet (it may begin a stop string)
        self._output_text: list[str] = []
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text emitted so far (by `update()` and `flush()`)."""
        return "".join(self._output_text)

    @property
    def finished(self) -> bool:
        """True once a stop string matched or `flush()` was called."""
        return self._finished

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> DetokenizerUpdate:
        """Add the tokens sampled since the last call; return the text that may be emitted.

        With `stop_terminated`, the last token is the eos / stop token that ended generation
        and is not turned into text (OpenAI / vLLM behaviour, also for special-token text);
        call `flush()` afterwards. After `finished`, returns empty updates.
        """
        if self._finished:
            return DetokenizerUpdate("", None, True)
        if stop_terminated and new_token_ids:
            new_token_ids = new_token_ids[:-1]
        new_text = self._decode_new(new_token_ids)
        if not new_text:
            return DetokenizerUpdate("")
        searched = len(self._pending)
        self._pending += new_text
        match = self._find_stop(max(0, searched - self._max_stop_len + 1))
        if match is not None:
            start, stop_str = match
            end = start + len(stop_str) if self._include_stop else start
            delta, self._pending = self._pending[:end], ""
            self._finished = True
            self._output_text.append(delta)
            return DetokenizerUpdate(delta, stop_str, True)
        emit = len(self._pending) - self._held_back_len()
        delta, self._pending = self._pending[:emit], self._pending[emit:]
        self._output_text.append(delta)
        return DetokenizerUpdate(delta)

    def flush(self) -> str:
        """End of generation without a stop-string match: the text still held back, including
        a trailing incomplete character (as U+FFFD, like a full decode). Then finished."""
        if self._finished:
            return ""
        self._finished = True
        full = self._decode(self._token_ids[self._prefix_offset :])
        delta = self._pending + full[len(self._prefix_text) :]
        self._pending = ""
        self._output_text.append(delta)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        text = self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str)  # a flat list of ids decodes to one string
        return text

    def _decode_new(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (may be empty while a UTF-8
        character is still split across tokens)."""
        self._token_ids.extend(new_token_ids)
        full = self._decode(self._token_ids[self._prefix_offset :])
        if len(full) <= len(self._prefix_text) or full.endswith(_REPLACEMENT_CHAR):
            return ""
        new_text = full[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids[self._prefix_offset :])
        return new_text

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        """The stop string that completes first in the pending text (ties: the longer one),
        as (start index, stop string). Matches end after `search_from`."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop string)
        for stop_str in self._stop:
            start = self._pending.find(stop_str, search_from)
            if start < 0:
                continue
            candidate = (start + len(stop_str), -len(stop_str), stop_str)
            if best is None or candidate < best:
                best = candidate
        if best is None:
            return None
        end, neg_len, stop_str = best
        return end + neg_len, stop_str

    def _held_back_len(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop
        string."""
        pending = self._pending
        longest = 0
        for stop_str in self._stop:
            for length in range(min(len(stop_str) - 1, len(pending)), longest, -1):
                if pending.endswith(stop_str[:length]):
                    longest = length
                    break
        return longest
