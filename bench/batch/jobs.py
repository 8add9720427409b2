"""What `bench batch` does to a service and an engine: submit a job and follow it, measure the
engine's own offline throughput on the job's requests, probe the interactive capacity.

A job's requests are greedy completions with `ignore_eos`, so each generates exactly
`max_tokens` tokens; a job's generated tokens are its finished lines times that.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import openai

from bench.serve.capacity import Capacity, LoadPoint, closed_loop, find_saturation
from bench.serve.sse import stream_completion
from bench.serve.workloads import make_prompt

TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True, slots=True)
class JobShape:
    """The job's requests: how many, their prompt and output lengths."""

    num_requests: int
    prompt_tokens: int
    max_tokens: int
    seed: int = 0

    def prompts(self) -> list[str]:
        rng = np.random.default_rng(self.seed)
        return [make_prompt(self.prompt_tokens, rng) for _ in range(self.num_requests)]

    def jsonl(self, model: str) -> bytes:
        lines = []
        for i, prompt in enumerate(self.prompts()):
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": self.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            item = {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions"}
            lines.append(json.dumps({**item, "body": body}) + "\n")
        return "".join(lines).encode()


# Seconds between a job's polls: `pdserve batch submit --wait`'s default (each poll is an
# HTTP request through the proxy and the ingress, CPU taken from the job's engine).
POLL_S = 1.0


@dataclass(slots=True)
class JobRun:
    """One job as the client saw it: (seconds since submit, lines finished) at each poll."""

    batch_id: str = ""
    submitted_at: float = 0.0  # Unix time
    timeline: list[tuple[float, int]] = field(default_factory=list)
    wall_s: float | None = None  # submit to an observed terminal status
    final: dict[str, Any] = field(default_factory=dict)

    def tok_s(self, max_tokens: int) -> float | None:
        """Generated tokens per second of wall time (None unless it completed)."""
        counts = self.final.get("request_counts") or {}
        if self.final.get("status") != "completed" or not self.wall_s:
            return None
        return int(counts.get("completed", 0)) * max_tokens / self.wall_s

    def to_dict(self, max_tokens: int) -> dict[str, Any]:
        return {
            "batch_id": self.batch_id,
            "submitted_at": self.submitted_at,
            "wall_s": self.wall_s,
            "tok_s": self.tok_s(max_tokens),
            "status": self.final.get("status"),
            "request_counts": self.final.get("request_counts"),
            "usage": self.final.get("usage"),
            "metadata": self.final.get("metadata"),
            "timeline": [[round(t, 3), n] for t, n in self.timeline],
        }


async def run_job(
    base_url: str,
    api_key: str,
    shape: JobShape,
    model: str,
    poll_s: float = POLL_S,
    timeout_s: float = 1800.0,
    run: JobRun | None = None,
) -> JobRun:
    """Upload the job, create the batch, poll until it ends (`run`: filled as it goes)."""
    run = run or JobRun()
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=2)
    file = await client.files.create(file=("job.jsonl", shape.jsonl(model)), purpose="batch")
    t0 = time.monotonic()
    run.submitted_at = time.time()
    batch = await client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    run.batch_id = batch.id
    while batch.status not in TERMINAL:
        if time.monotonic() - t0 > timeout_s:
            await client.batches.cancel(batch.id)
            timeout_s = float("inf")  # then wait for it to stop
        await asyncio.sleep(poll_s)
        batch = await client.batches.retrieve(batch.id)
        counts = batch.request_counts
        done = counts.completed + counts.failed if counts else 0
        run.timeline.append((time.monotonic() - t0, done))
    run.wall_s = time.monotonic() - t0
    run.final = batch.model_dump()
    await client.close()
    return run


def offline_tok_s(engine_config: Any, shape: JobShape) -> dict[str, Any]:
    """The engine's own throughput on the job's requests, in this process: every prompt
    handed to `Engine.generate` at once (continuous batching, the pool's batch limits)."""
    from engine.engine import Engine
    from engine.request import SamplingParams

    engine = Engine(engine_config)
    try:
        params = SamplingParams(max_tokens=shape.max_tokens, temperature=0.0, ignore_eos=True)
        engine.generate(shape.prompts()[:2], params)  # warm-up
        started = time.perf_counter()
        outputs = engine.generate(shape.prompts(), params)
        wall_s = time.perf_counter() - started
    finally:
        engine.close()
    num_generated = sum(len(o.token_ids) for o in outputs)
    return {
        "tok_s": num_generated / wall_s,
        "wall_s": wall_s,
        "num_generated_tokens": num_generated,
        "num_threads": engine_config.num_threads,
        "max_num_seqs": engine_config.scheduler.max_num_seqs,
    }


def with_threads(engine_config: Any, num_threads: int) -> Any:
    return dataclasses.replace(engine_config, num_threads=num_threads)


async def interactive_capacity(
    base_url: str,
    api_key: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    probe_s: float,
    max_concurrency: int = 32,
) -> Capacity:
    """Requests/s of interactive-shaped requests the service sustains (closed-loop probe,
    doubling concurrency to saturation: `bench.serve.capacity`)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:

        async def send(index: int) -> bool:
            # Streamed, as the load generator sends them: a response that is not streamed
            # costs the service less per token, and would overstate this load's capacity.
            body = {
                "model": model,
                "prompt": prompts[index % len(prompts)],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            streamed = await stream_completion(client, body, time.perf_counter(), headers)
            return streamed.error is None and streamed.end_s is not None

        sent = 0

        async def point(concurrency: int) -> LoadPoint:
            nonlocal sent
            result = await closed_loop(send, concurrency, probe_s, 1.0, sent)
            sent += result.sent
            return result

        return await find_saturation(point, max_concurrency=max_concurrency)
