"""Decode-as-orchestrator in one process: real prefill and decode servers, `local` KV transfer.

The prefill pool is reached through a small in-process stand-in for a Serve handle (the
Serve path itself is exercised end to end in tests/app).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from decode.protocol import GenerationSpec
from decode.server import DecodeServer
from engine.builtin import write_builtin_model
from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from prefill.server import PrefillServer

PROMPTS = ["a prompt long enough to span a few blocks of the paged KV cache", "tiny", "x" * 70]


class InProcessHandle:
    """Calls a server's coroutine methods like `handle.method.remote(...)` would."""

    def __init__(self, server: object, fail_times: int = 0, hang: bool = False) -> None:
        self._server = server
        self.fail_times = fail_times
        self.hang = hang  # a pool whose replicas never answer (all dead, none restarting)
        self.calls = 0

    @property
    def prefill(self) -> InProcessHandle:
        return self

    def remote(self, *args: object) -> asyncio.Future:
        self.calls += 1
        if self.hang:
            return asyncio.get_running_loop().create_future()  # never resolves
        if self.calls <= self.fail_times:

            async def dead() -> None:
                raise ConnectionError("prefill replica died")

            return asyncio.ensure_future(dead())
        return asyncio.ensure_future(self._server.prefill(*args))  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[list[int]]:
    engine = Engine(EngineConfig(model_dir=str(model_dir)))
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    return [o.token_ids for o in outputs]


@pytest.fixture()
def servers(model_dir: Path):
    config = EngineConfig(model_dir=str(model_dir))
    prefill = PrefillServer(config, backend="local")
    handle = InProcessHandle(prefill)
    decode = DecodeServer(config, backend="local", prefill_pools={"p": handle}, deadline_s=10)
    yield prefill, decode, handle
    decode.shutdown()
    prefill.shutdown()


async def collect(decode: DecodeServer, spec: GenerationSpec) -> list[int]:
    tokens: list[int] = []
    async for delta in decode.generate(spec):
        tokens.extend(delta.new_token_ids)
    return tokens


def spec_for(decode: DecodeServer, i: int, prompt: str, pool: str | None = "p") -> GenerationSpec:
    return GenerationSpec(
        request_id=f"r{i}-{time.monotonic_ns()}",
        prompt_token_ids=tuple(decode.engine.tokenize(prompt)),
        sampling_params=SamplingParams(max_tokens=12, temperature=0.0),
        prefill_pool=pool,
    )


def wait_all_free(*servers: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = [s.stats() for s in servers]  # type: ignore[attr-defined]
        if all(st["num_free_blocks"] == st["num_blocks"] for st in stats):
            return
        time.sleep(0.05)
    raise AssertionError(f"blocks still held: {stats}")


def test_remote_prefill_matches_local_generation(servers, expected) -> None:
    prefill, decode, _ = servers

    async def run() -> list[list[int]]:
        specs = [spec_for(decode, i, p) for i, p in enumerate(PROMPTS)]
        return list(await asyncio.gather(*(collect(decode, s) for s in specs)))

    assert asyncio.run(run()) == expected
    assert decode.stats()["counters"]["remote_prefill"] == len(PROMPTS)
    assert prefill.stats()["counters"]["requests"] == len(PROMPTS)
    wait_all_free(prefill, decode)


def test_local_prefill_when_no_pool_named(servers, expected) -> None:
    prefill, decode, _ = servers
    tokens = asyncio.run(collect(decode, spec_for(decode, 0, PROMPTS[0], pool=None)))
    assert tokens == expected[0]
    assert decode.stats()["counters"]["local_prefill"] == 1
    assert "requests" not in prefill.stats()["counters"]
    wait_all_free(prefill, decode)


def test_failed_prefill_retries_then_falls_back(servers, expected) -> None:
    prefill, decode, handle = servers
    handle.fail_times = 1
    assert asyncio.run(collect(decode, spec_for(decode, 0, PROMPTS[0]))) == expected[0]
    counters = decode.stats()["counters"]
    assert counters["prefill_failures"] == 1 and counters["remote_prefill"] == 1
    handle.calls, handle.fail_times = 0, 2
    assert asyncio.run(collect(decode, spec_for(decode, 1, PROMPTS[2]))) == expected[2]
    assert decode.stats()["counters"]["local_prefill_fallback"] == 1
    wait_all_free(prefill, decode)


def test_client_disconnect_frees_both_pools(servers) -> None:
    prefill, decode, _ = servers

    async def run() -> None:
        spec = GenerationSpec(
            request_id="gone",
            prompt_token_ids=tuple(decode.engine.tokenize(PROMPTS[0])),
            sampling_params=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
            prefill_pool="p",
        )
        stream = decode.generate(spec)
        async for delta in stream:
            if delta.num_output_tokens >= 3:
                break
        await stream.aclose()

    asyncio.run(run())
    wait_all_free(prefill, decode)


def test_unresponsive_prefill_pool_times_out_then_prefills_locally(model_dir, expected) -> None:
    config = EngineConfig(model_dir=str(model_dir))
    prefill = PrefillServer(config, backend="local")
    handle = InProcessHandle(prefill, hang=True)
    decode = DecodeServer(config, backend="local", prefill_pools={"p": handle}, deadline_s=0.5)
    try:
        start = time.monotonic()
        assert asyncio.run(collect(decode, spec_for(decode, 0, PROMPTS[0]))) == expected[0]
        assert time.monotonic() - start < 30
        counters = decode.stats()["counters"]
        assert counters["prefill_failures"] == 2 and counters["local_prefill_fallback"] == 1
        wait_all_free(prefill, decode)
    finally:
        decode.shutdown()
        prefill.shutdown()
