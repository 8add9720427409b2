"""Tenant quotas and SLO classes end to end, with 2 ingress replicas sharing the quotas.

One app: prompts under 16 tokens are prefilled on the decode replica, longer ones on the
prefill pool. Tenants: acme (interactive, no quota), globex (batch, 16 sequences), rated
(6 requests, refilling at 0.001/s), wordy (600 prompt tokens/min), chatty (60 output
tokens/min), queued (2 sequences, 1 queued request) and roomy (1% of the decode pool's 4096
KV blocks: 40 blocks, 640 tokens). Leases are half a bucket, so the
two ingress replicas split each bucket between them: only a global count admits exactly
the quota.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:  # conftest is pytest's to import; its types are only needed for hints
    from tests.app.conftest import Server

pytestmark = pytest.mark.slow

SERVED_MODEL = "pdserve-tiny"
ADMIN = "sk-admin-quotas"
ACME, GLOBEX, RATED, WORDY, CHATTY, QUEUED, ROOMY = (
    f"sk-{name}-quotas"
    for name in ("acme", "globex", "rated", "wordy", "chatty", "queued", "roomy")
)
INTERACTIVE_TTFT_S = 10.0  # generous for the tiny model: the test is about starvation
RATED_BURST = 6
PROMPT_TOKENS_PER_MINUTE = 600
OUTPUT_TOKENS_PER_MINUTE = 60
_TEXT = "".join(chr(32 + (i * 7) % 95) for i in range(600))


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    def tenant(name: str, key: str, **fields: Any) -> dict[str, Any]:
        return {"name": name, "api_keys": [key], **fields}

    return {
        "model": {"model": str(model_dir), "num_threads": 1, "kv_cache_bytes": 32 * 1024**2},
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.25},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm"},
        "local_prefill_threshold": 16,
        "ingress": {"num_replicas": 2, "num_cpus": 0.1},
        "admission": {
            "classes": [
                {"name": "interactive", "ttft_s": INTERACTIVE_TTFT_S, "tpot_s": 1.0, "priority": 0},
                {"name": "batch", "ttft_s": 120.0, "tpot_s": 10.0, "priority": 10},
            ],
            "lease_fraction": 0.5,
            "queue_timeout_s": 60.0,
        },
        "tenants": [
            tenant("acme", ACME, default_class="interactive"),
            tenant("globex", GLOBEX, default_class="batch", quota={"max_concurrent_sequences": 16}),
            tenant(
                "rated",
                RATED,
                quota={"requests_per_second": 0.001, "request_burst": RATED_BURST},
            ),
            tenant("wordy", WORDY, quota={"prompt_tokens_per_minute": PROMPT_TOKENS_PER_MINUTE}),
            tenant("chatty", CHATTY, quota={"output_tokens_per_minute": OUTPUT_TOKENS_PER_MINUTE}),
            tenant(
                "queued",
                QUEUED,
                default_class="interactive",
                quota={"max_concurrent_sequences": 2, "max_queued_requests": 1},
            ),
            tenant("roomy", ROOMY, quota={"kv_block_share": 0.01}),
        ],
        "admin_api_keys": [ADMIN],
        "limits": {"max_prompt_tokens": 512, "max_output_tokens": 4000},
    }


def prompt_of(num_tokens: int) -> str:
    """A prompt of exactly `num_tokens` tokens (byte-level tokenizer, BOS included)."""
    return _TEXT[: num_tokens - 1]


def _body(prompt_tokens: int = 20, max_tokens: int = 2, **fields: Any) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL,
        "prompt": prompt_of(prompt_tokens),
        "max_tokens": max_tokens,
        "temperature": 0,
        **fields,
    }


def _post(
    server: Server, key: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    """One request on its own connection (safe from any thread)."""
    return httpx.post(
        f"{server.base_url}/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {key}", **(headers or {})},
        timeout=120,
    )


def _assert_refused(response: httpx.Response, code: str, retry_after: bool = True) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == code, error
    assert ("retry-after" in response.headers) == retry_after, response.headers
    if retry_after:
        assert int(response.headers["retry-after"]) >= 1


@pytest.fixture(scope="module")
def ingress_replicas(server: Server) -> set[str]:
    """Both ingress replicas' names, each seen answering (the proxy spreads requests)."""
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only ingress replicas {seen} answered"
        response = _post(server, ACME, _body())
        assert response.status_code == 200, response.text
        seen.add(response.headers["x-pdserve-ingress"])
    return seen


