"""`spare_num_threads`: a step runs on the spare thread count only while every request the
engine holds is `spare` (a batch line sent on an idle service); anything else brings
`num_threads` back from the next step, and greedy output does not depend on the count."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.builtin import write_builtin_model
from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture()
def engine(model_dir: Path) -> Iterator[tuple[Engine, list[int]]]:
    """An engine (1 thread, 2 spare) whose steps record the thread count they ran with."""
    before = torch.get_num_threads()
    engine = Engine(EngineConfig(model_dir=str(model_dir), num_threads=1, spare_num_threads=2))
    seen: list[int] = []
    execute = engine.runner.execute

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return execute(*args, **kwargs)

    engine.runner.execute = recording  # type: ignore[method-assign]
    yield engine, seen
    torch.set_num_threads(before)


def run(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return tokens


def test_spare_requests_alone_get_the_spare_threads(engine: tuple[Engine, list[int]]) -> None:
    eng, seen = engine
    eng.add_request(eng.make_request("hello there", GREEDY, request_id="a", spare=True))
    eng.add_request(eng.make_request("general kenobi", GREEDY, request_id="b", spare=True))
    spare_tokens = run(eng)
    assert seen and set(seen) == {2}
    assert eng.step_seconds > 0 and eng.spare_step_seconds == eng.step_seconds
    spare_s = eng.spare_step_seconds

    seen.clear()
    eng.add_request(eng.make_request("hello there", GREEDY, request_id="c"))
    eng.add_request(eng.make_request("general kenobi", GREEDY, request_id="d"))
    tokens = run(eng)
    assert set(seen) == {1}
    assert eng.spare_step_seconds == spare_s < eng.step_seconds  # narrow steps: not spare
    assert [tokens["c"], tokens["d"]] == [spare_tokens["a"], spare_tokens["b"]]


def test_anything_else_arriving_narrows_the_next_step(engine: tuple[Engine, list[int]]) -> None:
    eng, seen = engine
    eng.add_request(eng.make_request("a batch line", GREEDY, request_id="line", spare=True))
    eng.step()
    eng.step()
    assert seen == [2, 2]
    eng.add_request(eng.make_request("an interactive request", GREEDY, request_id="chat"))
    eng.step()
    assert seen[-1] == 1
    eng.abort_request("chat")
    eng.step()  # the line alone again
    assert seen[-1] == 2
    run(eng)
