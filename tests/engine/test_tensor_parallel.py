"""Tensor parallelism on the CPU (gloo): a TP=2 engine, with its worker process, generates
exactly what the one-process engine generates, and never leaves a worker behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from engine.builtin import resolve_model_dir
from engine.engine import Engine
from engine.loader import load_model_config, load_state_dict
from engine.parallel import Shard, check_shardable, shard_state_dict, split
from engine.request import SamplingParams
from tests.engine.processes import EXIT_TIMEOUT_S, gone, wait_gone

PROMPTS: list[str | list[int]] = [
    "hello",
    "a much longer prompt that covers more than one sixteen-token KV block",
    list(range(3, 60)),
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _engine(model: str, size: int, **overrides: object) -> Engine:
    return Engine.from_model(model, num_threads=1, tensor_parallel_size=size, **overrides)


def _token_ids(engine: Engine, prompts: list[str | list[int]], params: SamplingParams) -> list:
    """The engine's outputs; then it is closed, and a TP engine's workers must exit."""
    workers = [] if engine.workers is None else engine.workers.pids
    try:
        token_ids = [output.token_ids for output in engine.generate(prompts, params)]
    finally:
        engine.close()
    assert wait_gone(workers) == [], "a worker outlived close()"
    return token_ids


# ---- sharding ---------------------------------------------------------------------------


def test_split_covers_everything_once() -> None:
    for total in (1, 3, 9, 1536):
        for size in (1, 2, 3, 4):
            if size > total:
                continue
            parts = [split(total, rank, size) for rank in range(size)]
            assert [i for part in parts for i in part] == list(range(total))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_shards_put_back_together_are_the_checkpoint() -> None:
    model_dir = resolve_model_dir("tiny-qwen2")  # q/k/v biases too
    config = load_model_config(model_dir)
    state = load_state_dict(model_dir, config.dtype)
    shards = [shard_state_dict(state, Shard(config, rank, 2)) for rank in range(2)]
    name = "model.layers.0.self_attn."
    for proj, dim in (("q_proj.weight", 0), ("k_proj.bias", 0), ("o_proj.weight", 1)):
        joined = torch.cat([shard[name + proj] for shard in shards], dim=dim)
        assert torch.equal(joined, state[name + proj])
    embed = torch.cat([shard["model.embed_tokens.weight"] for shard in shards])
    assert torch.equal(embed[: config.vocab_size], state["model.embed_tokens.weight"])
    assert not embed[config.vocab_size :].any()  # padding rows


def test_uneven_heads_follow_their_kv_group() -> None:
    config = load_model_config(resolve_model_dir("tiny"))
    small_like = type(config)(**{**_fields(config), "num_attention_heads": 9,
                                 "num_key_value_heads": 3})  # fmt: skip
    ranks = [Shard(small_like, rank, 2) for rank in range(2)]
    assert [list(r.kv_heads) for r in ranks] == [[0, 1], [2]]
    assert [list(r.q_heads) for r in ranks] == [[0, 1, 2, 3, 4, 5], [6, 7, 8]]
    assert ranks[1].num_kv_head_slots == 2


def _fields(config: object) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__slots__}  # type: ignore[attr-defined]


def test_too_many_ranks_is_a_clear_error() -> None:
    config = load_model_config(resolve_model_dir("tiny"))  # 2 KV heads
    with pytest.raises(ValueError, match="exceeds the model's 2 KV heads"):
        check_shardable(config, 3)


# ---- the engine -------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen2"])
def test_tp2_equals_tp1(model: str) -> None:
    """Mixed batch, chunked prefill (a 16-token step budget), float32."""
    budget = {"scheduler": _scheduler(max_num_batched_tokens=16)}
    expected = _token_ids(_engine(model, 1, **budget), PROMPTS, GREEDY)
    assert _token_ids(_engine(model, 2, **budget), PROMPTS, GREEDY) == expected


def test_tp2_equals_tp1_small() -> None:
    """`small` (float32 here; bfloat16 rounds sums in another order) has 3 KV heads:
    rank 0 holds two, rank 1 one."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts: list[str | list[int]] = PROMPTS[:2]
    expected = _token_ids(_engine("small", 1, dtype="float32"), prompts, params)
    assert _token_ids(_engine("small", 2, dtype="float32"), prompts, params) == expected


def test_tp2_equals_tp1_with_fp8_weights_and_kv() -> None:
    """FP8 is quantized from the full checkpoint, then sharded with its scales."""
    from engine.config import CacheConfig

    fp8 = {"quantization": "fp8", "cache": CacheConfig(kv_cache_dtype="fp8")}
    expected = _token_ids(_engine("tiny-qwen2", 1, **fp8), PROMPTS, GREEDY)
    assert _token_ids(_engine("tiny-qwen2", 2, **fp8), PROMPTS, GREEDY) == expected


def _scheduler(**fields: int) -> object:
    from engine.config import SchedulerConfig

    return SchedulerConfig(long_prefill_token_threshold=16, **fields)


def test_generate_cli_tp2_equals_tp1() -> None:
    """`pdserve generate --tensor-parallel-size 2` (greedy by default) against the TP=1 engine
    in process (the CLI's TP=1 path is `tests/app/test_cli.py`'s, against transformers)."""
    prompts: list[str | list[int]] = PROMPTS[:2]
    args = ["generate", "--model", "tiny", "--max-tokens", "16", "--json"]
    args += ["--num-threads", "1", "--tensor-parallel-size", "2"]
    for prompt in prompts:
        args += ["--prompt", str(prompt)]
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    tp2 = [o["token_ids"] for o in json.loads(result.stdout)["outputs"]]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    assert tp2 == _token_ids(_engine("tiny", 1), prompts, greedy)


# ---- no orphans (every TP=2 engine above is also checked to leave none on close) ---------


@pytest.fixture
def rank0() -> Iterator[subprocess.Popen[str]]:
    """A process holding a TP=2 engine; prints its workers' pids, then idles."""
    script = textwrap.dedent(
        """
        import sys, time
        from engine.engine import Engine
        engine = Engine.from_model("tiny", num_threads=1, tensor_parallel_size=2)
        print(" ".join(map(str, engine.workers.pids)), flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(EXIT_TIMEOUT_S)


def test_workers_exit_when_rank0_is_killed(rank0: subprocess.Popen[str]) -> None:
    assert rank0.stdout is not None
    pids = [int(pid) for pid in rank0.stdout.readline().split()]
    assert len(pids) == 1 and not gone(pids[0])
    os.kill(rank0.pid, signal.SIGKILL)
    rank0.wait(EXIT_TIMEOUT_S)
    assert wait_gone(pids) == []


def test_a_dead_worker_stops_the_engine_not_hangs_it() -> None:
    engine = _engine("tiny", 2)
    assert engine.workers is not None
    try:
        os.kill(engine.workers.pids[0], signal.SIGKILL)
        assert wait_gone(engine.workers.pids) == []
        request = engine.make_request("hello", GREEDY)
        engine.add_request(request)
        with pytest.raises(RuntimeError, match="tensor-parallel"):
            engine.step()
    finally:
        engine.close()


# ---- CUDA (scripts/gpu_check.sh) --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 on CUDA needs two GPUs")
def test_tp2_equals_tp1_on_cuda() -> None:
    """NCCL ranks on cuda:0 and cuda:1; float32, so sums may differ only in rounding."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    on_gpu = {"device": "cuda", "dtype": "float32"}
    expected = _token_ids(_engine("small", 1, **on_gpu), PROMPTS, params)
    assert _token_ids(_engine("small", 2, **on_gpu), PROMPTS, params) == expected
