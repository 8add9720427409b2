"""Request deadlines: how long a request may take, from the moment the ingress has it.

A request names its timeout in seconds in the header `x-pdserve-timeout` or the body
extension `timeout` (the header wins when both are given); otherwise its SLO class's
default (`overload.class_timeouts_s`) or `overload.default_timeout_s` applies. A timeout
must be positive, finite and at most `overload.max_timeout_s` (else 400).

When the deadline passes, the ingress cancels the request's decode calls (which aborts it on
the decode replica and its prefill transfer on both pools, blocks freed) and answers 504
`deadline_exceeded`, or, once a stream has started, sends that error as an SSE event. The
decode replica gets the time left (`GenerationSpec.timeout_s`) and bounds its remote-prefill
attempts by it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from app.config import OverloadSettings
from app.errors import BadRequestError, DeadlineExceededError

TIMEOUT_HEADER = "x-pdserve-timeout"


@dataclass(frozen=True, slots=True)
class Deadline:
    """A request's deadline on the monotonic clock."""

    timeout_s: float
    expires_at: float
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def start(cls, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> Deadline:
        """A deadline `timeout_s` from now."""
        return cls(timeout_s, clock() + timeout_s, clock)

    def remaining_s(self) -> float:
        """Seconds left (0 when passed)."""
        return max(self.expires_at - self.clock(), 0.0)

    def error(self) -> DeadlineExceededError:
        """The error a request whose deadline passed gets."""
        return DeadlineExceededError(
            f"the request did not complete within its timeout of {self.timeout_s:g} s"
        )


def header_timeout(value: str | None) -> float | None:
    """`x-pdserve-timeout`'s seconds (None when absent); 400 when it is not a number."""
    if value is None:
        return None
    try:
        return float(value.strip())
    except ValueError:
        raise BadRequestError(
            f"{TIMEOUT_HEADER} must be a number of seconds, got {value!r}", param=TIMEOUT_HEADER
        ) from None


def resolve_timeout_s(
    settings: OverloadSettings,
    requested_s: float | None,
    slo_class: str | None = None,
    param: str = "timeout",
) -> float:
    """The request's timeout: the one it asked for (checked), else its class's default,
    else the global default."""
    if requested_s is None:
        if slo_class is not None and slo_class in settings.class_timeouts_s:
            return settings.class_timeouts_s[slo_class]
        return settings.default_timeout_s
    if not (math.isfinite(requested_s) and requested_s > 0):
        raise BadRequestError(
            f"timeout must be a positive number of seconds, got {requested_s}", param=param
        )
    if requested_s > settings.max_timeout_s:
        raise BadRequestError(
            f"timeout ({requested_s:g} s) exceeds this service's limit of "
            f"{settings.max_timeout_s:g} s",
            param=param,
        )
    return requested_s


def requested_timeout(
    headers: Mapping[str, str], body_timeout: float | None
) -> tuple[float | None, str]:
    """(the timeout a request asked for, where: the header or the body's `timeout`)."""
    from_header = header_timeout(headers.get(TIMEOUT_HEADER))
    if from_header is not None:
        return from_header, TIMEOUT_HEADER
    return body_timeout, "timeout"
