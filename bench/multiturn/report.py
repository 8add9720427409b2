"""The figures of one config's multi-turn run, from its turn records, and the TTFT plot.

Per turn index: TTFT p50/p90, TPOT p50, prompt tokens, the share computed (not cached:
`usage.prompt_tokens_details.cached_tokens`) and the share whose KV crossed between
replicas (`kv_transferred_tokens`, when the server reports it). Over the later turns
(every turn after a conversation's first): the same shares, TTFT p50/p90, and the prefix hit
rate: the share of later turns whose cached tokens cover their conversation's previous prompt
(its full blocks), i.e. the turn reached a replica that still held its history. `wrong`:
turns completed with another text than the offline engine's greedy answer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.multiturn.client import TurnRecord


def _quantile_ms(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else None


def _fraction(part: Iterable[int | None], whole: int) -> float | None:
    values = list(part)
    if not whole or any(v is None for v in values):
        return None
    return round(sum(v for v in values if v is not None) / whole, 4)


def summarize(records: Sequence[TurnRecord]) -> dict[str, Any]:
    """Latency and token shares of a set of turns (module docstring)."""
    done = [r for r in records if r.success]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    prompt = sum(r.prompt_tokens for r in done)
    computed = [
        None if r.cached_tokens is None else r.prompt_tokens - r.cached_tokens for r in done
    ]
    return {
        "num_turns": len(records),
        "num_completed": len(done),
        "ttft_p50_ms": _quantile_ms(ttfts, 50),
        "ttft_p90_ms": _quantile_ms(ttfts, 90),
        "tpot_p50_ms": _quantile_ms(tpots, 50),
        "prompt_tokens": prompt,
        "computed_fraction": _fraction(computed, prompt),
        "transferred_fraction": _fraction((r.transferred_tokens for r in done), prompt),
    }


def hit_rate(records: Sequence[TurnRecord], block_size: int) -> float | None:
    """The share of completed later turns whose cached tokens cover the full blocks of their
    conversation's previous prompt."""
    prompts = {(r.conversation, r.turn): r.prompt_tokens for r in records}
    hits = later = 0
    for r in records:
        previous = prompts.get((r.conversation, r.turn - 1))
        if r.turn == 0 or previous is None or not r.success or r.cached_tokens is None:
            continue
        later += 1
        hits += r.cached_tokens >= previous // block_size * block_size
    return round(hits / later, 4) if later else None


def route_kind(reason: str | None) -> str:
    """The gist of an `x-pdserve-route` reason: "whole" (decode overflow served the request
    on a prefill pool), "local" (prefilled where it decodes), "remote", or "-" (none)."""
    if not reason:
        return "-"
    if "served whole" in reason:
        return "whole"
    return "local" if "local prefill" in reason else "remote"


def conversation_shares(prefix_routing: Mapping[str, Any]) -> dict[str, float]:
    """Per pool of the ingress's prefix-routing report: the largest share of conversations
    (distinct first blocks) last sent to one replica."""
    shares = {}
    for pool, report in prefix_routing.items():
        counts = [r.get("conversations", 0) for r in (report.get("replicas") or {}).values()]
        if sum(counts):
            shares[pool] = round(max(counts) / sum(counts), 4)
    return shares


def aggregate(records: Sequence[TurnRecord], block_size: int) -> dict[str, Any]:
    """One config's report: the later turns' figures, per-turn rows, hit rate, wrong."""
    later = summarize([r for r in records if r.turn > 0])
    turns = sorted({r.turn for r in records})
    return {
        "computed_fraction_later_turns": later["computed_fraction"],
        "transferred_fraction_later_turns": later["transferred_fraction"],
        "ttft_p50_ms_later_turns": later["ttft_p50_ms"],
        "ttft_p90_ms_later_turns": later["ttft_p90_ms"],
        "tpot_p50_ms_later_turns": later["tpot_p50_ms"],
        "hit_rate": hit_rate(records, block_size),
        "wrong": sum(r.wrong for r in records),
        "failed": sum(not r.success for r in records),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "routes": dict(Counter(route_kind(r.route) for r in records)),
        "turns": [{"turn": t + 1, **summarize([r for r in records if r.turn == t])} for t in turns],
    }


def plot_ttft(configs: Mapping[str, Mapping[str, Any]], path: Path) -> None:
    """TTFT p50 (solid) and p90 (dashed) by turn, one color per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, report) in enumerate(configs.items()):
        rows = [row for row in report["turns"] if row["ttft_p50_ms"] is not None]
        x = [row["turn"] for row in rows]
        color = f"C{i}"
        ax.plot(x, [row["ttft_p50_ms"] for row in rows], "o-", color=color, label=f"{name} p50")
        ax.plot(x, [row["ttft_p90_ms"] for row in rows], "--", color=color, label=f"{name} p90")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("time to first token by turn", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
