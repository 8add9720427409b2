"""`pdserve bench itl`: batch-1 inter-token latency through HTTP vs the engine's bare step.

Both in one run, same model, prompt and torch thread count: first the bare engine (one
request, decode steps timed), then the disaggregated Serve app (1 prefill + 1 decode
replica, shm transfer) streamed through the official `openai` client. HTTP ITL is per
token: first to last streamed chunk over the tokens between them (a chunk can carry several
tokens, since a byte-level model's partial UTF-8 characters are held back until they
decode; `http_chunk_gap_ms` is the gap between chunks). `ratio` is HTTP ITL over the bare
decode step. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm


def bare_step_ms(model: str, prompt: list[int], output_len: int, threads: int) -> float:
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model_dir=model, num_threads=threads))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    engine.add_request(engine.make_request(prompt, params))
    engine.step()  # prefill + first token
    times = []
    for _ in tqdm(range(output_len - 1), desc="bare engine", file=sys.stderr):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.mean(times) * 1000


def http_itl_ms(
    model: str, prompt: list[int], output_len: int, threads: int, port: int
) -> dict[str, float]:
    import ray
    from openai import OpenAI
    from ray import serve

    from app.main import DEFAULT_ARGS, build_app
    from bench.serve.deploy import start_serve

    args: dict[str, Any] = {
        **DEFAULT_ARGS,
        "model": {"model": model, "num_threads": threads},
        "http": {"port": port},
    }
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        start_serve(port)
        serve.run(build_app(args), name="pdserve", route_prefix="/")
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        name = client.models.list().data[0].id

        def one() -> tuple[float, list[float], float]:
            """TTFT, gaps between text chunks, and per-token ITL (first to last chunk over
            the tokens between them). Chunks can hold several tokens: a byte-level model's
            partial UTF-8 characters are held back until they decode."""
            start = time.perf_counter()
            stream = client.completions.create(
                model=name,
                prompt=prompt,
                max_tokens=output_len,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            arrivals, num_tokens = [], 0
            for chunk in stream:
                if chunk.choices:
                    arrivals.append(time.perf_counter())
                if chunk.usage is not None:
                    num_tokens = chunk.usage.completion_tokens
            gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
            per_token = (arrivals[-1] - arrivals[0]) / max(num_tokens - 1, 1)
            return arrivals[0] - start, gaps, per_token

        one()  # warm up
        ttfts, gaps, per_token = [], [], []
        for _ in tqdm(range(3), desc="http", file=sys.stderr):
            ttft, g, itl = one()
            ttfts.append(ttft)
            gaps.extend(g)
            per_token.append(itl)
        import httpx

        pools = httpx.get(f"http://127.0.0.1:{port}/v1/pdserve/stats").json()["pools"]
        return {
            "replica_step_ms": pools["decode"]["mean_step_ms"],
            "replica_interval_ms": pools["decode"]["mean_step_interval_ms"],
            "itl_ms": statistics.mean(per_token) * 1000,
            "chunk_gap_ms": statistics.mean(gaps) * 1000,
            "ttft_ms": statistics.mean(ttfts) * 1000,
        }
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench itl", description=__doc__)
    parser.add_argument("--model", default="small", help="model directory or built-in name")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--json", action="store_true", help="(the JSON line is always printed)")
    args = parser.parse_args(argv)

    from engine.builtin import resolve_model_dir

    model = str(resolve_model_dir(args.model))
    prompt = [(i * 7 + 3) % 256 for i in range(args.input_len)]
    bare = bare_step_ms(model, prompt, args.output_len, args.threads)
    http = http_itl_ms(model, prompt, args.output_len, args.threads, args.port)
    print(
        json.dumps(
            {
                "model": model,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "threads": args.threads,
                "engine_step_ms": round(bare, 3),
                "http_itl_ms": round(http["itl_ms"], 3),
                "http_chunk_gap_ms": round(http["chunk_gap_ms"], 3),
                "http_ttft_ms": round(http["ttft_ms"], 3),
                # the decode replica's own mean step inside Serve: separates slower steps (CPU or
                # GIL contention in the replica) from time spent between steps (streaming hops)
                "serve_replica_step_ms": round(http["replica_step_ms"], 3),
                "serve_replica_step_interval_ms": round(http["replica_interval_ms"], 3),
                "ratio": round(http["itl_ms"] / bare, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
