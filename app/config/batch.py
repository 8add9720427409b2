"""The `batch` section: offline batch jobs (the OpenAI Files and Batch API, `app/batch/`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from app.config.base import NAME_PATTERN, _Strict


class BatchSettings(_Strict):
    """Where batch files and jobs are kept, how big they may be, and how a job paces itself
    against interactive traffic."""

    enabled: bool = Field(
        default=True, description="Serve /v1/files and /v1/batches and run batch jobs."
    )
    store_dir: str = Field(
        default="~/.pdserve/batch",
        min_length=1,
        description="Directory of the durable store (files, job state, results); every "
        "ingress replica must see the same directory (one host, or a shared filesystem "
        "with working flock). Jobs resume from it after a restart.",
    )
    max_file_bytes: int = Field(
        default=64 * 1024**2, ge=1, description="Largest uploaded file, bytes (413 past it)."
    )
    max_lines: int = Field(
        default=50_000, ge=1, description="Most requests in one batch input file (400 past it)."
    )
    slo_class: str | None = Field(
        default="batch",
        pattern=NAME_PATTERN,
        description="SLO class of every job's lines, when admission.classes has it (else "
        "the tenant's default class). Interactive requests count as those of a more "
        "important class.",
    )
    min_concurrency: int = Field(
        default=1, ge=1, description="Lines of one ingress replica's jobs in flight, at least."
    )
    max_concurrency: int = Field(
        default=64,
        ge=1,
        description="Lines in flight at most (an idle service: about the decode pools' "
        "max_num_seqs, so the engine runs large batches).",
    )
    busy_concurrency: int = Field(
        default=2,
        ge=1,
        description="Lines in flight at most while more important requests run through "
        "this ingress replica; halved (down to min_concurrency) while they queue at a pool.",
    )
    quiet_s: float = Field(
        default=3.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds without more important requests before lines in flight may "
        "grow past busy_concurrency again (so a gap between interactive requests does not "
        "fill the decode slots they are about to need); longer while those requests arrive "
        "often: 5 recent inter-arrival gaps when that is more, at most 10 x quiet_s.",
    )
    delta_interval_s: float = Field(
        default=2.0,
        ge=0,
        allow_inf_nan=False,
        description="A line's tokens come back from the decode pool merged, at most one "
        "message per this many seconds after its first token (a line needs only the whole "
        "answer; a message and a tokenizer call per token cost every process on the way: at "
        "2 s most lines send two); 0: one per engine step, as online.",
    )
    local_prefill_max_tokens: int = Field(
        default=1024,
        ge=0,
        description="While the service is idle (as pacing sees it: the window at "
        "max_concurrency), a line whose prompt has at most this many tokens is prefilled on "
        "its decode replica instead of being handed off: no prefill call and no KV transfer "
        "per line. Under more important load busy_local_prefill_max_tokens applies instead. "
        "0: never.",
    )
    busy_local_prefill_max_tokens: int = Field(
        default=64,
        ge=0,
        description="Under more important load, a line whose prompt has at most this many "
        "tokens is still prefilled on its decode replica: it lengthens that replica's next "
        "step by its prefill (the interactive requests there lose a little TPOT) instead of "
        "queueing at a prefill pool in front of interactive prompts (their TTFT). Longer "
        "prompts keep their placed route. Never above local_prefill_max_tokens (0 there "
        "turns both off). 0: never under load.",
    )
    pace_period_s: float = Field(
        default=0.25, gt=0, allow_inf_nan=False, description="How often the pace is adjusted."
    )
    lease_ttl_s: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="A running job's lease: another ingress replica takes the job over when "
        "its runner has not renewed the lease for this long (renewed every third of it).",
    )
    poll_s: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="How often an ingress replica looks for jobs to start or take over.",
    )
    retry_backoff_s: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="First wait before retrying a line refused for load (429/503/504); it "
        "doubles per attempt, up to 30 s. Such lines are retried until the job expires.",
    )

    @model_validator(mode="after")
    def _check(self) -> BatchSettings:
        if not self.min_concurrency <= self.busy_concurrency <= self.max_concurrency:
            raise ValueError(
                "batch: need min_concurrency <= busy_concurrency <= max_concurrency (got "
                f"{self.min_concurrency}, {self.busy_concurrency}, {self.max_concurrency})"
            )
        return self
