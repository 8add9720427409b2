"""`pdserve bench multiturn`: N conversations of T turns against each config, side by side.

Each turn's prompt is the conversation's history: the previous prompt, the previous answer
and a new user message (`bench/serve/conversations.py`: seeded messages, exponential think
times between an answer and the next turn, conversations starting within one think time).
Every answer is greedy and checked against the offline engine's (`engine.engine.Engine` on
the same model), which also gives the answers each next prompt holds. For each config of
`--configs` the bench deploys it on a private Ray instance (`bench.serve.deploy`), warms it
up, runs every conversation at once (closed loop; a progress bar counts turns) and reports
(`bench/multiturn/report.py`) TTFT p50/p90 and TPOT per turn, the share of prompt tokens
computed and transferred in later turns, the prefix hit rate and wrong answers, plus the
ingress's prefix-routing counts (`routing.prefix` of `/v1/pdserve/stats`).

    pdserve bench multiturn --configs cpu-adaptive,cpu-colocated --json out.json

The last stdout line is one JSON object: `configs.<name>` with
`computed_fraction_later_turns`, `transferred_fraction_later_turns`,
`ttft_p50_ms_later_turns`, `wrong`, `hit_rate` and `turns` (one row per turn index). A PNG of
TTFT by turn goes beside the JSON (`--png` to choose).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.multiturn.client import Turn, TurnRecord, run_conversation, send_turn
from bench.multiturn.report import aggregate, conversation_shares, plot_ttft
from bench.serve.conversations import (
    Conversation,
    ConversationShape,
    add_conversation_args,
    conversation_shape,
    describe_shape,
    plan_conversations,
)
from bench.serve.deploy import app_args, free_port, running_app
from bench.serve.server_report import fetch_stats

WARMUP_TURNS = 2  # sent one at a time before the clock starts (not recorded)


def reference_turns(
    conversations: Sequence[Conversation], shape: ConversationShape, config_args: dict[str, Any]
) -> list[list[Turn]]:
    """Every conversation's turns with their expected answers: the offline engine answers
    turn t of all conversations at once, and its answer's token ids go into turn t+1."""
    from app.config import load_config
    from engine.engine import Engine
    from engine.request import SamplingParams

    engine = Engine(load_config(config_args).model.to_engine_config())
    tokenizer = engine.tokenizer
    params = SamplingParams(max_tokens=shape.output_len, temperature=0.0)
    prompts = [list(tokenizer(c.messages[0]).input_ids) for c in conversations]
    turns: list[list[Turn]] = [[] for _ in conversations]
    for t in tqdm(range(shape.num_turns), desc="reference answers", file=sys.stderr):
        outputs = engine.generate(prompts, params)
        for c, (conversation, out) in enumerate(zip(conversations, outputs, strict=True)):
            think = conversation.start_s if t == 0 else conversation.think_s[t - 1]
            turns[c].append(Turn(c, t, tuple(prompts[c]), shape.output_len, out.text, think))
            if t + 1 < shape.num_turns:
                message = tokenizer(conversation.messages[t + 1], add_special_tokens=False)
                prompts[c] = prompts[c] + out.token_ids + list(message.input_ids)
    engine.close()
    return turns


async def run_turns(
    base_url: str, model: str, turns: list[list[Turn]], timeout_s: float, progress: bool, desc: str
) -> list[TurnRecord]:
    """Warm up, then every conversation at once; their records, in no particular order."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        for i in range(WARMUP_TURNS):  # prompts of their own: no conversation's prefix
            warm = Turn(-1, 0, (100,) * 16 + tuple(range(100 + i, 148 + i)), 4, "", 0.0)
            await send_turn(client, model, warm, time.perf_counter(), timeout_s)
        total = sum(len(t) for t in turns)
        bar = tqdm(total=total, desc=desc, file=sys.stderr, disable=not progress)
        t0 = time.perf_counter()
        try:
            results = await asyncio.gather(
                *(
                    run_conversation(client, model, c, t0, timeout_s, lambda _: bar.update(1))
                    for c in turns
                )
            )
        finally:
            bar.close()
    return [record for conversation in results for record in conversation]


def run_config(
    name: str, args: argparse.Namespace, turns: list[list[Turn]], config_args: dict[str, Any]
) -> dict[str, Any]:
    """Deploy `name`, run the conversations, report (the server's prefix routing included)."""
    from app.config import load_config

    block_size = load_config(config_args).model.block_size
    with running_app(config_args, args.num_cpus, any_port=True) as app:
        since = time.time()
        records = asyncio.run(
            run_turns(
                app.base_url,
                app.model_name,
                turns,
                args.request_timeout,
                not args.no_progress,
                name,
            )
        )
        stats = fetch_stats(app.base_url, None, since)
    report = aggregate(records, block_size)
    routing = stats.get("routing") or {}
    prefix = routing.get("prefix")
    report["prefix_routing"] = prefix or {"error": stats.get("error", "absent")}
    # The warm-up prompts (one first block for all) count as one conversation more.
    report["max_conversation_share"] = conversation_shares(prefix or {})
    return report


def human_summary(configs: dict[str, dict[str, Any]]) -> str:
    lines = ["config: later turns computed / transferred, TTFT p50 (ms), hit rate, wrong"]
    for name, r in configs.items():
        if "error" in r:
            lines.append(f"  {name}: not measured ({r['error']})")
            continue
        lines.append(
            f"  {name}: {r['computed_fraction_later_turns']} / "
            f"{r['transferred_fraction_later_turns']}, {r['ttft_p50_ms_later_turns']}, "
            f"{r['hit_rate']}, {r['wrong']} wrong, {r['failed']} failed"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve bench multiturn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--configs", default="cpu-adaptive,cpu-colocated", help="comma list")
    parser.add_argument("--conversations", type=int, default=16, help="conversations at once")
    add_conversation_args(parser, think_s=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="override the configs' model")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of each Ray instance")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="per turn (s)")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument(
        "--png", type=Path, default=None, help="TTFT by turn (default: beside --json)"
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if not names:
        parser.error("--configs: at least one config")
    try:
        shape = conversation_shape(args)
    except ValueError as exc:
        parser.error(str(exc))
    configs = {n: app_args(n, args.model, args.dtype, free_port()) for n in names}
    conversations = plan_conversations(args.conversations, shape, args.seed)
    references: dict[str, list[list[Turn]]] = {}
    results: dict[str, dict[str, Any]] = {}
    for name, config_args in configs.items():
        model = json.dumps(config_args["model"], sort_keys=True)
        if model not in references:
            print(f"reference answers for {name}'s model (offline engine)", file=sys.stderr)
            references[model] = reference_turns(conversations, shape, config_args)
        try:
            results[name] = run_config(name, args, references[model], config_args)
        except Exception as exc:  # noqa: BLE001 - one config's failure (Ray did not start) is its own entry
            print(f"{name} failed: {exc!r}", file=sys.stderr)
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    document: dict[str, Any] = {
        "run": {
            "configs": names,
            "conversations": args.conversations,
            "seed": args.seed,
            "model": args.model,
            "dtype": args.dtype,
            **describe_shape(shape),
        },
        "configs": results,
    }
    png = args.png or (args.json.with_suffix(".png") if args.json else None)
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        plot_ttft({n: r for n, r in results.items() if "error" not in r}, png)
        document["plot"] = str(png)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    print(human_summary(results), file=sys.stderr)
    print(json.dumps(document))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
