"""What a serving benchmark sends, and when: workloads and arrival processes.

A workload turns a seeded RNG into `RequestSpec`s (prompt text, max_tokens, a class label);
an arrival process turns a rate into send offsets. `schedule(...)` zips the two into the
`ScheduledRequest` list the load generator replays. Everything is deterministic given the
seed, and free of I/O except `read_trace`, which reads its JSONL file once.

On the command line (`--workload`): `fixed`, `trace`, the two-class presets of
`WORKLOAD_PRESETS` over `MixedWorkload`: `mixed`, `chat`, `long-context`, `multi-tenant`, and
`multiturn`: conversations whose turns resend their history (`bench/serve/conversations.py`).

Prompt lengths are in tokens of our byte-level built-in models: one ASCII character is one
token, and the server adds one BOS token (`special_tokens=1`). Against another server with a
subword tokenizer the lengths are only approximate; its reported `prompt_tokens` are recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

ArrivalProcess = Literal["constant", "poisson", "gamma"]
ARRIVAL_PROCESSES: tuple[ArrivalProcess, ...] = ("constant", "poisson", "gamma")
# Lowercase letters and spaces: one byte (one token) each, and no accidental shared prefixes.
_ALPHABET = np.frombuffer((string.ascii_lowercase + " ").encode(), dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request's content: what to send, not when."""

    prompt: str
    max_tokens: int
    input_len: int  # requested prompt length in tokens (special tokens included)
    label: str  # workload class: "fixed", "short", "long", "chat", "interactive", ...


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """A request and its send offset in seconds from the start of the run."""

    index: int
    arrival_s: float
    spec: RequestSpec


def make_prompt(num_tokens: int, rng: np.random.Generator, special_tokens: int = 1) -> str:
    """Random lowercase text that tokenizes to `num_tokens` with our byte-level tokenizer.

    `special_tokens` is what the server adds (our built-in models add one BOS token).
    """
    num_chars = max(1, num_tokens - special_tokens)
    return _ALPHABET[rng.integers(0, len(_ALPHABET), size=num_chars)].tobytes().decode()


class Workload(Protocol):
    """A source of request contents."""

    def sample(self, rng: np.random.Generator) -> RequestSpec:
        """The next request's content."""
        ...


@dataclass(frozen=True, slots=True)
class FixedWorkload:
    """Every request has the same prompt and output length."""

    input_len: int = 256
    output_len: int = 128
    special_tokens: int = 1

    def sample(self, rng: np.random.Generator) -> RequestSpec:
        prompt = make_prompt(self.input_len, rng, self.special_tokens)
        return RequestSpec(prompt, self.output_len, self.input_len, "fixed")


