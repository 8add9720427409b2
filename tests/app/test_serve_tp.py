"""Tensor parallelism through Serve: prefill and decode pools both TP=2 (gloo worker
processes), KV shards moving over shared memory from prefill rank i to decode rank i,
greedy output token for token what one-process (TP=1) engines produce."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import ray
from pydantic import ValidationError

from app.config import PDServeConfig
from decode.server import DecodeServer
from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from kvtransfer.ranks import GroupReceiver, GroupSender
from prefill.server import PrefillServer
from replica.protocol import GenerationSpec
from tests.decode.test_server import InProcessHandle

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

MODEL = "pdserve-tiny"
PROMPTS = [
    "hello",
    "a prompt long enough to fill a couple of sixteen-token KV blocks, and then some more",
]
MAX_TOKENS = 16
EXIT_TIMEOUT_S = 30.0


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {
            "model": str(model_dir),
            "dtype": "float32",
            "num_threads": 1,
            "kv_cache_bytes": 16 * 1024**2,
            "tensor_parallel_size": 2,
        },
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.25},
            {"name": "decode", "role": "decode", "num_cpus": 0.25},
        ],
        "transfer": {"backend": "shm", "deadline_s": 30.0},
        "local_prefill_threshold": 0,  # every prompt goes to the prefill pool
    }


@pytest.fixture(scope="module")
def tp1_texts(model_dir: Path) -> list[str]:
    """The same prompts through a one-process engine (TP=1)."""
    engine = Engine.from_model(str(model_dir), num_threads=1, dtype="float32")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return [output.text for output in engine.generate(PROMPTS, params)]


def _tp_workers() -> dict[int, list[int]]:
    """Live `engine.tp_worker` processes of this user, by parent pid."""
    workers: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if b"engine.tp_worker" in cmdline and fields[0] not in ("Z", "X"):
            workers.setdefault(int(fields[1]), []).append(int(entry))
    return workers


def _replica_pid(server: Server, pool: str) -> int:
    return int(server.stats()["pools"][pool]["replica"].rsplit(":", 1)[1])


def test_tp2_disaggregated_equals_tp1(server: Server, tp1_texts: list[str], hf: HFGreedy) -> None:
    from tests.app.conftest import wait_until

    client = server.openai()
    before = server.stats()["pools"]["decode"]["counters"].get("remote_prefill", 0)
    texts = []
    for prompt in PROMPTS:
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        texts.append(out.choices[0].text)
        wait_until(lambda: not server.busy_pools(), 30, "every block free after the request")
    assert texts == tp1_texts
    assert texts == [hf.complete(prompt, MAX_TOKENS).text for prompt in PROMPTS]
    counters = server.stats()["pools"]["decode"]["counters"]
    assert counters.get("remote_prefill", 0) - before == len(PROMPTS)  # KV came over shm


def test_streamed_chat_equals_tp1_engine(server: Server, model_dir: Path) -> None:
    messages = [{"role": "user", "content": "say something"}]
    engine = Engine.from_model(str(model_dir), num_threads=1, dtype="float32")
    prompt_ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = prompt_ids["input_ids"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = engine.generate([list(prompt_ids)], params)[0].text
    stream = server.openai().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == expected


def test_each_replica_runs_one_worker(server: Server) -> None:
    workers = _tp_workers()
    for pool in ("prefill", "decode"):
        assert len(workers.get(_replica_pid(server, pool), [])) == 1, (pool, workers)


def test_killed_replica_leaves_no_worker(server: Server, tp1_texts: list[str]) -> None:
    from tests.app.conftest import wait_until

    decode_pid = _replica_pid(server, "decode")
    (worker,) = _tp_workers()[decode_pid]
    killed = 0
    for info in ray.util.list_named_actors(all_namespaces=True):
        if info["name"].startswith("SERVE_REPLICA::pdserve#decode#"):
            ray.kill(ray.get_actor(info["name"], namespace=info["namespace"]), no_restart=True)
            killed += 1
    assert killed == 1
    wait_until(
        lambda: all(worker not in pids for pids in _tp_workers().values()),
        EXIT_TIMEOUT_S,
        "the killed decode replica's TP worker to exit",
    )
    # Serve restarts the replica, with a worker of its own, and it serves the same text.
    wait_until(lambda: "error" not in server.stats()["pools"]["decode"], 180, "decode back")
    out = server.openai().completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.choices[0].text == tp1_texts[1]


# ---- the same servers without Ray (every transfer backend on the CPU) -------------------


async def _remote_text(decode: DecodeServer, request_id: str, prompt: str) -> str:
    """`prompt`'s greedy text through `decode`, its prompt prefilled on pool "p"."""
    spec = GenerationSpec(
        request_id=request_id,
        prompt_token_ids=tuple(decode.engine.tokenize(prompt)),
        sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        prefill_pool="p",
    )
    return "".join([delta.new_text async for delta in decode.generate(spec)])


