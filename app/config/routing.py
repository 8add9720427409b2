"""The `adaptive_prefill` section: where a prompt is prefilled, and when a prefill pool
serves a whole request (`app/routing/`).
"""

from __future__ import annotations

from pydantic import Field

from app.config.base import _Strict


class AdaptivePrefillSettings(_Strict):
    """Adaptive disaggregation (`app/routing/adaptive.py`): a prompt the static rule sends
    to a prefill pool is prefilled on its decode replica instead while that is cheaper."""

    enabled: bool = Field(
        default=True,
        description="Compare the prefill pool's predicted wait with the cost of prefilling on "
        "the decode replica, per request at or above local_prefill_threshold; off = the "
        "static threshold alone decides.",
    )
    margin: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="Hysteresis: go local when the predicted remote wait exceeds the local "
        "cost x (1 + margin), back to remote once it is no longer than the local cost; in "
        "between a (prefill pool, decode pool) pair keeps its last choice.",
    )
    min_gain_s: float = Field(
        default=0.1,
        ge=0,
        allow_inf_nan=False,
        description="Go local only when that is predicted to save at least this many seconds "
        "of TTFT (no local prefill, which stalls decoding, for a saving within the noise).",
    )
    local_cost_factor: float = Field(
        default=1.0,
        ge=0,
        allow_inf_nan=False,
        description="A local prefill's compute time is charged this many times more when the "
        "decode replica has running sequences (they stall while the prompt is computed); "
        "0 = count only the new request's wait.",
    )
    max_local_prompt_tokens: int = Field(
        default=2048,
        ge=1,
        description="Longer prompts always go to their prefill pool (too long a stall for "
        "the decode replica's running sequences).",
    )
    max_age_s: float = Field(
        default=5.0,
        gt=0,
        allow_inf_nan=False,
        description="Pool load older than this counts as missing: the static rule decides.",
    )
    probe_interval_s: float = Field(
        default=10.0,
        ge=0,
        allow_inf_nan=False,
        description="While prompts go local although a prefill replica is idle, send one "
        "prompt per this many seconds to the prefill pool anyway, so that its prefill rate is "
        "measured again (a rate measured on a stalled or cold replica would otherwise keep "
        "every prompt local for good); 0 = never probe.",
    )
    borrow_prefill_rate: bool = Field(
        default=False,
        description="Until a decode replica has measured its own prefill rate (from prompts "
        "it prefilled itself), assume the prefill pool's measured rate (both run the same "
        "model); off = the static rule decides until it has.",
    )
    decode_overflow_gap: float = Field(
        default=2,
        ge=0,
        allow_inf_nan=False,
        description="Prefill pools with `serves_decode` take a whole request (its prompt "
        "prefilled and decoded there, no KV transfer) while the decode pool's least loaded "
        "replica's decode load, (sequences + 1) / (1 - prompt_busy), is above theirs by at "
        "least this much (`app/routing/overflow.py`). 0 joins the shorter queue, ties "
        "staying on decode (CPU replicas, where a decode step's cost grows with its batch and "
        "two replicas serve best evenly loaded); a larger gap keeps prompts isolated until "
        "decode is that far ahead (GPUs, where a bigger batch costs little until memory or "
        "the batch limit binds).",
    )
    decode_overflow_max_prompt_busy: float = Field(
        default=0.5,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="A prefill replica takes whole requests only while it spent at most this "
        "share of the last 30 s computing prompts (`prompt_busy`): a stream there stalls "
        "while each prompt is computed (over half the time: its TPOT more than doubles), so "
        "a pool busy with prompts (the prefill-bound case, where disaggregation pays) keeps "
        "to them.",
    )
    serve_whole_max_output_tokens: int = Field(
        default=0,
        ge=0,
        description="A request asking for at most this many new tokens (max_tokens) is "
        "placed as two colocated replicas would place it: whole, no KV hand-off, on the "
        "decode pool (prefilled there) or on a prefill pool with `serves_decode`, whichever "
        "has fewer prompt tokens to compute, then fewer requests in flight, per replica "
        "(ties take turns). For a few tokens "
        "the hand-off buys nothing, and the decode replica would otherwise decode every "
        "such request while the prefill replica only computes prompts "
        "(`app/routing/overflow.py`). 0 = off.",
    )
    decode_overflow_max_prompt_tokens: int = Field(
        default=256,
        ge=0,
        description="A prefill replica takes no whole request while more than this many "
        "prompt tokens compute there (sent by this ingress and not yet answered, or reported "
        "queued): the new stream would wait for them and then stall at each of their chunks. "
        "The default lets a few chat turns share the replica and keeps whole requests off it "
        "while a long document is prefilled (`app/routing/overflow.py`).",
    )
    decode_overflow_max_prompt_ms: float = Field(
        default=0.0,
        ge=0.0,
        description="The same gate in time, where a replica has measured its prefill rate: "
        "no whole request while the prompt tokens computing there would take longer than "
        "this at that rate (what a new stream would wait, and stall once). 0 = off (the "
        "token limit above). A time holds across models and machines where a token count "
        "cannot: on the CPU the built-in `tiny` prefills ~20k tokens/s, `small` ~1k "
        "(`app/routing/overflow.py`).",
    )
