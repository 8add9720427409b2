"""One request's failure stays that request's: the others finish token-identical, blocks come
back, the engine loop keeps serving; stats and health never wait on the engine thread.

The culprit is a `Request` built past `Engine.make_request` (as a caller bypassing
validation would): a stop token id outside the vocabulary with `min_tokens`, which makes
the sampler index the logits out of range.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.builtin import write_builtin_model
from engine.config import EngineConfig
from engine.engine import Engine
from engine.outputs import CompletionOutput, RequestFailedError, RequestOutput
from engine.request import InvalidRequestError, Request, SamplingParams
from engine.sampler import Sampler, SamplerOutput, SamplingBatch
from replica.engine_replica import EngineReplica
from tests.engine.hf_reference import hf_greedy

PROMPTS = [
    "hello",
    "a much longer prompt that spans several KV cache blocks of sixteen tokens each, "
    "so that paging, block tables and the slot mapping all matter",
    "short",
]
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
OUT_OF_VOCAB = 1_000_000_000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[list[int]]:
    """`transformers` greedy generation, one prompt at a time."""
    return hf_greedy(model_dir, PROMPTS, MAX_TOKENS)


@pytest.fixture()
def engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model_dir=str(model_dir)))


def bad_request(engine: Engine, request_id: str = "bad", prefill_only: bool = False) -> Request:
    """Passes `SamplingParams` but not `make_request`: the sampler fails on it."""
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=(OUT_OF_VOCAB,), min_tokens=1
    )
    return Request(request_id, engine.tokenize("x y z"), params, prefill_only=prefill_only)


def run_until_done(engine: Engine, outputs: dict[str, CompletionOutput]) -> None:
    while engine.has_unfinished:
        for delta in engine.step():
            outputs[delta.request_id].add(delta)


def add_all(engine: Engine, requests: list[Request]) -> dict[str, CompletionOutput]:
    outputs = {}
    for request in requests:
        engine.add_request(request)
        outputs[request.request_id] = CompletionOutput(request.request_id, [])
    return outputs


def assert_all_blocks_free(engine: Engine) -> None:
    assert engine.kv_manager.num_free_blocks == engine.kv_spec.num_blocks
    assert not engine.scheduler.requests and not engine.scheduler.held


# ---- validation at the engine's edge ---------------------------------------------------


def test_make_request_rejects_out_of_vocab_ids(engine: Engine) -> None:
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.make_request("hi", SamplingParams(stop_token_ids=(vocab,)))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.make_request("hi", SamplingParams(stop_token_ids=(OUT_OF_VOCAB,), min_tokens=1))
    for prompt in ([1, vocab], [-1, 2], [1, 2.0], [True]):
        with pytest.raises(InvalidRequestError, match="prompt token ids"):
            engine.make_request(prompt, GREEDY)  # type: ignore[arg-type]
    engine.make_request([0, vocab - 1], SamplingParams(stop_token_ids=(vocab - 1,)))


# ---- the sync step loop ----------------------------------------------------------------


def test_culprit_in_a_batch_fails_alone(engine: Engine, expected: list[list[int]]) -> None:
    good = [engine.make_request(p, GREEDY) for p in PROMPTS]
    requests = [good[0], bad_request(engine), *good[1:]]
    outputs = add_all(engine, requests)
    run_until_done(engine, outputs)

    assert [outputs[r.request_id].token_ids for r in good] == expected
    assert all(outputs[r.request_id].finish_reason == "length" for r in good)
    bad = outputs["bad"]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error is not None and "IndexError" in bad.error
    # Everyone was in the failing step (the first one), so everyone was rerun alone.
    assert engine.scheduler.num_quarantined == len(requests)
    assert_all_blocks_free(engine)
    # The engine goes on serving.
    assert [o.token_ids for o in engine.generate(PROMPTS[:1], GREEDY)] == expected[:1]
    assert_all_blocks_free(engine)


def test_culprit_joining_running_requests(engine: Engine, expected: list[list[int]]) -> None:
    """Innocents that already decoded some tokens are recomputed and go on unchanged."""
    good = [engine.make_request(p, GREEDY) for p in PROMPTS]
    outputs = add_all(engine, good)
    for _ in range(4):
        for delta in engine.step():
            outputs[delta.request_id].add(delta)
    assert all(0 < r.num_output_tokens < MAX_TOKENS for r in good)
    outputs |= add_all(engine, [bad_request(engine)])
    run_until_done(engine, outputs)

    assert [outputs[r.request_id].token_ids for r in good] == expected
    assert outputs["bad"].finish_reason == "error"
    assert engine.scheduler.num_quarantined == len(good) + 1
    assert_all_blocks_free(engine)


def test_culprit_alone_fails_at_once(engine: Engine) -> None:
    engine.add_request(bad_request(engine))
    deltas = engine.step()
    assert [(d.request_id, d.finished, d.finish_reason) for d in deltas] == [("bad", True, "error")]
    assert not engine.has_unfinished and engine.scheduler.num_quarantined == 0
    assert_all_blocks_free(engine)


def test_failed_prefill_only_request_holds_blocks_until_released(engine: Engine) -> None:
    """Its KV may have been streamed out in the failed step: the blocks stay until the
    hand-off's release, as after a successful prefill."""
    outputs = add_all(engine, [bad_request(engine, prefill_only=True)])
    run_until_done(engine, outputs)
    assert outputs["bad"].finish_reason == "error"
    assert list(engine.scheduler.held) == ["bad"]
    assert engine.kv_manager.num_free_blocks < engine.kv_spec.num_blocks
    engine.scheduler.release_held("bad")
    assert_all_blocks_free(engine)


