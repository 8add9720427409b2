"""An FP8 KV cache across a disaggregated transfer: real prefill and decode servers in this
process, KV over `shm` (the decode cache in shared memory, written by the prefill side),
give the colocated FP8 engine's greedy tokens, token for token, moving FP8 bytes."""

from __future__ import annotations

import asyncio
import time

import pytest

from decode.server import DecodeServer
from engine.builtin import write_builtin_model
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.kv_cache import KVCacheSpec
from engine.loader import load_model_config
from engine.request import SamplingParams
from prefill.server import PrefillServer
from replica.protocol import GenerationSpec

PROMPTS = ["a prompt long enough to span a few blocks of the paged KV cache", "tiny", "x" * 70]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class InProcessHandle:
    """Calls the prefill server like `handle.prefill.remote(...)` would."""

    def __init__(self, server: PrefillServer) -> None:
        self._server = server

    @property
    def prefill(self) -> InProcessHandle:
        return self

    def remote(self, *args: object) -> asyncio.Future:
        return asyncio.ensure_future(self._server.prefill(*args))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    model_dir = write_builtin_model(tmp_path_factory.mktemp("tiny"), "tiny")
    return EngineConfig(
        model_dir=str(model_dir),
        dtype="bfloat16",
        quantization="fp8",
        cache=CacheConfig(kv_cache_bytes=2 * 1024 * 1024, kv_cache_dtype="fp8"),
    )


async def collect(decode: DecodeServer, prompt: str, i: int) -> list[int]:
    spec = GenerationSpec(
        request_id=f"fp8-{i}-{time.monotonic_ns()}",
        prompt_token_ids=tuple(decode.engine.tokenize(prompt)),
        sampling_params=PARAMS,
        prefill_pool="p",
    )
    tokens: list[int] = []
    async for delta in decode.generate(spec):
        assert delta.error is None, delta.error
        tokens.extend(delta.new_token_ids)
    return tokens


def test_disaggregated_fp8_equals_colocated_fp8(config: EngineConfig) -> None:
    colocated = Engine(config)
    expected = [o.token_ids for o in colocated.generate(PROMPTS, PARAMS)]
    assert colocated.kv_spec.dtype == "float8_e4m3fn"

    prefill = PrefillServer(config, backend="shm")
    decode = DecodeServer(
        config, backend="shm", prefill_pools={"p": InProcessHandle(prefill)}, deadline_s=30
    )
    try:

        async def run() -> list[list[int]]:
            return list(
                await asyncio.gather(*(collect(decode, p, i) for i, p in enumerate(PROMPTS)))
            )

        assert asyncio.run(run()) == expected
        assert decode.stats()["counters"]["remote_prefill"] == len(PROMPTS)
        # What moved was FP8: one byte per K/V value, half of what a bf16 cache moves.
        spec = prefill.engine.kv_spec
        assert decode.engine.kv_spec == spec and spec.dtype == "float8_e4m3fn"
        bf16 = KVCacheSpec.for_model(
            load_model_config(config.model_dir, "bfloat16"),
            spec.block_size,
            config.cache.kv_cache_bytes,
            "bfloat16",
        )
        assert 2 * spec.bytes_per_block == bf16.bytes_per_block
        moved = prefill.stats()["counters"]["kv_transfer_bytes"]
        blocks = sum(-(-len(decode.engine.tokenize(p)) // spec.block_size) for p in PROMPTS)
        assert moved == blocks * spec.bytes_per_block
    finally:
        decode.shutdown()
        prefill.shutdown()
