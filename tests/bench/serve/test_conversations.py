"""Multi-turn conversations (`bench/serve/conversations.py`): seeded plans, and the open-loop
schedule `bench compare --workload multiturn` replays, where each turn's prompt extends the
previous one."""

from __future__ import annotations

import argparse
from collections import defaultdict

import pytest

from bench.serve.conversations import (
    FIRST,
    LATER,
    ConversationShape,
    plan_conversations,
    schedule_conversations,
)
from bench.serve.workloads import add_workload_args, class_shapes, requests_from_args

SHAPE = ConversationShape(num_turns=4, first_len=40, user_len=10, output_len=5, think_s=2.0)


def test_plans_are_seeded_and_conversations_differ_from_their_first_block() -> None:
    plans = plan_conversations(6, SHAPE, seed=3)
    assert plans == plan_conversations(6, SHAPE, seed=3)
    assert plans != plan_conversations(6, SHAPE, seed=4)
    assert len({p.messages[0][:16] for p in plans}) == 6
    for plan in plans:
        assert len(plan.messages) == 4 and len(plan.think_s) == 3
        assert len(plan.messages[0]) == 40
        assert all(len(m) == 10 for m in plan.messages[1:])
        assert 0 <= plan.start_s < SHAPE.think_s
    assert all(t == 0 for p in plan_conversations(2, SHAPE, 0, stagger_s=0) for t in [p.start_s])
    no_think = ConversationShape(num_turns=3, think_s=0.0)
    assert plan_conversations(1, no_think, 0)[0].think_s == (0.0, 0.0)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError):
        ConversationShape(num_turns=0)
    with pytest.raises(ValueError):
        ConversationShape(think_s=-1)
    with pytest.raises(ValueError):
        plan_conversations(0, SHAPE, 0)


def test_the_open_loop_schedule_extends_each_conversation() -> None:
    requests = schedule_conversations(SHAPE, rate=4.0, num_requests=20, seed=0)
    assert len(requests) == 20
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert [r.index for r in requests] == list(range(20))
    by_conversation: dict[str, list[str]] = defaultdict(list)
    for r in requests:
        by_conversation[r.spec.prompt[:5]].append(r.spec.prompt)
        assert r.spec.label == (FIRST if len(r.spec.prompt) == 40 else LATER)
        assert r.spec.input_len == len(r.spec.prompt) + 1
        assert r.spec.max_tokens == 5
    assert len(by_conversation) == 5
    # The rate sets the pace: 20 turns at 4 per second take about 5 s, whatever think_s says.
    assert 4.0 <= requests[-1].arrival_s <= 6.0
    for prompts in by_conversation.values():
        for before, after in zip(prompts, prompts[1:], strict=False):
            assert after.startswith(before)
            assert len(after) == len(before) + 5 + 10  # an answer's worth, then a message
    with pytest.raises(ValueError):
        schedule_conversations(SHAPE, rate=0.0, num_requests=4, seed=0)


def test_compare_reads_the_multiturn_workload_from_its_options() -> None:
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    options = ["--workload", "multiturn", "--turns", "3", "--first-len", "40"]
    args = parser.parse_args([*options, "--user-len", "10", "--turn-output-len", "5"])
    requests = requests_from_args(args, 2.0, 0.0, num_requests=9)
    assert len(requests) == 9
    assert {r.spec.label for r in requests} == {FIRST, LATER}
    shapes = class_shapes(args)
    assert set(shapes) == {FIRST, LATER}
    assert shapes[FIRST].input_len == 41 and shapes[LATER].input_len == 40 + 2 * 15 + 1
