"""Tenants and context-length routing end to end (a small `configs/cpu-tenants.yaml`).

Prompts under 16 tokens are prefilled on the decode replica, 16..64 on prefill pool `short`,
65..512 on `long`. acme may use every pool, globex only `short` (and `decode`), initech
every pool but one request at a time. Every decision is checked three ways: the response's
`x-pdserve-route` header, the ingress's routing report, and the pools' own counters.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

if TYPE_CHECKING:  # conftest is pytest's to import; its types are only needed for hints
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

SERVED_MODEL = "pdserve-tiny"
THRESHOLD = 16
SHORT = (16, 64)
LONG = (65, 512)
MAX_PROMPT_TOKENS = LONG[1]
MAX_TOKENS = 8
ADMIN = "sk-pdserve-admin-test"
# A request that holds initech's one slot: generating this many tokens takes over 10 s here.
HOLDER_MAX_TOKENS = 3800

ACME = "sk-acme-test-0001"
GLOBEX = "sk-globex-test-0001"
INITECH = "sk-initech-test-0001"

# Printable ASCII: one token per character with the built-in byte-level tokenizer, plus BOS.
_TEXT = "".join(chr(32 + (i * 7) % 95) for i in range(MAX_PROMPT_TOKENS + 100))


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"model": str(model_dir), "num_threads": 1, "kv_cache_bytes": 32 * 1024**2},
        "pools": [
            {
                "name": "short",
                "role": "prefill",
                "num_cpus": 0.25,
                "min_context_tokens": SHORT[0],
                "max_context_tokens": SHORT[1],
            },
            {
                "name": "long",
                "role": "prefill",
                "num_cpus": 0.25,
                "min_context_tokens": LONG[0],
                "max_context_tokens": LONG[1],
            },
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm"},
        "local_prefill_threshold": THRESHOLD,
        # The static rules under test, not adaptive placement: a prefill pool whose one
        # measured step was slow (a loaded machine) would send a prompt to local prefill.
        "adaptive_prefill": {"enabled": False},
        "tenants": [
            {"name": "acme", "api_keys": [ACME], "allowed_pools": ["short", "long", "decode"]},
            {
                "name": "globex",
                "api_keys": [GLOBEX],
                "allowed_pools": ["short", "decode"],
                "priority": 1,
            },
            {"name": "initech", "api_keys": [INITECH], "max_concurrent_requests": 1},
        ],
        "admin_api_keys": [ADMIN],
        "limits": {"max_prompt_tokens": MAX_PROMPT_TOKENS, "max_output_tokens": HOLDER_MAX_TOKENS},
    }


def prompt_of(num_tokens: int, offset: int = 0) -> str:
    """A prompt that tokenizes to exactly `num_tokens` tokens (BOS included); prompts of
    different offsets (below 95) share no prefix."""
    return _TEXT[offset : offset + num_tokens - 1]


class Snapshot:
    """Routing counts and pool counters at one moment, to diff around a request."""

    def __init__(self, server: Server) -> None:
        stats = server.stats()
        self.routes = Counter(stats["routing"]["counts"])
        self.recent: list[dict[str, Any]] = stats["routing"]["recent"]
        self.counters = {name: Counter(pool["counters"]) for name, pool in stats["pools"].items()}

    def diff(self, before: Snapshot) -> tuple[Counter[str], dict[str, Counter[str]]]:
        """(new routing counts, new counter values per pool) since `before`."""
        routes = self.routes.copy()
        routes.subtract(before.routes)
        counters = {}
        for name, now in self.counters.items():
            delta = now.copy()
            delta.subtract(before.counters[name])
            counters[name] = +delta  # keep only the counters that moved
        return +routes, counters


def _complete(server: Server, api_key: str, prompt: str, **kwargs: Any) -> httpx.Response:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    headers = {"authorization": f"Bearer {api_key}"}
    return server.http.post("/v1/completions", json={**body, **kwargs}, headers=headers)


# ---- routing -----------------------------------------------------------------------------

ROUTES = [  # (prompt tokens, prefill pool or "local")
    (2, "local"),
    (THRESHOLD - 1, "local"),
    (SHORT[0], "short"),
    (40, "short"),
    (SHORT[1], "short"),
    (LONG[0], "long"),
    (300, "long"),
    (LONG[1], "long"),
]


@pytest.mark.parametrize(("num_tokens", "pool"), ROUTES)
def test_routes_by_prompt_length(server: Server, hf: HFGreedy, num_tokens: int, pool: str) -> None:
    # No prefix of another route's prompt: a decode replica holding one prefills a short
    # rest itself, whatever the route.
    prompt = prompt_of(num_tokens, offset=1 + ROUTES.index((num_tokens, pool)))
    ref = hf.complete(prompt, MAX_TOKENS)
    assert len(ref.prompt_ids) == num_tokens
    before = Snapshot(server)
    response = _complete(server, ACME, prompt)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == ref.text
    assert body["usage"]["prompt_tokens"] == num_tokens

    route = response.headers["x-pdserve-route"]
    assert route.startswith(f"len {num_tokens} ")
    if pool == "local":
        assert f"< local_prefill_threshold {THRESHOLD} -> local prefill on decode pool decode" in (
            route
        )
    else:
        assert f"-> pool {pool}, decode pool decode" in route

    after = Snapshot(server)
    routes, counters = after.diff(before)
    assert routes == {f"acme|{pool}|decode": 1}
    decision = after.recent[-1]
    assert decision["tenant"] == "acme"
    assert decision["num_prompt_tokens"] == num_tokens
    assert decision["decode_pool"] == "decode"
    assert decision["local_prefill"] is (pool == "local")
    assert decision["prefill_pool"] == (None if pool == "local" else pool)
    assert decision["reason"] == route

    if pool == "local":
        assert counters["decode"]["local_prefill"] == 1
        assert counters["decode"]["prompt_tokens"] == num_tokens  # prefilled there
        assert "remote_prefill" not in counters["decode"]
        assert counters["short"] == counters["long"] == {}
    else:
        assert counters["decode"]["remote_prefill"] == 1
        assert counters["decode"][f"prefill_pool:{pool}"] == 1
        assert "local_prefill" not in counters["decode"]
        assert counters[pool]["requests"] == 1
        assert counters[pool]["prompt_tokens"] == num_tokens
        other = "long" if pool == "short" else "short"
        assert counters[other] == {}


@pytest.mark.parametrize(("num_tokens", "pool"), [(THRESHOLD - 1, "local"), (40, "short")])
def test_globex_uses_its_pools(server: Server, num_tokens: int, pool: str) -> None:
    before = Snapshot(server)
    response = _complete(server, GLOBEX, prompt_of(num_tokens))
    assert response.status_code == 200, response.text
    routes, _ = Snapshot(server).diff(before)
    assert routes == {f"globex|{pool}|decode": 1}


def test_globex_long_prompt_is_403(server: Server) -> None:
    before = Snapshot(server)
    response = _complete(server, GLOBEX, prompt_of(200))
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["type"] == "permission_error"
    assert error["code"] == "permission_denied"
    assert "globex" in error["message"] and "long" in error["message"]
    routes, counters = Snapshot(server).diff(before)
    assert routes == {}
    assert all(moved == {} for moved in counters.values())


def test_chat_is_routed_by_templated_length(server: Server, hf: HFGreedy) -> None:
    messages = [{"role": "user", "content": prompt_of(100)}]
    ref = hf.chat(messages, MAX_TOKENS)
    before = Snapshot(server)
    chat = server.openai(ACME).chat.completions.with_raw_response.create(
        model=SERVED_MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert chat.headers["x-pdserve-route"].startswith(f"len {len(ref.prompt_ids)} ")
    assert chat.parse().choices[0].message.content == ref.text
    routes, counters = Snapshot(server).diff(before)
    assert routes == {"acme|long|decode": 1}
    assert counters["long"]["requests"] == 1


def test_streaming_response_names_route(server: Server, hf: HFGreedy) -> None:
    prompt = prompt_of(30)
    ref = hf.complete(prompt, MAX_TOKENS)
    client = server.openai(ACME)
    with client.completions.with_streaming_response.create(
        model=SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
    ) as response:
        assert "-> pool short, decode pool decode" in response.headers["x-pdserve-route"]
        text = "".join(chunk.choices[0].text for chunk in response.parse() if chunk.choices)
    assert text == ref.text


def test_handle_api_routes_with_tenant_key(server: Server, hf: HFGreedy) -> None:
    from ray import serve

    from app.handle import GenerateRequest

    handle = serve.get_app_handle("pdserve").options(stream=True)
    prompt = prompt_of(100)
    ref = hf.complete(prompt, MAX_TOKENS)
    request = GenerateRequest(prompt=prompt, api_key=ACME, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(handle.generate.remote(request))
    assert "".join(chunk.text for chunk in chunks) == ref.text
    assert "-> pool long, decode pool decode" in chunks[-1].route

    denied = GenerateRequest(prompt=prompt, api_key=GLOBEX, max_tokens=MAX_TOKENS)
    with pytest.raises(Exception, match="may not use prefill pool 'long'"):
        list(handle.generate.remote(denied))
    anonymous = GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS)
    with pytest.raises(Exception, match="missing API key"):
        list(handle.generate.remote(anonymous))


# ---- authentication ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer sk-nobody"}, {"authorization": f"Basic {ACME}"}],
    ids=["missing", "unknown", "not-bearer"],
)
def test_bad_api_key_is_401(server: Server, headers: dict[str, str]) -> None:
    before = Snapshot(server)
    body = {"model": SERVED_MODEL, "prompt": "hello", "max_tokens": 4}
    for path, payload in [
        ("/v1/completions", body),
        ("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hi"}]}),
    ]:
        response = server.http.post(path, json=payload, headers=headers)
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["type"] == "authentication_error"
        assert error["code"] == "invalid_api_key"
        assert "API key" in error["message"]
    routes, _ = Snapshot(server).diff(before)
    assert routes == {}


def test_openai_client_authentication_error(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.openai("sk-nobody").completions.create(
            model=SERVED_MODEL, prompt="hello", max_tokens=4
        )


# ---- quota -------------------------------------------------------------------------------


def _hold_quota(client: openai.OpenAI) -> Any:
    """Start a long streaming request that holds the tenant's one concurrent slot."""
    return client.completions.create(
        model=SERVED_MODEL,
        prompt=prompt_of(200),
        max_tokens=HOLDER_MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )


