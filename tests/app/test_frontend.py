"""The frontend's failure mapping (app/frontend.py): what a caller sees when a decode replica
dies under its request or the engine fails the request alone.

The decode pool is a stand-in handle that streams one delta and then raises what Ray raises
in those cases; everything else (config, tokenizer, router) is real.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from app.config import load_config
from app.errors import BadRequestError, InternalServerError, ReplicaLostError, error_response
from app.frontend import Frontend
from app.prepared import Entry
from engine.builtin import write_builtin_model
from engine.outputs import RequestFailedError, RequestOutput
from engine.request import InvalidRequestError, SamplingParams
from replica.protocol import GenerationSpec


class _Stream:
    """A decode stream: `num_deltas` deltas (one by default), then `error`."""

    def __init__(
        self,
        spec: GenerationSpec,
        error: BaseException,
        num_deltas: int = 1,
        gate: asyncio.Event | None = None,
    ) -> None:
        self.spec = spec
        self.error = error
        self.num_deltas = num_deltas
        self.gate = gate  # set: the stream goes on (None: at once)
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[RequestOutput]:
        if self.gate is not None:
            await self.gate.wait()
        for _ in range(self.num_deltas):
            yield RequestOutput(self.spec.request_id, [5], "x", [], False, None, 3, 1)
        raise self.error

    def cancel(self) -> None:
        self.cancelled = True


class _DyingDecodePool:
    """Stands in for a decode pool's DeploymentHandle whose replica fails mid-stream."""

    def __init__(
        self, error: BaseException, num_deltas: int = 1, gate: asyncio.Event | None = None
    ) -> None:
        self.error = error
        self.num_deltas = num_deltas
        self.gate = gate
        self.generate = self

    def options(self, stream: bool) -> _DyingDecodePool:
        return self

    def remote(self, spec: GenerationSpec) -> _Stream:
        return _Stream(spec, self.error, self.num_deltas, self.gate)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


def frontend(
    model_dir: Path, error: BaseException, num_deltas: int = 1, gate: asyncio.Event | None = None
) -> Frontend:
    config = load_config(
        {
            "model": {"model": str(model_dir)},
            "pools": [
                {"name": "prefill", "role": "prefill"},
                {"name": "decode", "role": "decode"},
            ],
        }
    )
    return Frontend(config, {"decode": _DyingDecodePool(error, num_deltas, gate)})


def computing(front: Frontend) -> int:
    """The prompt tokens decode overflow counts as computing, over both pools."""
    return sum(front.overflow.computing(pool) for pool in ("prefill", "decode"))


async def run_to_error(front: Frontend) -> tuple[list[str], BaseException]:
    prompt_ids = await front.tokenize_prompt("hello")
    prepared = front.prepare(front.authenticate(None), prompt_ids, SamplingParams(max_tokens=4))
    texts: list[str] = []
    with pytest.raises(Exception) as info:
        async for _, delta in front.run(prepared):
            assert computing(front) == 0  # the first output ended the prompt's computing
            texts.append(delta.new_text)
    assert front.in_flight[prepared.tenant] == 0
    assert front.overflow.running("decode") == 0  # the stream ended: decode overflow forgets it
    assert computing(front) == 0
    return texts, info.value


def test_a_prompt_computes_until_its_first_output_or_its_end(model_dir: Path) -> None:
    """Decode overflow counts a request's prompt tokens where they compute, from the send
    to the first output, and forgets them when the request fails before any."""

    async def run() -> None:
        gate = asyncio.Event()
        error = RequestFailedError("failed in the engine")
        front = frontend(model_dir, error, num_deltas=0, gate=gate)
        prompt_ids = await front.tokenize_prompt("hello")
        prepared = front.prepare(front.authenticate(None), prompt_ids, SamplingParams(max_tokens=4))
        first = asyncio.ensure_future(front.run(prepared).__anext__())
        for _ in range(100):  # until the stream was sent (it then waits at the gate)
            if computing(front):
                break
            await asyncio.sleep(0)
        assert computing(front) == len(prompt_ids)
        gate.set()
        with pytest.raises(InternalServerError, match="generation failed for this request"):
            await first
        assert computing(front) == 0

    asyncio.run(run())


@pytest.mark.parametrize(
    "error",
    [ActorDiedError(), ActorUnavailableError("replica unreachable", None)],
    ids=["died", "unavailable"],
)
def test_lost_decode_replica_is_a_503_replica_lost(model_dir: Path, error: Exception) -> None:
    texts, raised = asyncio.run(run_to_error(frontend(model_dir, error)))
    assert texts == ["x"]  # what streamed before the loss was delivered
    assert isinstance(raised, ReplicaLostError)
    status, body = error_response(raised)
    assert status == 503
    assert body["error"]["code"] == "replica_lost"
    assert "retry" in body["error"]["message"]


def test_request_failed_in_engine_is_a_500_naming_it(model_dir: Path) -> None:
    error = RequestFailedError("sampler raised IndexError")
    _, raised = asyncio.run(run_to_error(frontend(model_dir, error)))
    assert isinstance(raised, InternalServerError)
    status, body = error_response(raised)
    assert (status, body["error"]["code"]) == (500, "request_failed")
    assert "IndexError" not in body["error"]["message"]  # engine internals stay in the logs


def test_stop_token_ids_are_checked_against_the_vocabulary(model_dir: Path) -> None:
    front = frontend(model_dir, ActorDiedError())
    vocab = front.model_config.vocab_size
    front.check_params(SamplingParams(stop_token_ids=(vocab - 1,)))
    for bad in (vocab, 10**9):
        with pytest.raises(InvalidRequestError, match="^stop_token_ids"):
            params = SamplingParams(stop_token_ids=(bad,), min_tokens=1)
            entry = Entry(model=None, sampling_params=lambda p=params: p, prompt=[1, 2])
            asyncio.run(front.admit(front.authenticate(None), entry))


def test_prompt_ids_are_checked_once_with_the_prompt_named(model_dir: Path) -> None:
    front = frontend(model_dir, ActorDiedError())
    vocab = front.model_config.vocab_size
    for bad, message in (([1, vocab], "prompt token ids"), ([1, -1], "prompt token ids")):
        with pytest.raises(BadRequestError) as info:
            front.prepare(
                front.authenticate(None), bad, SamplingParams(max_tokens=4), prompt_param="messages"
            )
        status, body = error_response(info.value)
        assert status == 400
        assert body["error"]["param"] == "messages"
        assert body["error"]["message"].startswith(message)
