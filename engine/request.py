"""A request's description and the engine's request type shared by both pools.

`RequestSpec` is what every stage is told of a request (each stage extends it), with its
`SamplingParams` and the one prompt check (`check_prompt`); `Request` is the engine's,
with its state.

A request's lifecycle, as queues in the scheduler:

    WAITING ──admit──▶ RUNNING ──stop/length──▶ FINISHED_STOPPED / FINISHED_LENGTH
       ▲                  │
       └──── preempt ─────┘   (blocks freed, recomputed from scratch later)

    WAITING_FOR_KV ──KV received──▶ RUNNING          (decode pool: prefill ran elsewhere)
    RUNNING ──prompt computed, prefill_only──▶ FINISHED_PREFILLED  (prefill pool: hand off)

Any state ──abort──▶ FINISHED_ABORTED.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Self, TypeGuard


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_PREFILLED = "finished_prefilled"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason, or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_PREFILLED,
    }
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_PREFILLED: "prefilled",
}


class InvalidRequestError(ValueError):
    """Bad user input (becomes a 4xx response at the API edge)."""


class ContextOverflowError(InvalidRequestError):
    """Prompt + max_tokens exceed the model's context length (the API's 400
    `context_length_exceeded`)."""


# Limits on what one request may ask for, checked wherever SamplingParams are built (the HTTP
# edge, the handle API, direct engine callers). Stop strings are searched in the output on
# every step, so their number and length bound per-token work.
MAX_NUM_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_STRING_CHARS = 256
MAX_NUM_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit integer, as OpenAI's `seed`


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token, and when to stop. Validated on construction.

    Every check that needs no engine is here (types, finiteness, ranges, counts and lengths);
    that stop token ids are below the vocabulary size is checked where it is known (the
    frontend and the engine). Raises `InvalidRequestError` whose message starts with the
    offending field's name.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None = no logprobs; N = sampled token plus top-N alternatives
    min_tokens: int = 0

    def __post_init__(self) -> None:
        self._check_types()
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequestError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequestError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
            )
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidRequestError("seed must be a signed 64-bit integer")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"
            )
        self._check_stops()

    def _check_types(self) -> None:
        for name in ("max_tokens", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be an integer")
        for name in ("seed", "logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise InvalidRequestError(f"{name} must be an integer or null")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            # NaN passes every range check (all comparisons are false), inf some of them.
            if not _is_number(value) or not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")

    def _check_stops(self) -> None:
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop must be a tuple of strings")
        if len(self.stop) > MAX_NUM_STOP_STRINGS:
            raise InvalidRequestError(
                f"stop has {len(self.stop)} strings; at most {MAX_NUM_STOP_STRINGS} are allowed"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequestError(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long"
            )
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or not all(_is_int(t) for t in ids):
            raise InvalidRequestError("stop_token_ids must be a tuple of integers")
        if len(ids) > MAX_NUM_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids has {len(ids)} ids; at most {MAX_NUM_STOP_TOKEN_IDS} are allowed"
            )
        if any(t < 0 for t in ids):
            raise InvalidRequestError("stop_token_ids must be >= 0")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise `InvalidRequestError` unless every stop token id is below `vocab_size`."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids must be < the vocabulary size {vocab_size}, got {bad[0]}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def check_prompt(
    token_ids: Sequence[object], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """The one check of a tokenized prompt with its params against a model, made by every
    entry point: the ingress (`Frontend.prepare`, for the HTTP routes and the handle API, to
    answer early) and the engine (`Engine.make_request`, for every caller).

    Raises `InvalidRequestError` unless the prompt is non-empty, each id is an integer in
    `[0, vocab_size)` and so is each stop token id; `ContextOverflowError` when prompt +
    max_tokens exceed `max_model_len`.
    """
    if not token_ids:
        raise InvalidRequestError("prompt is empty")
    if not all(_is_int(t) and 0 <= t < vocab_size for t in token_ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})")
    params.check_vocab(vocab_size)
    total = len(token_ids) + params.max_tokens
    if total > max_model_len:
        raise ContextOverflowError(
            f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the model's context length of {max_model_len}"
        )


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request as every stage describes it: validated, tokenized, with its params.

    Each stage extends it with only what it adds: the ingress (`app.prepared.PreparedRequest`:
    route, service class, deadline, choices), the decode call (`replica.protocol.GenerationSpec`:
    prefill pool, time left) and the prefill call (`replica.protocol.PrefillRequest`: replica
    hints). `derive` builds the next stage's description from the previous one.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    tenant: str = ""
    priority: int = 0  # lower is more important
    # W3C trace context (traceparent, tracestate) of the span that sent this stage's call.
    trace_context: dict[str, str] = field(default_factory=dict)

    @classmethod
    def derive(cls, spec: RequestSpec, **changes: Any) -> Self:
        """A `cls` carrying `spec`'s shared fields, with `changes` (shared fields to
        override, and the fields `cls` adds)."""
        shared = {name: getattr(spec, name) for name in _SHARED_FIELDS}
        return cls(**(shared | changes))


_SHARED_FIELDS = tuple(f.name for f in fields(RequestSpec))


@dataclass(slots=True)
class Request:
    """One generation request, as both pools see it.

    `all_token_ids` is prompt + output; `num_computed_tokens` counts the tokens whose K/V
    are in the cache. The block table lives in the KV cache manager, keyed by request id.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    tenant: str = ""
    priority: int = 0  # lower is more important
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # time.monotonic() when first scheduled
    prefill_only: bool = False  # prefill pool: finish as FINISHED_PREFILLED after the prompt
    # Above 0: the caller reads only the whole answer; after the first token, the engine
    # hands over this request's news merged, at most once per this many seconds
    # (`Engine._emit`).
    output_interval_s: float = 0.0
    # Sent with nothing more important running: while every request the engine holds is
    # spare, its steps may use `EngineConfig.spare_num_threads`.
    spare: bool = False
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_transferred_tokens: int = 0  # prompt tokens whose KV arrived from a prefill replica
    num_preemptions: int = 0
    stop_reason: int | str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int, logprobs: dict[int, float] | None) -> None:
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
