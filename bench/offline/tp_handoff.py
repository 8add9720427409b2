"""`pdserve bench tp-handoff`: time to the first token of a remotely prefilled prompt between
tensor-parallel replicas, per way of moving the KV, measured side by side.

A prefill server and a decode server run in this process (each rank of a TP replica in a
worker process of its own, one torch thread per rank), the decode server calling the
prefill server directly instead of through Ray Serve. For every mode of `--modes`
(`PREFILL_TP:DECODE_TP` with `/rank` for per-rank endpoints, e.g. `2:2`, `2:2/rank`,
`2:1`), `--rounds` times with the modes alternated: `--warmup` requests, then
`--requests` greedy requests of `--tokens` random prompt tokens and one new token, sent
one at a time; the median ms from the request to its first token. Each request's KV must
come over the transfer (a local fallback fails the bench).

    pdserve bench tp-handoff --model small --backend shm --modes 2:2,2:2/rank --json out.json

The last stdout line is the result as one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from decode.server import DecodeServer
from engine.builtin import resolve_model_dir
from engine.config import EngineConfig
from engine.loader import load_model_config
from engine.request import SamplingParams
from prefill.server import PrefillServer
from replica.protocol import GenerationSpec


class DirectPool:
    """The decode server's handle on one prefill server, called in this process as
    `handle.<method>.remote(...)` would call it through Serve."""

    def __init__(self, server: PrefillServer, method: str = "prefill") -> None:
        self._server, self._method = server, method

    @property
    def prefill(self) -> DirectPool:
        return DirectPool(self._server, "prefill")

    @property
    def warm(self) -> DirectPool:
        return DirectPool(self._server, "warm")

    def remote(self, *args: Any) -> asyncio.Future[Any]:
        return asyncio.ensure_future(getattr(self._server, self._method)(*args))


def parse_mode(mode: str) -> tuple[int, int, bool]:
    """`"2:1"` -> (2, 1, False); `"2:2/rank"` -> (2, 2, True)."""
    sizes, _, how = mode.partition("/")
    prefill, _, decode = sizes.partition(":")
    if how not in ("", "rank") or not prefill.isdigit() or not decode.isdigit():
        raise argparse.ArgumentTypeError(f"a mode is PREFILL_TP:DECODE_TP[/rank], not {mode!r}")
    return int(prefill), int(decode), how == "rank"


def run_mode(
    model_dir: str, backend: str, mode: str, prompts: list[tuple[int, ...]], warmup: int
) -> list[float]:
    """Request ms to the first token of each prompt after the first `warmup`."""
    prefill_tp, decode_tp, per_rank = parse_mode(mode)

    def config(size: int) -> EngineConfig:
        return EngineConfig(model_dir=model_dir, num_threads=1, tensor_parallel_size=size)

    prefill = PrefillServer(config(prefill_tp), backend=backend, per_rank=per_rank)
    decode = DecodeServer(
        config(decode_tp),
        backend=backend,
        prefill_pools={"p": DirectPool(prefill)},
        deadline_s=60,
        per_rank=per_rank,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def first_token_ms(i: int, ids: tuple[int, ...]) -> float:
        spec = GenerationSpec(
            request_id=f"{mode}-{i}", prompt_token_ids=ids, sampling_params=params, prefill_pool="p"
        )
        start = time.perf_counter()
        async for _ in decode.generate(spec):
            pass
        return (time.perf_counter() - start) * 1000

    async def run() -> list[float]:
        return [await first_token_ms(i, ids) for i, ids in enumerate(prompts)]

    try:
        times = asyncio.run(run())
        counters = decode.stats()["counters"]
    finally:
        for server in (decode, prefill):
            server.shutdown()
            server.engine.close()
    if counters.get("remote_prefill", 0) != len(prompts):
        raise SystemExit(f"{mode}: not every prompt's KV came over the transfer: {counters}")
    return times[warmup:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve bench tp-handoff",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--model", default="small", help="a built-in name or a model directory")
    parser.add_argument("--backend", default="shm", choices=["shm", "tcp"])
    parser.add_argument("--modes", default="2:2,2:2/rank", help="comma-separated modes")
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="the modes alternated this often")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    options = parser.parse_args(argv)
    modes = options.modes.split(",")
    for mode in modes:
        parse_mode(mode)
    model_dir = str(resolve_model_dir(options.model))
    rng = np.random.default_rng(options.seed)
    vocab_size = load_model_config(model_dir, None).vocab_size
    count = options.warmup + options.requests
    prompts = [
        tuple(int(t) for t in rng.integers(10, vocab_size, options.tokens)) for _ in range(count)
    ]
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    with tqdm(total=options.rounds * len(modes), desc="modes", file=sys.stderr) as bar:
        for _ in range(options.rounds):
            for mode in modes:
                times = run_mode(model_dir, options.backend, mode, prompts, options.warmup)
                runs[mode].append(
                    {"p50_ms": statistics.median(times), "mean_ms": statistics.fmean(times)}
                )
                bar.update()
    result: dict[str, Any] = {
        "model": options.model,
        "backend": options.backend,
        "tokens": options.tokens,
        "requests": options.requests,
        "host": platform.processor() or platform.machine(),
        "p50_ms_by_round": {mode: [r["p50_ms"] for r in rs] for mode, rs in runs.items()},
        "runs": runs,
    }
    if options.json is not None:
        options.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
