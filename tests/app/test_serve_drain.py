"""A redeploy during long streams completes every stream (drain), and a redeploy keeps the
app's KV-transfer secret (an old decode replica can still use a new prefill replica).

Streams are started, and once each has produced tokens the app is redeployed with a
changed engine setting, which replaces every replica (ingress, prefill, decode). The old
replicas drain (Serve's graceful shutdown, bounded by the pool's `drain_timeout_s`) while
the new ones start: every stream must finish with exactly `transformers`' greedy output.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

MODEL = "pdserve-tiny"
PROMPTS = [f"stream number {i} keeps going for a long while: " * 3 for i in range(3)]
MAX_TOKENS = 1500
REDEPLOY_TIMEOUT_S = 300.0


def pdserve_args(model_dir: Path, max_num_seqs: int = 16) -> dict[str, Any]:
    # 0.25 CPU per replica: the old and the new generation fit on 2 CPUs side by side.
    return {
        "model": {"model": str(model_dir), "num_threads": 1, "kv_cache_bytes": 32 * 1024**2},
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.25, "drain_timeout_s": 300},
            {
                "name": "decode",
                "role": "decode",
                "num_cpus": 0.25,
                "drain_timeout_s": 300,
                "engine": {"max_num_seqs": max_num_seqs},
            },
        ],
        "transfer": {"backend": "shm"},
        "local_prefill_threshold": 0,
        "limits": {"max_output_tokens": MAX_TOKENS},
    }


def _replicas(server: Server) -> set[str]:
    return {pool["replica"] for pool in server.stats()["pools"].values()}


def test_redeploy_during_long_streams_completes_every_stream(
    server: Server, hf: HFGreedy, model_dir: Path
) -> None:
    from ray import serve

    from app.main import build_app

    expected = [hf.complete(prompt, MAX_TOKENS) for prompt in PROMPTS]
    client = server.openai()
    old_replicas = _replicas(server)
    started = [threading.Event() for _ in PROMPTS]
    finished_at: list[float] = [0.0] * len(PROMPTS)

    def stream(index: int) -> tuple[str, str | None]:
        text, reason = "", None
        chunks = client.completions.create(
            model=MODEL, prompt=PROMPTS[index], max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        for chunk in chunks:
            choice = chunk.choices[0]
            text += choice.text
            reason = choice.finish_reason or reason
            started[index].set()
        finished_at[index] = time.monotonic()
        return text, reason

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream, i) for i in range(len(PROMPTS))]
        for event in started:
            assert event.wait(120), "a stream produced no token"
        redeploy_at = time.monotonic()
        serve.run(
            build_app(pdserve_args(model_dir, max_num_seqs=17)), name="pdserve", route_prefix="/"
        )
        results = [future.result(timeout=REDEPLOY_TIMEOUT_S) for future in futures]

    assert any(at > redeploy_at for at in finished_at), "every stream ended before the redeploy"
    for (text, reason), reference in zip(results, expected, strict=True):
        assert text == reference.text
        want = "length" if len(reference.output_ids) == MAX_TOKENS else "stop"
        assert reason == want
    new_replicas = _replicas(server)
    assert not new_replicas & old_replicas, "the redeploy did not replace the replicas"
    # The new generation serves, with the same output.
    again = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert again.choices[0].text == hf.complete(PROMPTS[0], 8).text


def _transfer_options(app: Any) -> list[Any]:
    """The `TransferOptions` bound to every pool deployment of a built app (Serve's bound
    arguments: the ingress takes the config dump, then the decode and prefill pools)."""
    _, decode, prefill = app._bound_deployment.init_args
    return [pool._bound_deployment.init_args[2] for pool in (*decode.values(), *prefill.values())]


def test_redeploy_keeps_the_kv_secret_of_the_app(server: Server, model_dir: Path) -> None:
    from app.main import build_app, kv_secret

    # `server` holds the module's Ray instance; the running app was built on it.
    before = build_app(pdserve_args(model_dir))
    after = build_app(pdserve_args(model_dir, max_num_seqs=17))  # a redeploy's build
    secrets = {options.secret for options in _transfer_options(before) + _transfer_options(after)}
    assert secrets == {kv_secret("pdserve")}
    (secret,) = secrets
    assert secret is not None and len(secret) >= 32
    other = {**pdserve_args(model_dir), "app_name": "another-app"}
    assert {options.secret for options in _transfer_options(build_app(other))} != secrets
    # Never in the config the ingress gets (its /stats and logs show that), nor in a repr.
    config_dump = after._bound_deployment.init_args[0]
    assert secret not in json.dumps(config_dump)
    assert all(secret not in repr(options) for options in _transfer_options(after))