@dataclass(frozen=True, slots=True)
class MixedWorkload:
    """Mostly short chat turns with a share of long prompts (the disaggregation case).

    Short prompts are `short_input_len` ± `short_input_spread` (relative, uniform) with
    `short_output_len` new tokens; long ones (a `long_share` of requests) are uniform in
    `[long_input_min, long_input_max]` with `long_output_len` new tokens. `labels` name the
    two classes in the records (the presets of `WORKLOAD_PRESETS` rename them).
    """

    short_input_len: int = 256
    short_output_len: int = 128
    short_input_spread: float = 0.25
    long_input_min: int = 2048
    long_input_max: int = 4096
    long_output_len: int = 64
    long_share: float = 0.15
    special_tokens: int = 1
    labels: tuple[str, str] = ("short", "long")

    def __post_init__(self) -> None:
        if not 0.0 <= self.long_share <= 1.0:
            raise ValueError(f"long_share must be in [0, 1], got {self.long_share}")
        if not 0.0 <= self.short_input_spread < 1.0:
            raise ValueError(f"short_input_spread must be in [0, 1), got {self.short_input_spread}")
        if self.long_input_min > self.long_input_max:
            raise ValueError(f"long_input_min {self.long_input_min} > max {self.long_input_max}")

    def sample(self, rng: np.random.Generator) -> RequestSpec:
        if rng.random() < self.long_share:
            input_len = int(rng.integers(self.long_input_min, self.long_input_max + 1))
            output_len, label = self.long_output_len, self.labels[1]
        else:
            spread = self.short_input_len * self.short_input_spread
            input_len = max(2, round(self.short_input_len + rng.uniform(-spread, spread)))
            output_len, label = self.short_output_len, self.labels[0]
        prompt = make_prompt(input_len, rng, self.special_tokens)
        return RequestSpec(prompt, output_len, input_len, label)


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One line of a JSONL trace."""

    arrival_s: float
    spec: RequestSpec


def read_trace(path: str | Path, seed: int = 0, special_tokens: int = 1) -> list[TraceEntry]:
    """Parse a JSONL trace: one object per line with `max_tokens`, `arrival_s` (offset in
    seconds from the start) and either `prompt` (text) or `input_len` (tokens; a random
    prompt of that length is generated with `seed`). Sorted by arrival."""
    rng = np.random.default_rng(seed)
    entries: list[TraceEntry] = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            max_tokens, arrival_s = int(row["max_tokens"]), float(row["arrival_s"])
            if "prompt" in row:
                prompt = str(row["prompt"])
                input_len = int(row.get("input_len", len(prompt) + special_tokens))
            else:
                input_len = int(row["input_len"])
                prompt = make_prompt(input_len, rng, special_tokens)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{number}: bad trace line ({e!r}): {line[:80]}") from e
        if max_tokens < 1 or arrival_s < 0:
            raise ValueError(f"{path}:{number}: need max_tokens >= 1 and arrival_s >= 0")
        entries.append(TraceEntry(arrival_s, RequestSpec(prompt, max_tokens, input_len, "trace")))
    return sorted(entries, key=lambda entry: entry.arrival_s)


def interarrival_times(
    n: int,
    rate: float,
    process: ArrivalProcess,
    rng: np.random.Generator,
    burstiness: float = 1.0,
) -> np.ndarray:
    """`n` gaps (seconds) between arrivals at a mean of `rate` requests/s.

    `gamma` uses vLLM's convention: shape `burstiness`, scale `1 / (rate * burstiness)`, so
    the mean gap is `1 / rate` and its coefficient of variation `1 / sqrt(burstiness)`;
    burstiness 1 is Poisson, below 1 burstier, above 1 smoother.
    """
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive finite number, got {rate}")
    if process == "constant":
        return np.full(n, 1.0 / rate)
    if process == "poisson":
        return rng.exponential(1.0 / rate, size=n)
    if process == "gamma":
        if burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness}")
        return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    raise ValueError(f"unknown arrival process {process!r}; choose from {ARRIVAL_PROCESSES}")


def arrival_offsets(
    rate: float,
    duration_s: float,
    process: ArrivalProcess,
    rng: np.random.Generator,
    burstiness: float = 1.0,
) -> list[float]:
    """Send offsets in `[0, duration_s)`; the first request is sent at 0."""
    if process == "constant":  # i / rate, not a running sum: no float drift at the end
        interarrival_times(0, rate, process, rng)  # validates the rate
        return [i / rate for i in range(math.ceil(rate * duration_s)) if i / rate < duration_s]
    expected = max(1, math.ceil(rate * duration_s))
    offsets: list[float] = [0.0]
    while True:
        # Draw in batches (a few extra) until the window is covered.
        gaps = interarrival_times(expected + 16, rate, process, rng, burstiness)
        for gap in gaps:
            nxt = offsets[-1] + float(gap)
            if nxt >= duration_s:
                return offsets
            offsets.append(nxt)


def schedule(
    workload: Workload,
    rate: float,
    duration_s: float,
    process: ArrivalProcess = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
    num_requests: int | None = None,
) -> list[ScheduledRequest]:
    """The requests of one run: arrivals over `duration_s` at `rate`, contents from `workload`;
    with `num_requests`, exactly that many arrivals instead (as long as they take).

    Arrivals and contents use independent streams of `seed`, so two workloads at one seed
    share their arrival times.
    """
    arrival_rng, content_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2)
    )
    if num_requests is None:
        offsets = arrival_offsets(rate, duration_s, process, arrival_rng, burstiness)
    else:
        if num_requests < 1:
            raise ValueError(f"num_requests must be at least 1, got {num_requests}")
        gaps = interarrival_times(num_requests - 1, rate, process, arrival_rng, burstiness)
        offsets = [0.0, *np.cumsum(gaps).tolist()]
    return [ScheduledRequest(i, t, workload.sample(content_rng)) for i, t in enumerate(offsets)]


def schedule_trace(entries: list[TraceEntry], time_scale: float = 1.0) -> list[ScheduledRequest]:
    """A trace's requests, with arrival offsets multiplied by `time_scale`."""
    return [ScheduledRequest(i, e.arrival_s * time_scale, e.spec) for i, e in enumerate(entries)]


