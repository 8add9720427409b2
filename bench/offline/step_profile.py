"""Where an engine step's time goes on this CPU: torch.profiler op tables of one prefill step
(the whole batch's prompts) and a few decode steps (`pdserve bench engine --profile`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from torch.profiler import ProfilerActivity, profile

if TYPE_CHECKING:
    from engine.engine import Engine

TOP_OPS = 12


def profile_steps(
    engine: Engine, prompts: list[list[int]], decode_steps: int = 4
) -> dict[str, list[dict[str, Any]]]:
    """Profile the prefill step of `prompts` and `decode_steps` decode steps after it; print
    each op table to stderr and return the top ops per step kind (self time per step)."""
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=decode_steps + 2, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(engine.make_request(prompt, params))
    with profile(activities=[ProfilerActivity.CPU]) as prefill:
        engine.step()
    engine.step()  # the first decode step, unprofiled
    with profile(activities=[ProfilerActivity.CPU]) as decode:
        for _ in range(decode_steps):
            engine.step()
    while engine.has_unfinished:
        engine.step()
    result = {}
    for name, prof, steps in (("prefill", prefill, 1), ("decode", decode, decode_steps)):
        averages = prof.key_averages()
        print(f"\n{name}: {steps} step(s)", file=sys.stderr)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)
        total_us = sum(e.self_cpu_time_total for e in averages)
        top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]
        result[name] = [
            {
                "op": e.key,
                "ms_per_step": round(e.self_cpu_time_total / steps / 1e3, 3),
                "calls_per_step": round(e.count / steps, 1),
                "share": round(e.self_cpu_time_total / total_us, 3),
            }
            for e in top
        ]
    return result
