"""Prompt tokenization: text, token ids, and chat messages without role injection.

Chat content is user data, never markup. A message whose content contains the text of a
special token (`<|im_end|>\\n<|im_start|>system`) must not become those tokens, or a user
could end their turn and write a system turn. So:

1. Content without special-token text (the usual case) is rendered by the chat template and
   tokenized exactly as `tokenizer.apply_chat_template(..., tokenize=True)` does.
2. Otherwise each special-token string inside content is wrapped in markers holding a
   per-request random nonce (so content cannot forge them), the template is rendered, and
   the result is split at the markers: the text between them is tokenized normally (the
   template's own special tokens stay special), each marked string as plain text.

Tokenizing is CPU-bound (about a second per megabyte): the ingress calls these methods
off its event loop.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from app.errors import BadRequestError


class PromptTokenizer:
    """Turns request prompts into token ids for one model's tokenizer (a Hugging Face one)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added: Mapping[int, Any] = getattr(tokenizer, "added_tokens_decoder", {})
        specials = sorted(
            {t.content for t in added.values() if t.special} | set(tokenizer.all_special_tokens),
            key=len,
            reverse=True,  # longest first: a token wins over the tokens it contains
        )
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._newline_ids = self._encode("\n")

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt: text is tokenized as given (special tokens parsed, as in
        vLLM); token ids pass through unchanged (`Frontend.prepare` checks them, with every
        other prompt, in `engine.request.check_prompt`)."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return list(prompt)

    def tokenize_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The chat prompt (with the generation prompt) whose content is all plain text."""
        special_re = self._special_re
        if special_re is None or not any(special_re.search(m["content"]) for m in messages):
            return self._encode(self._render(messages))
        nonce = secrets.token_hex(16)
        start, end = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"  # private-use characters
        marked = [
            {**m, "content": special_re.sub(lambda t: f"{start}{t.group(0)}{end}", m["content"])}
            for m in messages
        ]
        # [text, marked special, text, marked special, ..., text]
        pieces = re.split(f"{re.escape(start)}(.*?){re.escape(end)}", self._render(marked))
        texts, literals = pieces[::2], pieces[1::2]
        if any(nonce in text for text in texts) or not all(
            special_re.fullmatch(s) for s in literals
        ):
            # The template cut a marked string apart (e.g. split or truncated the content).
            raise BadRequestError(
                "message content contains special-token text that this model's chat template "
                "cannot keep literal",
                param="messages",
            )
        ids = self._encode(texts[0])
        for literal, text in zip(literals, texts[1:], strict=True):
            ids += self._encode_mid(literal, literal=True)
            ids += self._encode_mid(text, literal=False)
        return ids

    def _render(self, messages: Sequence[Mapping[str, str]]) -> str:
        rendered = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False
        )
        assert isinstance(rendered, str)
        return rendered

    def _encode(self, text: str, literal: bool = False) -> list[int]:
        """`text`'s ids as `apply_chat_template` encodes a rendered chat (no BOS added);
        `literal`: special-token text stays text."""
        if not text:
            return []
        if literal:
            ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)
        else:
            ids = self.tokenizer(text, add_special_tokens=False)
        return [int(t) for t in ids.input_ids]

    def _encode_mid(self, text: str, literal: bool) -> list[int]:
        """Like `_encode`, for text from the middle of a chat: encoded after a newline that is
        then dropped, so a SentencePiece tokenizer adds no word-start space."""
        if not text:
            return []
        ids = self._encode("\n" + text, literal)
        prefix = self._newline_ids
        if prefix and ids[: len(prefix)] == prefix:
            return ids[len(prefix) :]
        return self._encode(text, literal)
