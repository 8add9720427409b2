"""Autoscaling signals and readiness of real prefill and decode servers in one process
(KV over `shm`, the prefill pool reached through an in-process stand-in for a handle)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from decode.server import DecodeServer
from engine.builtin import write_builtin_model
from engine.config import EngineConfig
from prefill.server import PrefillServer
from replica.signals import DECODE_SIGNALS, PREFILL_SIGNALS
from tests.decode.test_server import PROMPTS, InProcessHandle, collect, spec_for, wait_all_free


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture()
def servers(model_dir: Path):
    config = EngineConfig(model_dir=str(model_dir))
    prefill = PrefillServer(config, backend="shm")
    decode = DecodeServer(
        config, backend="shm", prefill_pools={"p": InProcessHandle(prefill)}, deadline_s=10
    )
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


def test_signals_before_and_after_traffic(servers) -> None:
    prefill, decode = servers
    idle_prefill = asyncio.run(prefill.record_autoscaling_stats())
    idle_decode = asyncio.run(decode.record_autoscaling_stats())
    assert set(idle_prefill) == set(PREFILL_SIGNALS) and set(idle_decode) == set(DECODE_SIGNALS)
    # The prefill rate is known before any traffic: measured at start (`replica/calibration.py`).
    calibrated = prefill.replica.calibrated_tokens_per_s
    assert calibrated > 0
    assert idle_prefill == {
        "queued_prompt_tokens": 0,
        "prefill_tokens_per_s": calibrated,
        "ttft_p90_ms": 0,
    }
    num_blocks = decode.stats()["num_blocks"]
    assert idle_decode["kv_blocks_total"] == num_blocks and idle_decode["kv_blocks_used"] == 0
    assert idle_decode["itl_p90_ms"] == 0

    async def run() -> None:
        specs = [spec_for(decode, i, p) for i, p in enumerate(PROMPTS)]
        await asyncio.gather(*(collect(decode, s) for s in specs))

    asyncio.run(run())
    wait_all_free(prefill, decode)
    busy_prefill = asyncio.run(prefill.record_autoscaling_stats())
    busy_decode = asyncio.run(decode.record_autoscaling_stats())
    assert busy_prefill["queued_prompt_tokens"] == 0  # all done
    assert busy_prefill["prefill_tokens_per_s"] > 0 and busy_prefill["ttft_p90_ms"] > 0
    assert busy_decode["itl_p90_ms"] > 0 and busy_decode["kv_blocks_used"] == 0
    assert all(isinstance(v, float) for v in {**busy_prefill, **busy_decode}.values())


def test_health_fails_when_a_kv_endpoint_is_closed(servers) -> None:
    prefill, decode = servers
    prefill.check_health()
    decode.check_health()
    assert decode.receiver is not None
    decode.receiver.close()
    with pytest.raises(RuntimeError, match="decode KV receiver cannot serve: receiver closed"):
        decode.check_health()
    prefill.sender.close()
    with pytest.raises(RuntimeError, match="prefill KV sender cannot serve: sender closed"):
        prefill.check_health()


def test_health_fails_when_the_engine_loop_is_dead(servers) -> None:
    prefill, _ = servers
    prefill.replica.loop.shutdown()
    with pytest.raises(RuntimeError, match="engine loop is dead"):
        prefill.check_health()
