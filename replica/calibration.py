"""A replica's prefill rate, measured before it serves its first request.

Routing and admission weigh a prompt by its prefill pool's rate (`prefill_tokens_per_s`):
adaptive disaggregation compares the pool's predicted wait with a local prefill, decode
overflow lets a prefill replica take whole requests while its prompts in progress take at
most `decode_overflow_max_prompt_ms`, load shedding predicts TTFT. A replica measures that
rate on the prompts it computes, so until its first prompts have been measured and reported
every one of those rules runs blind: the static rule, a token count in place of the time
gate, no TTFT prediction. A burst of new conversations arriving at a fresh replica (a
restart, a scale-up) is placed in exactly that window: in `bench compare --workload
multiturn`, whose points each start on a fresh deployment, all of a run's first turns
(513 tokens) arrived before the rate was known and closed the token gate (256): 21 of 30
went to the decode replica for that reason alone (BENCHMARKS.md, multi-turn).

So a prefill replica computes two prompts of `CALIBRATION_TOKENS` (one chunk) before its
engine loop starts: the first warms the kernels (oneDNN's primitives, Triton's compiles;
it would slow the first real request otherwise), the second is timed the way the replica
times its prompts later (`replica.signals.prompt_tokens_per_s`: prompt tokens over the
seconds of the steps that computed them). Nothing of them stays: their blocks are freed and
forgotten by the prefix cache, and the engine's step records start empty, so the busy share
and the measured rate cover served work only.
"""

from __future__ import annotations

import time

from engine.engine import Engine
from engine.request import SamplingParams
from replica.signals import prompt_tokens_per_s

CALIBRATION_TOKENS = 512  # one chunk at the configs' long_prefill_token_threshold


def measure_prefill_rate(engine: Engine, num_tokens: int = CALIBRATION_TOKENS) -> float:
    """Prompt tokens per second of the engine's second of two `num_tokens` prompts (fewer
    if the engine's step budget, context or KV cache is smaller; 0.0 if none fits); leaves
    the engine as it found it (module docstring). Engine thread only: call it before the
    engine loop starts."""
    scheduler, pool = engine.config.scheduler, engine.kv_manager.pool
    capacity = pool.num_blocks * engine.kv_spec.block_size - 1  # and its one output token
    n = min(num_tokens, scheduler.max_num_batched_tokens, engine.max_model_len - 1, capacity)
    if n < 1:
        return 0.0
    vocab = engine.model_config.vocab_size
    # ignore_eos: a request only max_tokens ends teaches the scheduler no output length
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    rate = 0.0
    for attempt in range(2):  # distinct prompts: the second must not hit the first's blocks
        token_ids = [(attempt * n + i) * 7919 % vocab for i in range(n)]
        request = engine.make_request(token_ids, params, request_id=f"calibration-{attempt}")
        started = time.perf_counter()
        engine.add_request(request)
        while engine.has_unfinished:
            engine.step()
        rate = prompt_tokens_per_s(engine.prompt_steps, started)
    pool.reset_prefix_cache()
    engine.prompt_steps.clear()
    engine.step_times.clear()
    engine.step_seconds = engine.spare_step_seconds = 0.0
    engine.started_at = time.perf_counter()
    return rate