def test_prefill_only_innocent_streaming_kv_fails_and_holds(engine: Engine) -> None:
    """A prefill-only request completing its prompt in the failed step may have had layers
    streamed out: it fails too (the decode side retries it), its blocks held until release."""
    innocent = engine.make_request(PROMPTS[0], GREEDY, request_id="p", prefill_only=True)
    outputs = add_all(engine, [innocent, bad_request(engine)])
    run_until_done(engine, outputs)
    assert outputs["p"].finish_reason == "error" and outputs["bad"].finish_reason == "error"
    assert outputs["bad"].error is not None and "IndexError" in outputs["bad"].error
    assert list(engine.scheduler.held) == ["p"]
    engine.scheduler.release_held("p")
    assert_all_blocks_free(engine)


class FailOnceAfterSampling(Sampler):
    """Test fault: the first call samples (advancing seeded generators), then raises."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        result = super().__call__(logits, batch)
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected failure after sampling")
        return result


def test_seeded_innocents_draw_the_same_tokens(engine: Engine, model_dir: Path) -> None:
    """A failed step leaves seeded generators as they were, so rerun innocents sample the
    same tokens as in a run without the failure."""
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i) for i in range(3)]
    clean = Engine(EngineConfig(model_dir=str(model_dir))).generate(PROMPTS, seeded)

    engine.runner.sampler = FailOnceAfterSampling()
    outputs = engine.generate(PROMPTS, seeded)
    assert engine.scheduler.num_quarantined == len(PROMPTS)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in clean]
    assert all(o.error is None for o in outputs)
    assert_all_blocks_free(engine)


# ---- the async loop --------------------------------------------------------------------


@pytest.fixture()
def async_engine(engine: Engine) -> Iterator[AsyncEngine]:
    loop = AsyncEngine(engine)
    yield loop
    loop.shutdown()


async def collect(loop: AsyncEngine, request_id: str, stream: asyncio.Queue) -> list[int]:
    tokens: list[int] = []
    async for delta in loop.stream(request_id, stream):
        tokens.extend(delta.new_token_ids)
    return tokens


def test_async_culprit_fails_its_stream_only(
    async_engine: AsyncEngine, expected: list[list[int]]
) -> None:
    loop, engine = async_engine, async_engine.engine

    async def run() -> None:
        good = [engine.make_request(p, GREEDY) for p in PROMPTS]
        requests = [*good, bad_request(engine)]
        streams = {r.request_id: loop.open_stream(r.request_id) for r in requests}
        # One command, so that all of them are in the first (failing) step.
        await loop.call_async(lambda: [engine.add_request(r) for r in requests])
        results = await asyncio.gather(
            *(collect(loop, rid, s) for rid, s in streams.items()), return_exceptions=True
        )
        assert results[:-1] == expected
        assert isinstance(results[-1], RequestFailedError) and "IndexError" in str(results[-1])

        # Still serving; the snapshot shows every block free one iteration after the end.
        later = engine.make_request(PROMPTS[0], GREEDY)
        assert [t async for d in loop.generate(later) for t in d.new_token_ids] == expected[0]
        await loop.call_async(lambda: None)
        assert loop.occupancy["num_free_blocks"] == loop.occupancy["num_blocks"]
        assert loop.occupancy["num_running"] == 0
        free = await loop.call_async(lambda: engine.kv_manager.num_free_blocks)
        assert free == engine.kv_spec.num_blocks

    asyncio.run(run())
    assert loop.is_alive
    assert engine.scheduler.num_quarantined == len(PROMPTS) + 1


def test_async_failure_delta_carries_the_error(async_engine: AsyncEngine) -> None:
    loop, engine = async_engine, async_engine.engine

    async def run() -> RequestOutput:
        request = bad_request(engine)
        stream = loop.open_stream(request.request_id)
        await loop.call_async(lambda: engine.add_request(request))
        return await stream.get()

    delta = asyncio.run(run())
    assert delta.finished and delta.finish_reason == "error" and delta.error
    assert loop.is_alive


def test_deltas_waiting_for_a_busy_caller_go_out_as_one(
    async_engine: AsyncEngine, expected: list[list[int]]
) -> None:
    """A caller that comes for its deltas only after the request finished (a busy event
    loop) gets them as one delta: every token, the text a prompt caller gets, the final
    state; token-identical to `transformers` greedy."""
    loop, engine = async_engine, async_engine.engine

    async def run() -> tuple[list[RequestOutput], list[RequestOutput]]:
        request = engine.make_request(PROMPTS[1], GREEDY)
        stream = loop.open_stream(request.request_id)
        await loop.call_async(lambda: engine.add_request(request))
        deadline = time.monotonic() + 60
        while not await loop.call_async(lambda: request.is_finished):
            assert time.monotonic() < deadline, "the request did not finish"
            await asyncio.sleep(0.01)
        assert stream.qsize() == MAX_TOKENS  # one delta a step, all waiting
        late = [d async for d in loop.stream(request.request_id, stream)]
        prompt = [d async for d in loop.generate(engine.make_request(PROMPTS[1], GREEDY))]
        return late, prompt

    late, prompt = asyncio.run(run())
    assert len(late) == 1
    (delta,) = late
    assert delta.new_token_ids == expected[1] == [t for d in prompt for t in d.new_token_ids]
    assert delta.new_text == "".join(d.new_text for d in prompt)
    assert delta.finished and delta.finish_reason == "length"
    assert delta.num_output_tokens == MAX_TOKENS
    assert delta.new_logprobs == [p for d in prompt for p in d.new_logprobs]


def test_a_failure_waiting_behind_deltas_is_not_merged(async_engine: AsyncEngine) -> None:
    """Tokens queued before a failure still reach the caller, merged, then the failure."""
    loop = async_engine

    def delta(tokens: list[int], error: str | None = None) -> RequestOutput:
        return RequestOutput(
            "r", tokens, "x" * len(tokens), [], error is not None, None, 4, 0, error=error
        )

    async def run() -> tuple[list[int], BaseException | None]:
        stream = loop.open_stream("r")
        for item in (delta([1]), delta([2, 3]), delta([], error="boom"), delta([9])):
            stream.put_nowait(item)
        got: list[int] = []
        try:
            async for d in loop.stream("r", stream):
                got.append(len(d.new_token_ids))
        except RequestFailedError as exc:
            return got, exc
        return got, None

    got, error = asyncio.run(run())
    assert got == [3] and isinstance(error, RequestFailedError) and "boom" in str(error)


# ---- replica stats and health ----------------------------------------------------------


@pytest.fixture()
def replica(model_dir: Path) -> Iterator[EngineReplica]:
    replica = EngineReplica("test", EngineConfig(model_dir=str(model_dir)), stall_timeout_s=1.0)
    yield replica
    replica.shutdown()


def test_stats_and_health_do_not_wait_on_a_stuck_engine(replica: EngineReplica) -> None:
    replica.check_health()
    release = threading.Event()
    stuck = replica.loop.call(release.wait)  # the engine thread is busy until released
    try:
        stats = replica.stats()  # answered from the snapshot while the engine is stuck
        assert stats["num_free_blocks"] == stats["num_blocks"] == replica.engine.kv_spec.num_blocks
        assert stats["role"] == "test" and stats["engine_alive"] is True
        assert asyncio.run(replica.routing_stats())["num_running"] == 0
        while replica.loop.seconds_since_progress <= replica.stall_timeout_s:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="no progress"):
            replica.check_health()
    finally:
        release.set()
    stuck.result()
    replica.loop.call(lambda: None).result()
    replica.check_health()


def test_health_fails_when_the_loop_dies(replica: EngineReplica) -> None:
    def broken_hook() -> None:
        raise RuntimeError("injected loop-level failure")

    replica.loop.between_steps.append(broken_hook)  # runs on every iteration, idle or not
    while replica.loop.is_alive:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="dead"):
        replica.check_health()
    with pytest.raises(EngineDeadError):
        replica.loop.call(lambda: None)


def test_caller_cancelled_while_its_add_runs_leaves_nothing(async_engine: AsyncEngine) -> None:
    """The engine thread is adding the request when its caller is cancelled (a client that
    went away): the add still happens, so an abort must follow it, and the stream goes."""
    loop, engine = async_engine, async_engine.engine
    adding, go_on = threading.Event(), threading.Event()
    add_request = engine.add_request

    def slow_add(request: Request) -> None:
        adding.set()
        go_on.wait(30)
        add_request(request)

    engine.add_request = slow_add  # type: ignore[method-assign]
    request = engine.make_request("a b c", SamplingParams(max_tokens=200, ignore_eos=True))

    async def run() -> None:
        async def consume() -> None:
            async for _ in loop.generate(request):
                pass

        task = asyncio.create_task(consume())
        assert await asyncio.to_thread(adding.wait, 30)
        task.cancel()  # while the add runs on the engine thread
        go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The abort was queued after the add: once a later command has run, both have.
        assert not await loop.call_async(lambda: engine.has_unfinished)
        assert request.request_id not in loop._streams

    asyncio.run(run())
    assert_all_blocks_free(engine)
