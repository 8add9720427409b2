"""How much the first remote prefill on an unused path costs (BENCHMARKS.md, "a cold remote
path"). Two measurements:

    # a fresh deployment: 3 chat turns, then 768-token prompts one at a time, optionally
    # after an idle period; client TTFT and the server's TTFT breakdown of each
    python scripts/cold_remote_path.py deploy --config cpu-disagg --idle 65
    # from a `pdserve bench compare` file: each point's first remotely prefilled request
    python scripts/cold_remote_path.py points docs/bench/compare-mixed-tiny.json.gz
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import time
from pathlib import Path

import httpx

from bench.compare import store
from bench.serve.deploy import app_args, free_port, running_app
from bench.serve.metrics import route_kind

PHASES = ("queue_ms", "prefill_ms", "handover_ms", "total_ms")


def send(url: str, model: str, text: str, max_tokens: int) -> tuple[float, float]:
    """(send time, client TTFT in ms) of one streamed completion."""
    body = {
        "model": model,
        "prompt": text,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    start = time.time()
    first = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data:") and "choices" in line:
                first = time.time()
    assert first is not None, "no token streamed"
    return start, (first - start) * 1000


def deploy(args: argparse.Namespace) -> None:
    rng = random.Random(0)

    def prompt(n: int) -> str:  # one token per byte; every prompt new (no prefix cache)
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))

    config = app_args(args.config, "tiny", "float32", free_port())
    with running_app(config, 2, any_port=True) as app:
        url = app.base_url
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for i in range(3):
            print(f"chat {i}: TTFT {send(url, model, prompt(64), 32)[1]:.1f} ms")
        for i in range(5):
            if i == 3 and args.idle:
                print(f"idle {args.idle} s")
                time.sleep(args.idle)
            start, ttft = send(url, model, prompt(768), 16)
            time.sleep(0.3)  # the breakdown is recorded when the stream ends
            stats = httpx.get(f"{url}/v1/pdserve/stats", params={"since": start - 0.01}).json()
            b = stats["ttft_breakdown"]
            phases = ", ".join(f"{k} {b[k]['p50']:.1f}" for k in PHASES)
            print(f"long {i}: TTFT {ttft:.1f} ms, remote {b['num_remote_prefill']}; {phases}")


def points(args: argparse.Namespace) -> None:
    report = store.load_json(Path(args.file))
    for config, runs in report["runs"].items():
        firsts: list[float] = []
        next_three: list[float] = []
        for run in runs:
            for point in run["points"]:
                ordered = sorted(point["records"], key=lambda r: r["start_s"])
                remote = [r for r in ordered if r["success"] and route_kind(r["route"]) == "remote"]
                if remote:
                    firsts.append(remote[0]["ttft_ms"])
                    next_three += [r["ttft_ms"] for r in remote[1:4]]
        if firsts:
            print(
                f"{config}: first remote TTFT per point {min(firsts):.0f}-{max(firsts):.0f} ms "
                f"(median {statistics.median(firsts):.0f}); next three: median "
                f"{statistics.median(next_three):.0f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("deploy", help="measure on a fresh local deployment of a config")
    d.add_argument("--config", default="cpu-adaptive")
    d.add_argument("--idle", type=float, default=0.0, help="seconds idle before the 4th prompt")
    p = sub.add_parser("points", help="first remote request of each point in a compare file")
    p.add_argument("file")
    args = parser.parse_args()
    deploy(args) if args.command == "deploy" else points(args)


if __name__ == "__main__":
    main()