# ---- quotas with 2 ingress replicas --------------------------------------------------------


def test_request_rate_is_global_across_ingress_replicas(
    server: Server, ingress_replicas: set[str]
) -> None:
    admitted: list[str] = []
    deadline = time.monotonic() + 60
    while len(admitted) < RATED_BURST:
        assert time.monotonic() < deadline, f"only {len(admitted)} admitted"
        response = _post(server, RATED, _body())
        if response.status_code == 200:
            admitted.append(response.headers["x-pdserve-ingress"])
        else:
            _assert_refused(response, "tenant_rate_limit")
            assert "quota.requests_per_second" in response.json()["error"]["message"]
    assert set(admitted) <= ingress_replicas
    # The burst is spent globally: requests the proxy spreads over both replicas are refused
    # (a per-replica count would admit up to RATED_BURST more on the other replica).
    for _ in range(12):
        _assert_refused(_post(server, RATED, _body()), "tenant_rate_limit")
    # The refill time of one token at 0.001/s.
    assert int(_post(server, RATED, _body()).headers["retry-after"]) > 100


def test_prompt_tokens_per_minute_is_global(server: Server, ingress_replicas: set[str]) -> None:
    prompt_tokens = 50
    admitted_tokens = 0
    # Refusals counted in all, not in a row: on a slow machine a refill (one request's worth
    # every 5 s) can land between two refusals, and the bounds below allow for refill.
    refusals = 0
    started = time.monotonic()
    while refusals < 12:
        assert time.monotonic() - started < 120, "the prompt-token quota never refused"
        response = _post(server, WORDY, _body(prompt_tokens))
        if response.status_code == 200:
            admitted_tokens += response.json()["usage"]["prompt_tokens"]
        else:
            _assert_refused(response, "tenant_prompt_tokens_per_minute")
            refusals += 1
    refill = PROMPT_TOKENS_PER_MINUTE / 60 * (time.monotonic() - started)
    # At most the bucket plus its refill, whichever replica admitted them; at least the bucket
    # minus what the two replicas' leases may each hold unused (< one request each).
    assert admitted_tokens <= PROMPT_TOKENS_PER_MINUTE + refill
    assert admitted_tokens >= PROMPT_TOKENS_PER_MINUTE - 2 * prompt_tokens


def test_output_tokens_are_charged_as_produced(server: Server) -> None:
    produced = 0
    for _ in range(8):
        response = _post(server, CHATTY, _body(max_tokens=40, ignore_eos=True))
        if response.status_code != 200:
            _assert_refused(response, "tenant_output_tokens_per_minute")
            break
        produced += response.json()["usage"]["completion_tokens"]
    else:
        pytest.fail(f"{produced} output tokens admitted under a quota of 60/min")
    # The bucket (60) is spent, plus at most one request admitted on each replica's last
    # lease before the debt reached the service.
    assert OUTPUT_TOKENS_PER_MINUTE <= produced <= OUTPUT_TOKENS_PER_MINUTE + 2 * 40


def test_concurrent_sequences_and_queue_are_global(
    server: Server, ingress_replicas: set[str]
) -> None:
    # n counts: a request of n=3 can never fit a quota of 2 sequences (no Retry-After).
    _assert_refused(_post(server, QUEUED, _body(n=3)), "tenant_concurrent_sequences", False)
    in_flight: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            quota = server.stats()["quotas"].get("queued")
            if quota is not None:
                in_flight.append(quota["num_sequences"])
            time.sleep(0.05)

    # Six requests at once from six connections (the proxy spreads them over both ingress
    # replicas), each n=2, the whole quota: one runs, one waits in the tenant's queue (its
    # length is 1), the rest are refused whichever replica they reached.
    body = _body(max_tokens=200, n=2, ignore_eos=True)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(lambda _: _post(server, QUEUED, body), range(6)))
    finally:
        stop.set()
        watcher.join(timeout=60)
    refused = [r for r in responses if r.status_code != 200]
    for response in refused:
        _assert_refused(response, "tenant_queue_full")
    assert refused, "six simultaneous requests fit a quota of one running and one queued"
    assert len(responses) - len(refused) >= 2  # the queued request ran after the first
    assert in_flight and max(in_flight) <= 2, in_flight
    wait_for_quota(server, "queued", lambda q: q["num_sequences"] == 0 and q["num_queued"] == 0)


