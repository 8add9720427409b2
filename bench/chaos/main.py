"""`pdserve bench chaos`: mixed load against a config while its replicas are killed and frozen.

The config (`configs/<name>.yaml`) is deployed on a private Ray instance (`bench.serve.deploy`).
For `--duration` seconds a Poisson load of greedy completions is sent: short prompts
(prefilled on decode) and long ones (prefilled remotely), streamed or not, each from a fixed
pool whose expected output is computed first, offline, with `engine.engine.Engine` on the
same model (`bench.chaos.load`). Its rate is `--load` (0.7) x the capacity measured on
the deployed app just before, with the same mix (closed-loop saturation, `bench.serve.capacity`),
so the faults land on a service that is busy but not saturated on any machine; `--rate`
fixes it instead. Meanwhile a seeded schedule picks, every `--fault-every` seconds or so, a
fault (SIGKILL, or SIGSTOP then SIGCONT after `--stop-s`) and a target (a prefill or decode
replica process, see `bench.serve.faults`); Serve replaces killed replicas. After each fault a probe
(a long greedy prompt, checked) is sent until one succeeds: `recovery_s`. The next fault waits
for that recovery.

Every request ends as exactly one of: completed (200 and a full answer; `wrong` counts those
whose text differs from the reference), failed_clean (a 4xx/5xx with an OpenAI error body, or
an SSE `error` event then `[DONE]`), failed_unclean (anything else: a dropped connection, a
stream that ends without `[DONE]`), hung (no answer within `--request-timeout`). A failure is
`on_killed_decode` when the request was in flight when a decode replica was SIGKILLed, or was
sent after that before the replacement was up. At the end, after the pools go idle (at most
`--idle-timeout`), `leaked_blocks` sums `num_blocks - num_free_blocks` over every pool.

    pdserve bench chaos --config cpu-disagg --duration 120 --seed 0 --json out.json

writes the JSON (summary fields at the top level, with `capacity` and the derived `rate`, then
`faults` and per-request `requests`)
and `out.png` beside it (latency of every request over time, by outcome, with the faults);
the last stdout line is the summary as one JSON object. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.chaos.load import Shape, measure_capacity, request_pool, send, with_references
from bench.chaos.report import Fault, Record, human_summary, mark_decode_kills, plot, summarize
from bench.serve.deploy import RunningApp, add_app_arguments, app_args, free_port, running_app
from bench.serve.faults import replica_pids, signal_pid, wait_for_new_replica
from bench.serve.metrics import finite_or_none

logger = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)

PROBE_TIMEOUT_S = 20.0
CAPACITY_METHOD = (
    "closed-loop saturation with the run's mix: concurrency doubled from 1 until the "
    "throughput gains < 10% twice in a row; capacity = the best throughput of requests "
    "completed with their reference text"
)


# ------------------------------------------------------------------------------------- faults


class Chaos:
    """The load, the faults and the probes of one run."""

    def __init__(
        self, app: RunningApp, app_name: str, shapes: list[Shape], args: argparse.Namespace
    ) -> None:
        self.app = app
        self.app_name = app_name
        self.shapes = shapes
        self.args = args
        # Two streams, so the faults chosen do not depend on how the load interleaves.
        self.load_rng = random.Random(args.seed)
        self.fault_rng = random.Random(args.seed + 1)
        self.records: list[Record] = []
        self.faults: list[Fault] = []
        self.probes = Counter[str]()
        self.stopped: set[int] = set()
        self.t0 = 0.0
        self.bar = tqdm(
            total=args.duration, desc="chaos", unit="s", file=sys.stderr, disable=args.no_progress
        )

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(
            base_url=self.app.base_url, limits=limits, timeout=self.args.request_timeout
        ) as client:
            self.t0 = time.monotonic()
            try:
                await asyncio.gather(self._load(client), self._inject(client), self._tick())
            finally:
                for pid in list(self.stopped):  # never leave a process frozen
                    signal_pid(pid, signal.SIGCONT)
        self.bar.close()

    async def _tick(self) -> None:
        for _ in range(int(self.args.duration)):
            await asyncio.sleep(1.0)
            counts = Counter(r.outcome for r in self.records if r.end_s)
            wrong = sum(r.wrong for r in self.records)
            self.bar.set_postfix(
                sent=len(self.records),
                wrong=wrong,
                faults=len(self.faults),
                **{k: counts[k] for k in ("completed", "failed_clean", "hung")},
            )
            self.bar.update(1)

    async def _load(self, client: httpx.AsyncClient) -> None:
        tasks: list[asyncio.Task[None]] = []
        t = self.load_rng.expovariate(self.args.rate)
        while t < self.args.duration:
            await asyncio.sleep(max(0.0, t - self.now()))
            i = self.load_rng.randrange(len(self.shapes))
            stream = self.load_rng.random() < 0.5
            record = Record(len(self.records), self.shapes[i].label, i, stream, self.now())
            self.records.append(record)
            tasks.append(asyncio.create_task(self._one(client, self.shapes[i], record)))
            t += self.load_rng.expovariate(self.args.rate)
        await asyncio.gather(*tasks)

    async def _one(self, client: httpx.AsyncClient, shape: Shape, record: Record) -> None:
        timeout = self.args.request_timeout
        record.outcome, text, record.status, record.error = await send(
            client, self.app.model_name, shape, record.stream, timeout
        )
        record.end_s = self.now()
        if text is not None and text != shape.expected:
            record.wrong, record.wrong_text = True, text

    async def _inject(self, client: httpx.AsyncClient) -> None:
        next_at = self.args.first_fault
        last_fault_by = self.args.duration - self.args.quiet_tail
        while next_at < last_fault_by:
            await asyncio.sleep(max(0.0, next_at - self.now()))
            target = self.fault_rng.choice(self.args.targets)
            what = self.fault_rng.choice(self.args.faults)
            pids = await asyncio.to_thread(replica_pids, self.app_name, target)
            if not pids:
                logger.warning("no live %s replica to fault at %.1f s", target, self.now())
                next_at = self.now() + 1.0
                continue
            pid = self.fault_rng.choice(pids)
            fault = Fault("SIGKILL" if what == "kill" else "SIGSTOP", target, pid, self.now())
            self.faults.append(fault)
            tqdm.write(f"[{fault.at_s:6.1f} s] {fault.what} {target} pid {pid}", file=sys.stderr)
            if what == "kill":
                signal_pid(pid, signal.SIGKILL)
                await self._recover(client, fault, {pid})
            else:
                self.stopped.add(pid)
                signal_pid(pid, signal.SIGSTOP)
                probe = asyncio.create_task(self._probe_until_success(client, fault))
                await asyncio.sleep(self.args.stop_s)
                signal_pid(pid, signal.SIGCONT)
                self.stopped.discard(pid)
                fault.resumed_s = self.now()
                await probe
            gap = self.fault_rng.uniform(0.5, 1.5) * self.args.fault_every
            next_at = max(fault.at_s + gap, self.now() + self.args.min_gap)

    async def _recover(self, client: httpx.AsyncClient, fault: Fault, old: set[int]) -> None:
        async def restarted() -> None:
            pid = await asyncio.to_thread(
                wait_for_new_replica,
                self.app_name,
                fault.target,
                old,
                self.args.recovery_timeout,
            )
            if pid is not None:
                fault.restart_s = round(self.now() - fault.at_s, 2)

        await asyncio.gather(restarted(), self._probe_until_success(client, fault))

    async def _probe_until_success(self, client: httpx.AsyncClient, fault: Fault) -> None:
        probes = [s for s in self.shapes if s.label == "long"] or self.shapes
        deadline = fault.at_s + self.args.recovery_timeout
        i = 0
        while self.now() < deadline:
            shape = probes[i % len(probes)]
            outcome, text, _, _ = await send(
                client, self.app.model_name, shape, False, PROBE_TIMEOUT_S
            )
            self.probes["sent"] += 1
            self.probes["wrong"] += text is not None and text != shape.expected
            if outcome == "completed" and text == shape.expected:
                fault.recovery_s = round(self.now() - fault.at_s, 2)
                return
            i += 1
            await asyncio.sleep(0.5)


# ------------------------------------------------------------------------------------- report


def pool_usage(app: RunningApp, timeout_s: float) -> dict[str, dict[str, int]]:
    """Each pool's blocks once all are free, or as they are when `timeout_s` runs out."""
    from app.config import load_config

    keys = sorted(load_config(app.args).resolve_admin_keys())
    headers = {"Authorization": f"Bearer {keys[0] if keys else 'none'}"}
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(f"{app.base_url}/v1/pdserve/stats", headers=headers, timeout=30)
        response.raise_for_status()
        pools = {
            name: {"num_blocks": p["num_blocks"], "num_free_blocks": p["num_free_blocks"]}
            for name, p in response.json()["pools"].items()
        }
        idle = all(p["num_blocks"] == p["num_free_blocks"] for p in pools.values())
        if idle or time.monotonic() > deadline:
            return pools
        time.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve bench chaos",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    add_app_arguments(parser, "cpu-disagg")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument(
        "--rate", type=float, default=None, help="fixed requests/s (Poisson): no capacity probe"
    )
    parser.add_argument(
        "--load", type=float, default=0.7, help="without --rate: this x the measured capacity"
    )
    parser.add_argument("--probe-s", type=float, default=5.0, help="seconds per capacity point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=90.0, help="past it: hung")
    parser.add_argument("--first-fault", type=float, default=10.0, help="s after the start")
    parser.add_argument("--fault-every", type=float, default=20.0, help="mean s between faults")
    parser.add_argument("--min-gap", type=float, default=3.0, help="s after a recovery")
    parser.add_argument("--quiet-tail", type=float, default=10.0, help="no fault this near end")
    parser.add_argument("--stop-s", type=float, default=5.0, help="SIGSTOP to SIGCONT")
    parser.add_argument("--recovery-timeout", type=float, default=120.0)
    parser.add_argument("--idle-timeout", type=float, default=60.0, help="for pools to go idle")
    parser.add_argument("--faults", default="kill,stop", help="comma list of kill, stop")
    parser.add_argument("--targets", default=None, help="pools to fault (default: all)")
    parser.add_argument("--num-short", type=int, default=24, help="distinct short prompts")
    parser.add_argument("--num-long", type=int, default=24, help="distinct long prompts")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", type=Path, required=True, help="write the result here")
    args = parser.parse_args(argv)
    args.faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if not args.faults or set(args.faults) - {"kill", "stop"}:
        parser.error("--faults: a comma list of kill, stop")

    from app.config import load_config

    config_args = app_args(args.config, args.model, args.dtype, free_port())
    config = load_config(config_args)
    pools = {pool.name: pool.role for pool in config.pools}
    args.targets = [t.strip() for t in (args.targets or ",".join(pools)).split(",") if t.strip()]
    if set(args.targets) - set(pools):
        parser.error(f"--targets: pools of this config are {', '.join(pools)}")
    decode_pools = {name for name, role in pools.items() if role == "decode"}

    print("computing the reference outputs (offline engine)", file=sys.stderr)
    shapes = with_references(request_pool(args.num_short, args.num_long, args.seed), config_args)
    with running_app(config_args, args.num_cpus) as app:
        capacity: dict[str, Any] = {"method": "not measured: a fixed rate (--rate)"}
        if args.rate is None:
            measured = asyncio.run(measure_capacity(app, shapes, args))
            args.rate = args.load * measured.requests_per_s
            capacity = {"method": CAPACITY_METHOD, **measured.to_dict()}
            print(
                f"capacity {measured.requests_per_s:.2f} req/s: rate {args.rate:.2f}",
                file=sys.stderr,
            )
            if args.rate <= 0:
                raise SystemExit(f"the capacity probe completed nothing: {capacity}")
        chaos = Chaos(app, config.app_name, shapes, args)
        asyncio.run(chaos.run())
        mark_decode_kills(chaos.records, chaos.faults, decode_pools)
        usage = pool_usage(app, args.idle_timeout)
    summary = {
        "config": args.config,
        "model": app.model_name,
        "seed": args.seed,
        "duration_s": args.duration,
        "rate": args.rate,
        "load": None if capacity.get("requests_per_s") is None else args.load,
        "capacity": capacity,
        **summarize(chaos.records, chaos.faults, chaos.probes, usage),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    summary["plot"] = plot(summary, chaos.records, args.json.with_suffix(".png"))
    document = {
        **summary,
        "prompts": [asdict(s) for s in shapes],
        "requests": [asdict(r) for r in chaos.records],
    }
    args.json.write_text(json.dumps(finite_or_none(document), indent=1) + "\n")
    print(human_summary(summary), file=sys.stderr)
    print(json.dumps(finite_or_none(summary)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