# ------------------------------------------------------------------------------ command line

_SHAPE_KEYS = (
    "short_input_len",
    "short_output_len",
    "short_input_spread",
    "long_input_min",
    "long_input_max",
    "long_output_len",
    "long_share",
)
# The two-class workloads: (short class, long class) labels and the shape defaults, which
# the --short-*/--long-* options override. Sizes are the full-size target mix; benchmarks on
# 2 CPU cores scale them down (BENCHMARKS.md gives the commands).
WORKLOAD_PRESETS: dict[str, tuple[tuple[str, str], dict[str, float]]] = {
    # mostly chat turns, a share of long prompts: where prefill interferes with decode
    "mixed": (("short", "long"), {"long_share": 0.15}),
    # short prompts only, judged by a tight TPOT
    "chat": (("chat", "long"), {"long_share": 0.0}),
    # RAG-like: long prompts, short answers; TTFT-bound. Prompt + answer fit a 4096-token
    # context (the built-in models'), so the longest prompt is 4080.
    "long-context": (
        ("short", "long"),
        {"long_share": 1.0, "long_output_len": 16, "long_input_max": 4080},
    ),
    # an interactive tenant (chat turns) and a batch tenant (long documents), each judged by
    # its own class's SLOs (`PER_CLASS_SLO`)
    "multi-tenant": (("interactive", "batch"), {"long_share": 0.25}),
}
_SHAPE_DEFAULTS: dict[str, float] = {
    "short_input_len": 256,
    "short_output_len": 128,
    "short_input_spread": 0.25,
    "long_input_min": 2048,
    "long_input_max": 4096,
    "long_output_len": 64,
    "long_share": 0.15,
}
# Workloads whose classes each have their own SLOs (a point's attainment is the lowest
# class's); the others judge every request by one shared SLO.
PER_CLASS_SLO = frozenset({"multi-tenant"})


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload and arrival options shared by `bench serve`, `goodput` and `compare`."""
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--workload", choices=["fixed", *WORKLOAD_PRESETS, "multiturn", "trace"], default="mixed"
    )
    g.add_argument("--input-len", type=int, default=256, help="fixed: prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="fixed: new tokens")
    short, long = "short/chat/interactive", "long/batch"
    g.add_argument("--short-input-len", type=int, default=None, help=f"{short}: prompt tokens")
    g.add_argument("--short-output-len", type=int, default=None, help=f"{short}: new tokens")
    g.add_argument("--short-input-spread", type=float, default=None, help=f"{short}: ± relative")
    g.add_argument("--long-input-min", type=int, default=None, help=f"{long}: prompt min")
    g.add_argument("--long-input-max", type=int, default=None, help=f"{long}: prompt max")
    g.add_argument("--long-output-len", type=int, default=None, help=f"{long}: new tokens")
    g.add_argument("--long-share", type=float, default=None, help=f"share of {long} requests")
    g.add_argument("--trace", type=Path, default=None, help="trace: JSONL file")
    g.add_argument("--trace-time-scale", type=float, default=1.0, help="trace: offset factor")
    g.add_argument("--special-tokens", type=int, default=1, help="tokens the server adds (BOS)")
    from bench.serve.conversations import add_conversation_args  # it imports this module

    add_conversation_args(parser, think_s=None)  # open loop: the rate sets the pace
    a = parser.add_argument_group("arrivals")
    a.add_argument("--arrival", choices=ARRIVAL_PROCESSES, default="poisson")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    a.add_argument("--seed", type=int, default=0)


def workload_shape(args: argparse.Namespace) -> dict[str, float]:
    """A two-class workload's sizes: each option given, else the preset's, else the default."""
    _, preset = WORKLOAD_PRESETS[args.workload]
    shape = {**_SHAPE_DEFAULTS, **preset}
    given = {k: v for k in _SHAPE_KEYS if (v := getattr(args, k, None)) is not None}
    return {**shape, **given}


def workload_from_args(args: argparse.Namespace) -> FixedWorkload | MixedWorkload:
    """The workload the options describe (not for `--workload trace`)."""
    if args.workload == "fixed":
        return FixedWorkload(args.input_len, args.output_len, args.special_tokens)
    if args.workload in WORKLOAD_PRESETS:
        shape = workload_shape(args)
        return MixedWorkload(
            short_input_len=int(shape["short_input_len"]),
            short_output_len=int(shape["short_output_len"]),
            short_input_spread=float(shape["short_input_spread"]),
            long_input_min=int(shape["long_input_min"]),
            long_input_max=int(shape["long_input_max"]),
            long_output_len=int(shape["long_output_len"]),
            long_share=float(shape["long_share"]),
            special_tokens=args.special_tokens,
            labels=WORKLOAD_PRESETS[args.workload][0],
        )
    raise ValueError(f"workload {args.workload!r} is not sampled; read it with read_trace")


def class_shapes(args: argparse.Namespace) -> dict[str, FixedWorkload]:
    """One fixed shape per class the workload sends, by label: the nominal short request
    and the longest long prompt (what isolated-request measurements time)."""
    if args.workload == "multiturn":  # a fresh first turn, and a fresh prompt as long as the last
        from bench.serve.conversations import FIRST, LATER, conversation_shape

        c = conversation_shape(args)
        last_len = c.prompt_len(c.num_turns - 1) + args.special_tokens
        return {
            FIRST: FixedWorkload(c.first_len + args.special_tokens, c.output_len),
            LATER: FixedWorkload(last_len, c.output_len),
        }
    workload = workload_from_args(args)
    if isinstance(workload, FixedWorkload):
        return {"fixed": workload}
    w, shapes = workload, {}
    if w.long_share < 1:
        shapes[w.labels[0]] = FixedWorkload(w.short_input_len, w.short_output_len, w.special_tokens)
    if w.long_share > 0:
        shapes[w.labels[1]] = FixedWorkload(w.long_input_max, w.long_output_len, w.special_tokens)
    return shapes


def requests_from_args(
    args: argparse.Namespace,
    rate: float | None,
    duration_s: float,
    num_requests: int | None = None,
) -> list[ScheduledRequest]:
    """The requests of one run as the options say: over `duration_s`, or exactly
    `num_requests` if given (a trace ignores `rate`, the duration and the count)."""
    if args.workload == "trace":
        if args.trace is None:
            raise SystemExit("--workload trace needs --trace FILE")
        entries = read_trace(args.trace, args.seed, args.special_tokens)
        return schedule_trace(entries, args.trace_time_scale)
    if rate is None:
        raise SystemExit(f"--workload {args.workload} needs --rate")
    if args.workload == "multiturn":
        from bench.serve.conversations import conversation_shape, schedule_conversations

        count = num_requests if num_requests is not None else max(1, math.ceil(rate * duration_s))
        shape = conversation_shape(args)
        return schedule_conversations(shape, rate, count, args.seed, args.special_tokens)
    workload = workload_from_args(args)
    return schedule(
        workload, rate, duration_s, args.arrival, args.burstiness, args.seed, num_requests
    )


def describe_workload(args: argparse.Namespace) -> dict[str, object]:
    """The workload options as a JSON-ready dict (recorded in every result file)."""
    keys = ["workload", "arrival", "burstiness", "seed", "special_tokens"]
    out: dict[str, object] = {key: getattr(args, key) for key in keys}
    if args.workload == "fixed":
        out.update(input_len=args.input_len, output_len=args.output_len)
    elif args.workload in WORKLOAD_PRESETS:
        out.update(workload_shape(args), labels=list(WORKLOAD_PRESETS[args.workload][0]))
    elif args.workload == "multiturn":
        from bench.serve.conversations import conversation_shape, describe_shape

        out.update(describe_shape(conversation_shape(args)))
    else:
        out.update(trace=str(args.trace), trace_time_scale=args.trace_time_scale)
    return out