def test_kv_share_counts_the_blocks_a_request_can_fill(
    server: Server, ingress_replicas: set[str]
) -> None:
    # 20 prompt + 300 output tokens = 20 blocks per choice: n=3 (60) never fits 40 blocks.
    body = _body(prompt_tokens=20, max_tokens=300, ignore_eos=True)
    _assert_refused(_post(server, ROOMY, {**body, "n": 3}), "tenant_kv_share", False)
    # n=2 (40 blocks) fits alone; six at once from six connections: one runs at a time.
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: _post(server, ROOMY, {**body, "n": 2}), range(6)))
    refused = [r for r in responses if r.status_code != 200]
    for response in refused:
        _assert_refused(response, "tenant_kv_share")
        assert "quota.kv_block_share" in response.json()["error"]["message"]
    assert refused and len(refused) < len(responses)
    wait_for_quota(server, "roomy", lambda q: q["kv_blocks"].get("decode", 0) == 0)


def wait_for_quota(server: Server, tenant: str, predicate: Any, timeout_s: float = 90) -> None:
    """Poll the quota service's state of `tenant` (through the stats route) until
    `predicate` holds; a poll the service did not answer in time is retried."""
    deadline = time.monotonic() + timeout_s
    while not (tenant in (quotas := server.stats()["quotas"]) and predicate(quotas[tenant])):
        assert time.monotonic() < deadline, f"quota state of {tenant}: {quotas}"
        time.sleep(0.1)


# ---- SLO classes ---------------------------------------------------------------------------


def test_slo_class_may_be_lowered_not_raised(server: Server) -> None:
    default = _post(server, ACME, _body())
    assert default.headers["x-pdserve-slo-class"] == "interactive"
    lowered = _post(server, ACME, _body(), {"x-pdserve-slo-class": "batch"})
    assert lowered.status_code == 200 and lowered.headers["x-pdserve-slo-class"] == "batch"
    in_body = _post(server, ACME, _body(pdserve={"slo_class": "batch"}))
    assert in_body.headers["x-pdserve-slo-class"] == "batch"
    raised = _post(server, GLOBEX, _body(pdserve={"slo_class": "interactive"}))
    assert raised.status_code == 403, raised.text
    assert raised.json()["error"]["code"] == "slo_class_not_allowed"
    unknown = _post(server, ACME, _body(), {"x-pdserve-slo-class": "gold"})
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_slo_class"


def test_fairness_interactive_keeps_its_ttft_while_batch_runs_at_full_quota(
    server: Server,
) -> None:
    stop = threading.Event()
    globex_codes: list[int] = []
    health_codes: list[int] = []

    def flood() -> None:  # globex: n=8 streams, as many as its quota lets in
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            while not stop.is_set():
                body = _body(max_tokens=32, n=8, ignore_eos=True)
                response = http.post(
                    "/v1/completions", json=body, headers={"authorization": f"Bearer {GLOBEX}"}
                )
                globex_codes.append(response.status_code)
                if response.status_code == 429:
                    time.sleep(0.05)

    def probe_health() -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            while not stop.is_set():
                health_codes.append(http.get("/health").status_code)
                time.sleep(0.2)

    threads = [threading.Thread(target=flood) for _ in range(3)]
    threads.append(threading.Thread(target=probe_health))
    for thread in threads:
        thread.start()
    try:
        wait_for_quota(server, "globex", lambda q: q["num_sequences"] == 16)
        client = server.openai(ACME)
        ttfts = []
        for _ in range(5):
            started = time.monotonic()
            stream = client.completions.create(
                model=SERVED_MODEL, prompt=prompt_of(40), max_tokens=8, temperature=0, stream=True
            )
            chunks = iter(stream)
            next(chunks)
            ttfts.append(time.monotonic() - started)
            assert sum(1 for _ in chunks) >= 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert all(ttft <= INTERACTIVE_TTFT_S for ttft in ttfts), ttfts
    assert health_codes and set(health_codes) == {200}, health_codes
    assert 429 in globex_codes and 200 in globex_codes  # globex ran at, and past, its quota
    assert set(globex_codes) <= {200, 429}