@pytest.mark.parametrize("backend", ["shm", "tcp"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (2, 1), (1, 2)])
def test_tp_servers_in_process_equal_tp1(
    model_dir: Path, tp1_texts: list[str], backend: str, prefill_tp: int, decode_tp: int
) -> None:
    """Prefill TP=a into decode TP=b: KV heads re-sharded on the way when a != b."""

    def config(size: int) -> EngineConfig:
        return EngineConfig(model_dir=str(model_dir), num_threads=1, tensor_parallel_size=size)

    prefill = PrefillServer(config(prefill_tp), backend=backend)
    handle = InProcessHandle(prefill)
    decode = DecodeServer(
        config(decode_tp), backend=backend, prefill_pools={"p": handle}, deadline_s=60
    )

    async def run() -> list[str]:
        texts = (_remote_text(decode, f"r{i}", p) for i, p in enumerate(PROMPTS))
        return list(await asyncio.gather(*texts))

    try:
        assert asyncio.run(run()) == tp1_texts
        assert decode.stats()["counters"]["remote_prefill"] == len(PROMPTS)
    finally:
        for server in (decode, prefill):
            server.shutdown()
            server.engine.close()


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_per_rank_endpoints_in_process_equal_tp1(
    model_dir: Path, tp1_texts: list[str], backend: str
) -> None:
    """Prefill TP=2 into decode TP=2 with one endpoint per rank (`kvtransfer.ranks`), every
    rank in its own process with its own KV shard, as CUDA ranks run: the same tokens, the
    KV over the transfer (no local prefill), every block back after each request."""
    from tests.app.conftest import wait_until

    def config() -> EngineConfig:
        return EngineConfig(model_dir=str(model_dir), num_threads=1, tensor_parallel_size=2)

    prefill = PrefillServer(config(), backend=backend, per_rank=True)
    decode = DecodeServer(
        config(),
        backend=backend,
        prefill_pools={"p": InProcessHandle(prefill)},
        deadline_s=60,
        per_rank=True,
    )
    assert isinstance(prefill.sender, GroupSender)
    assert isinstance(decode.receiver, GroupReceiver)

    try:
        for i, prompt in enumerate(PROMPTS):
            assert asyncio.run(_remote_text(decode, f"r{i}", prompt)) == tp1_texts[i]
            for server in (decode, prefill):
                wait_until(
                    lambda s=server: s.stats()["num_free_blocks"] == s.stats()["num_blocks"],
                    30,
                    "every block back after the request",
                )
        counters = decode.stats()["counters"]
        assert counters["remote_prefill"] == len(PROMPTS), counters
        assert "local_prefill_fallback" not in counters, counters
        assert decode.receiver.transfer_counts()["num_open"] == 0
    finally:
        for server in (decode, prefill):
            server.shutdown()
            server.engine.close()


# ---- configuration ----------------------------------------------------------------------


def test_a_pool_may_set_its_own_tp_size() -> None:
    config = PDServeConfig.model_validate(
        {
            "model": {"tensor_parallel_size": 2},
            "pools": [
                {"name": "p", "role": "prefill", "engine": {"tensor_parallel_size": 4}},
                {"name": "d", "role": "decode"},
            ],
        }
    )
    sizes = {p.name: config.engine_config(p).tensor_parallel_size for p in config.pools}
    assert sizes == {"p": 4, "d": 2}
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        PDServeConfig.model_validate(
            {"pools": [{"name": "d", "role": "decode", "engine": {"tensor_parallel_size": 0}}]}
        )


def test_cuda_tp_needs_a_gpu_per_rank_and_moves_kv_per_rank() -> None:
    colocated = {"local_prefill_threshold": 10**6}
    with pytest.raises(ValidationError, match="set num_gpus to 4"):
        PDServeConfig.model_validate(
            {
                "model": {"tensor_parallel_size": 4, "device": "cuda"},
                "pools": [{"name": "d", "role": "decode", "num_gpus": 1}],
                **colocated,
            }
        )
    disaggregated: dict[str, Any] = {
        "model": {"tensor_parallel_size": 2, "device": "cuda"},
        "pools": [
            {"name": "p", "role": "prefill", "num_gpus": 2},
            {"name": "d", "role": "decode", "num_gpus": 2},
        ],
        "transfer": {"backend": "nccl"},
    }
    config = PDServeConfig.model_validate(disaggregated)
    assert all(config.per_rank_transfer(pool) for pool in config.pools)
    with pytest.raises(ValidationError, match="transfer.per_rank must not be false"):
        PDServeConfig.model_validate(
            {**disaggregated, "transfer": {"backend": "nccl", "per_rank": False}}
        )
    wide_prefill = [
        {"name": "p", "role": "prefill", "num_gpus": 4, "engine": {"tensor_parallel_size": 4}},
        {"name": "d", "role": "decode", "num_gpus": 2},
    ]
    with pytest.raises(ValidationError, match=r"same tensor_parallel_size \(got p: 4, d: 2\)"):
        PDServeConfig.model_validate({**disaggregated, "pools": wide_prefill})
    PDServeConfig.model_validate(
        {
            "model": {"tensor_parallel_size": 2, "device": "cuda"},
            "pools": [{"name": "d", "role": "decode", "num_gpus": 2}],
            **colocated,
        }
    )
    # On the CPU rank 0's one endpoint re-shards between sizes; per rank, sizes must agree.
    cpu = {**disaggregated, "model": {"tensor_parallel_size": 2}, "transfer": {"backend": "shm"}}
    assert not PDServeConfig.model_validate(cpu).per_rank_transfer(config.pools[0])
    with pytest.raises(ValidationError, match="same tensor_parallel_size"):
        PDServeConfig.model_validate(
            {**cpu, "pools": wide_prefill, "transfer": {"backend": "shm", "per_rank": True}}
        )