def test_quota_exceeded_is_429(server: Server) -> None:
    client = server.openai(INITECH)
    holder = _hold_quota(client)
    try:
        next(iter(holder))  # initech's one request is now in flight
        response = _complete(server, INITECH, prompt_of(100))
        assert response.status_code == 429, response.text
        assert int(response.headers["retry-after"]) >= 1
        assert "-> pool" in response.headers["x-pdserve-route"]  # where it would have run
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error"
        assert error["code"] == "tenant_concurrent_requests"
        assert "initech" in error["message"] and "max_concurrent_requests" in error["message"]
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=SERVED_MODEL, prompt="hi", max_tokens=2)
        # The quota is per tenant: acme is not affected.
        assert _complete(server, ACME, prompt_of(100)).status_code == 200
    finally:
        holder.close()
    # Once the holder is gone its slot is released (asynchronously, after the disconnect;
    # the deadline only bounds a failing run).
    deadline = time.monotonic() + 30
    while (response := _complete(server, INITECH, prompt_of(20))).status_code == 429:
        assert time.monotonic() < deadline, "initech's slot was not released"
        time.sleep(0.2)
    assert response.status_code == 200, response.text


def test_quota_exceeded_is_429_for_streaming_requests(server: Server) -> None:
    client = server.openai(INITECH)
    holder = _hold_quota(client)
    try:
        next(iter(holder))
        response = _complete(server, INITECH, prompt_of(100), stream=True)
        assert response.status_code == 429, response.text
    finally:
        holder.close()


def test_operator_and_model_endpoints_need_keys(server: Server) -> None:
    assert server.http.get("/v1/models").status_code == 401
    listed = server.http.get("/v1/models", headers={"Authorization": f"Bearer {ACME}"})
    assert listed.status_code == 200 and listed.json()["data"][0]["id"] == SERVED_MODEL
    for key in (None, ACME):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        denied = server.http.get("/v1/pdserve/stats", headers=headers)
        assert denied.status_code == 401
        assert "admin" in denied.json()["error"]["message"]
