"""Multi-turn conversations: each turn's prompt is the history, the previous answer and a new
user message. Seeded and free of I/O.

`plan_conversations` draws what a run's users type and when: each conversation's start, its
user messages (random lowercase text, one token per character with the built-in byte-level
models; the first one opens with the conversation's number, so no two conversations share a
first block) and the think time before each later turn (exponential, mean `think_s`).
`pdserve bench multiturn` sends those turns closed-loop, the real previous answer in each
prompt. `schedule_conversations` is the open-loop form for `bench compare --workload
multiturn`, where the rate sets the pace: n conversations start as a Poisson process at
`rate` and each sends its next turn `n / rate` seconds after the previous one, so every
conversation has one turn per window of `n / rate` seconds and turns arrive at `rate` from
the first turn to the last (think times drawn independently of the rate would make a short
run's load depend on them, not on the rate). In place of each previous answer a turn holds
a random text of the answer's length: the history up to the previous prompt is a prefix of
the next turn's prompt, though the answer tokens are not the ones generated.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass

import numpy as np

from bench.serve.workloads import RequestSpec, ScheduledRequest, make_prompt

FIRST, LATER = "first", "later"  # the classes: a conversation's first turn, and the others


@dataclass(frozen=True, slots=True)
class ConversationShape:
    """Sizes of a conversation, in tokens of the built-in models."""

    num_turns: int = 6
    first_len: int = 512  # the first user message (a document, a long question)
    user_len: int = 64  # each later user message
    output_len: int = 32  # max_tokens of every turn
    think_s: float = 1.0  # mean pause between an answer and the next turn

    def __post_init__(self) -> None:
        if self.num_turns < 1 or self.first_len < 8 or self.user_len < 1 or self.output_len < 1:
            raise ValueError(f"bad conversation shape: {self}")
        if self.think_s < 0:
            raise ValueError(f"think_s must be >= 0, got {self.think_s}")

    def prompt_len(self, turn: int) -> int:
        """The prompt length of turn `turn` (0-based) when every answer is `output_len`
        long (special tokens not counted)."""
        return self.first_len + turn * (self.output_len + self.user_len)


@dataclass(frozen=True, slots=True)
class Conversation:
    """One user's conversation: when it starts, what they type, how long they think."""

    index: int
    start_s: float
    messages: tuple[str, ...]  # one user message per turn
    think_s: tuple[float, ...]  # the pause before each later turn (num_turns - 1)


def plan_conversations(
    num_conversations: int, shape: ConversationShape, seed: int, stagger_s: float | None = None
) -> list[Conversation]:
    """`num_conversations` conversations; they start uniformly within `stagger_s` (default:
    one mean think time), so the first turns do not all arrive at once."""
    if num_conversations < 1:
        raise ValueError(f"num_conversations must be >= 1, got {num_conversations}")
    window = shape.think_s if stagger_s is None else stagger_s
    conversations = []
    for c in range(num_conversations):
        rng = np.random.default_rng([seed, c])
        opener = f"{c:04d} "  # within the first block: no two conversations share it
        first = opener + make_prompt(max(1, shape.first_len - len(opener)), rng, 0)
        later = [make_prompt(shape.user_len, rng, 0) for _ in range(shape.num_turns - 1)]
        thinks = (
            rng.exponential(shape.think_s, size=shape.num_turns - 1)
            if shape.think_s
            else [0.0] * (shape.num_turns - 1)
        )
        start = float(rng.uniform(0, window)) if window > 0 else 0.0
        conversations.append(
            Conversation(c, start, (first, *later), tuple(float(t) for t in thinks))
        )
    return conversations


def schedule_conversations(
    shape: ConversationShape, rate: float, num_requests: int, seed: int, special_tokens: int = 1
) -> list[ScheduledRequest]:
    """The open-loop form (module docstring): `num_requests` turns at about `rate` turns per
    second, the earliest first (`shape.think_s` is not used: the rate sets the pace)."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive finite number, got {rate}")
    num_conversations = math.ceil(num_requests / shape.num_turns)
    rng = np.random.default_rng([seed, 1 << 20])
    starts = np.cumsum(rng.exponential(1 / rate, size=num_conversations))
    starts -= starts[0]
    gap_s = num_conversations / rate
    turns: list[tuple[float, RequestSpec]] = []
    for conversation, start in zip(
        plan_conversations(num_conversations, shape, seed, stagger_s=0.0), starts, strict=True
    ):
        answers = np.random.default_rng([seed, conversation.index, 2])
        at, history = float(start), ""
        for t, message in enumerate(conversation.messages):
            if t:
                at += gap_s
                history += make_prompt(shape.output_len, answers, 0)
            history += message
            label = LATER if t else FIRST
            turns.append(
                (at, RequestSpec(history, shape.output_len, len(history) + special_tokens, label))
            )
    turns.sort(key=lambda turn: turn[0])
    return [ScheduledRequest(i, at, spec) for i, (at, spec) in enumerate(turns[:num_requests])]


def add_conversation_args(parser: argparse.ArgumentParser, think_s: float | None) -> None:
    """The conversation shape's options (`ConversationShape`; `think_s`: the default, None:
    no think time, the open-loop form's pace comes from the rate)."""
    d = ConversationShape()
    g = parser.add_argument_group("conversations (multiturn)")
    g.add_argument("--turns", type=int, default=d.num_turns, help="turns per conversation")
    g.add_argument("--first-len", type=int, default=d.first_len, help="first message tokens")
    g.add_argument("--user-len", type=int, default=d.user_len, help="later message tokens")
    g.add_argument("--turn-output-len", type=int, default=d.output_len, help="max_tokens/turn")
    if think_s is not None:
        g.add_argument("--think-s", type=float, default=think_s, help="mean think time (s)")


def conversation_shape(args: argparse.Namespace) -> ConversationShape:
    """The shape `add_conversation_args`' options describe."""
    think_s = getattr(args, "think_s", 0.0)
    return ConversationShape(
        args.turns, args.first_len, args.user_len, args.turn_output_len, think_s
    )


def describe_shape(shape: ConversationShape) -> dict[str, object]:
    """The shape as a JSON-ready dict."""
    return asdict(shape)
