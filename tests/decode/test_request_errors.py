"""A request that fails inside an engine fails alone, through the real servers: the prefill
pool's failure surfaces to the decode side (which retries, then prefills locally), a decode
engine failure ends only that request's stream, and every block comes back in both pools.

The fault is a test-only sampler that raises on any batch holding a marked request (its
`seed`), standing in for a bad parameter that slipped past validation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from decode.server import DecodeServer
from engine.builtin import write_builtin_model
from engine.config import EngineConfig
from engine.engine import Engine
from engine.outputs import RequestFailedError
from engine.request import SamplingParams
from engine.sampler import Sampler, SamplerOutput, SamplingBatch
from prefill.server import PrefillServer
from replica.protocol import GenerationSpec
from tests.decode.test_server import InProcessHandle, collect, wait_all_free

PROMPTS = ["a prompt long enough to span a few blocks of the paged KV cache", "tiny", "x" * 70]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
CULPRIT = SamplingParams(max_tokens=12, temperature=0.0, seed=666)


class FailsOnCulprit(Sampler):
    """Raises whenever the batch holds a row with the culprit's seed."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if any(p.seed == CULPRIT.seed for p in batch.params):
            raise IndexError("injected: the culprit's parameters break the sampler")
        return super().__call__(logits, batch)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[list[int]]:
    engine = Engine(EngineConfig(model_dir=str(model_dir)))
    return [o.token_ids for o in engine.generate([*PROMPTS, PROMPTS[0]], GREEDY)]


@pytest.fixture()
def servers(model_dir: Path) -> Iterator[tuple[PrefillServer, DecodeServer]]:
    config = EngineConfig(model_dir=str(model_dir))
    prefill = PrefillServer(config, backend="tcp")
    decode = DecodeServer(
        config, backend="tcp", prefill_pools={"p": InProcessHandle(prefill)}, deadline_s=10
    )
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


def spec(decode: DecodeServer, i: int, params: SamplingParams, pool: str | None) -> GenerationSpec:
    return GenerationSpec(
        request_id=f"r{i}-{time.monotonic_ns()}",
        prompt_token_ids=tuple(decode.engine.tokenize(PROMPTS[i % len(PROMPTS)])),
        sampling_params=params,
        prefill_pool=pool,
    )


def test_prefill_failure_surfaces_and_falls_back(servers, expected) -> None:
    """The prefill engine fails the culprit (both attempts); decode prefills it locally."""
    prefill, decode = servers
    prefill.engine.runner.sampler = FailsOnCulprit()

    async def run() -> list[list[int]]:
        specs = [spec(decode, i, GREEDY, "p") for i in range(len(PROMPTS))]
        specs.append(spec(decode, len(PROMPTS), CULPRIT, "p"))
        return list(await asyncio.gather(*(collect(decode, s) for s in specs)))

    assert asyncio.run(run()) == expected
    counters = decode.stats()["counters"]
    # Innocents whose last prefill chunk ran in the culprit's failing step fail too (their
    # KV was already streaming): they are retried like the culprit, with the same output.
    assert counters["prefill_failures"] >= 2 and counters["local_prefill_fallback"] >= 1
    assert prefill.stats()["counters"]["failed"] == counters["prefill_failures"]
    prefill.check_health()
    wait_all_free(prefill, decode)


def test_decode_failure_ends_only_that_stream(servers, expected) -> None:
    prefill, decode = servers
    decode.engine.runner.sampler = FailsOnCulprit()

    async def run() -> list[list[int] | BaseException]:
        specs = [spec(decode, i, GREEDY, None) for i in range(len(PROMPTS))]
        specs.append(spec(decode, len(PROMPTS), CULPRIT, None))
        return list(
            await asyncio.gather(*(collect(decode, s) for s in specs), return_exceptions=True)
        )

    *good, bad = asyncio.run(run())
    assert good == expected[: len(PROMPTS)]
    assert isinstance(bad, RequestFailedError) and "injected" in str(bad)
    decode.check_health()
    # The replica goes on serving, remote prefill included.
    assert asyncio.run(collect(decode, spec(decode, 0, GREEDY, "p"))) == expected[0]
    wait_all_free(prefill, decode)
