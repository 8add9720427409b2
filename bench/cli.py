"""`pdserve bench <name> [args]` and `python -m bench <name> [args]`: the benchmarks by name.

`BENCHES` holds one line per benchmark: its name, the module whose `main(argv)` runs it, and
the summary `--help` lists. The module is imported only when its benchmark runs, so listing
them loads neither torch nor Ray. Everything after the name is the benchmark's own
arguments (`pdserve bench compare --help` shows them).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple


class Bench(NamedTuple):
    module: str  # has `main(argv: Sequence[str] | None) -> int`
    summary: str


BENCHES: dict[str, Bench] = {
    "accuracy": Bench("bench.offline.accuracy", "FP8 weights and KV cache vs full precision"),
    "autoscale": Bench("bench.autoscale.main", "a ramp that stresses each pool's own signal"),
    "batch": Bench("bench.batch.main", "a batch job vs the engine offline, and beside interactive"),
    "chaos": Bench("bench.chaos.main", "mixed load while replicas are killed and frozen"),
    "compare": Bench("bench.compare.main", "goodput of several configs, with intervals"),
    "engine": Bench("bench.offline.throughput", "the engine vs transformers and the roofline"),
    "goodput": Bench("bench.goodput.sweep", "the highest rate a server sustains within SLOs"),
    "idle-cost": Bench("bench.batch.idle_cost", "what an idle app costs the engine beside it"),
    "itl": Bench("bench.serve.itl", "batch-1 inter-token latency: HTTP vs the bare engine"),
    "multiturn": Bench("bench.multiturn.main", "conversations resending their history, per config"),
    "overload": Bench("bench.overload.main", "classes at 3x the goodput, admission on vs off"),
    "serve": Bench("bench.serve.loadgen", "one run at one rate against an OpenAI endpoint"),
    "summary": Bench("bench.compare.summary", "the config x workload table of compare files"),
    "tp-handoff": Bench(
        "bench.offline.tp_handoff", "first token through TP replicas, per way KV moves"
    ),
    "tpot": Bench("bench.offline.tpot", "decode time per token, CUDA graphs on and off"),
    "transfer": Bench("bench.offline.transfer", "KV transfer between two processes"),
}


def build_parser(prog: str = "pdserve bench") -> argparse.ArgumentParser:
    """The parser of the benchmark's name; `--help` lists every benchmark."""
    width = max(map(len, BENCHES))
    listing = "\n".join(f"  {name:<{width}}  {b.summary}" for name, b in sorted(BENCHES.items()))
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [-h] <bench> [args ...]",
        description="Run one benchmark (BENCHMARKS.md has the figures and how they were made).",
        epilog=f"benchmarks:\n{listing}\n\n`{prog} <bench> --help` shows a benchmark's arguments.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("bench", choices=sorted(BENCHES), metavar="<bench>", help="listed below")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "pdserve bench") -> int:
    """Run the benchmark `argv[0]` names with the rest of `argv`; its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    parser.parse_args(args[:1])  # the name, or --help; exits with a usage message otherwise
    module = importlib.import_module(BENCHES[args[0]].module)
    return int(module.main(args[1:]) or 0)
