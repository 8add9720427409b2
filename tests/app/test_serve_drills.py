"""Fault drills: real signals to real replica processes, and a hostile peer on a KV endpoint.

Each drill injects one fault into the running app (prefill SIGKILLed mid-transfer, prefill
SIGSTOPped past the ticket deadline then SIGCONTed, decode SIGKILLed mid-stream, 50 client
disconnects at the first token, garbage/oversized frames and a wrong-secret handshake on the
decode replica's KV endpoint), then checks that no request is stuck, no KV block is leaked
(also the autouse check of conftest) and greedy output still equals `transformers`.

The KV cache is small (256 blocks per replica) so freed blocks are reused soon: a stopped
sender's late writes into blocks that went to another request would show as wrong output of
the concurrent greedy control requests, or as checksum failures (checksums are on).
Replica logs, for a drill that fails: `bench.serve.faults.serve_log_dir()` of the test's Ray
session.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from bench.serve.faults import (
    peak_rss_bytes,
    replica_log_lines,
    replica_pids,
    signal_pid,
    wait_for_new_replica,
)

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

APP = "pdserve"
MODEL = "pdserve-tiny"
DEADLINE_S = 3.0  # the ticket deadline: short, so a stopped prefill is given up on quickly
# Requests a replica is killed under: long enough that none can finish before the kill;
# they cost nothing, since they never finish. Two at once must run together: each ends on
# under 128 of the 256 blocks (admission keeps room for a running request's output,
# engine/growth.py, so a second one that could not fit would wait instead).
KILLED_MAX_TOKENS = 1900
RESTART_TIMEOUT_S = 180.0  # Serve notices a dead replica and starts another within this
REQUEST_TIMEOUT_S = 120.0
BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4  # layers x (K, V) x kv heads x head dim x block x fp32


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {
            "model": str(model_dir),
            "num_threads": 1,
            "kv_cache_bytes": 256 * BLOCK_BYTES,
        },
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.5},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm", "deadline_s": DEADLINE_S, "checksum": True},
        "local_prefill_threshold": 32,  # short prompts: decode prefills them (control traffic)
        "limits": {"max_prompt_tokens": 1024, "max_output_tokens": KILLED_MAX_TOKENS},
    }


def long_prompt(i: int) -> str:
    """A distinct ~330-token prompt (no prefix shared with another), prefilled remotely."""
    return f"{i:04d} long prompt, its KV goes over shared memory in a few layers. " * 5


def short_prompt(i: int) -> str:
    """A distinct prompt under the local prefill threshold: decode prefills it itself."""
    return f"control {i:03d}"


# ------------------------------------------------------------------------------- clients


def complete(server: Server, prompt: str, max_tokens: int, **extra: Any) -> str:
    """A greedy non-streaming completion; fails the test on any status but 200."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(
        f"{server.base_url}/v1/completions", json={**body, **extra}, timeout=REQUEST_TIMEOUT_S
    )
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def stream_events(
    server: Server, prompt: str, max_tokens: int, stop_after_first_token: bool = False
) -> Iterator[dict[str, Any]]:
    """Yield each SSE event's JSON of a greedy streamed completion, until `[DONE]`."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, read=30.0)  # a silent stream is a hung one
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, timeout=timeout
    ) as response:
        assert response.status_code == 200, response.read().decode()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return
            event = json.loads(data)
            yield event
            if stop_after_first_token and _has_text(event):
                return  # leaving the `with` closes the connection: a client disconnect


def _has_text(event: dict[str, Any]) -> bool:
    return any(choice.get("text") for choice in event.get("choices") or [])


# ------------------------------------------------------------------------------- checks


def pool_stats(server: Server) -> dict[str, dict[str, Any]]:
    """Every pool's stats, once every pool answers: a pool that does not answer within the
    stats route's bound shows `{"error": ...}` (a replica restarting, a loaded machine), and
    is asked again for up to `RESTART_TIMEOUT_S`."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        pools = dict(server.stats()["pools"])
        silent = {name: pool["error"] for name, pool in pools.items() if "error" in pool}
        if not silent:
            return pools
        if time.monotonic() > deadline:
            pytest.fail(f"pools not answering their stats after {RESTART_TIMEOUT_S}s: {silent}")
        time.sleep(0.5)


def wait_running(server: Server, pool: str, count: int, timeout_s: float = 30.0) -> None:
    """Wait until `pool` reports at least `count` running requests."""
    deadline = time.monotonic() + timeout_s
    while (running := pool_stats(server)[pool]["num_running"]) < count:
        if time.monotonic() > deadline:
            pytest.fail(f"{pool} runs {running} requests after {timeout_s}s, expected {count}")
        time.sleep(0.05)


def assert_quiescent(server: Server, timeout_s: float = 30.0) -> None:
    """No request left in any pool (running, waiting, waiting for KV) and every block free."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {
            name: {k: pool[k] for k in ("num_running", "num_waiting", "num_waiting_for_kv")}
            | {"num_used_blocks": pool["num_blocks"] - pool["num_free_blocks"]}
            for name, pool in pool_stats(server).items()
        }
        stuck = {name: b for name, b in busy.items() if any(b.values())}
        if not stuck:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"requests or blocks still held {timeout_s}s after the drill: {stuck}")
        time.sleep(0.2)


def assert_greedy_still_correct(server: Server, hf: HFGreedy, drill: int) -> None:
    """Both paths, remote prefill (a long prompt) and local, still match transformers."""
    for prompt in (long_prompt(9000 + drill), short_prompt(900 + drill)):
        assert complete(server, prompt, 12) == hf.complete(prompt, 12).text, prompt


def wait_remote_prefill(
    server: Server, hf: HFGreedy, done: Callable[[], bool] | None = None, timeout_s: float = 60.0
) -> None:
    """Poll with correct long-prompt requests until a remote prefill has happened (`done`;
    by default: the (new) prefill replica has served one). The router may still pick a dead
    replica for a moment, and adaptive disaggregation prefills a long prompt on the decode
    replica while the ingress's view of the prefill pool lags a burst (the prompts it sent
    since the pool's last stats count as queued there): decode then prefills locally."""
    if done is None:

        def done() -> bool:
            return pool_stats(server)["prefill"]["counters"].get("requests", 0) > 0

    deadline = time.monotonic() + timeout_s
    i = 0
    while not done():
        if time.monotonic() > deadline:
            reasons = [r["reason"] for r in server.stats()["routing"]["recent"][-3:]]
            pytest.fail(f"remote prefill never resumed; the last routing decisions: {reasons}")
        prompt = long_prompt(8000 + i)
        assert complete(server, prompt, 4) == hf.complete(prompt, 4).text, prompt
        i += 1
        time.sleep(0.5)


def remote_prefills(server: Server) -> int:
    """The KV handovers the decode replica has received from the prefill pool."""
    return int(pool_stats(server)["decode"]["counters"].get("remote_prefill", 0))


def wait_serving(server: Server, hf: HFGreedy, timeout_s: float = RESTART_TIMEOUT_S) -> None:
    """Poll until a greedy request is answered correctly (errors while replicas restart)."""
    prompt = short_prompt(901)
    expected = hf.complete(prompt, 8).text
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            response = httpx.post(
                f"{server.base_url}/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0},
                timeout=30,
            )
            if response.status_code == 200:
                assert response.json()["choices"][0]["text"] == expected
                return
            last = (response.status_code, response.text[:300])
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(1.0)
    pytest.fail(f"service did not recover within {timeout_s}s; last answer: {last!r}")


def the_pid(deployment: str) -> int:
    pids = replica_pids(APP, deployment)
    assert len(pids) == 1, f"{deployment} replicas: {pids}"
    return pids[0]


def restart_and_recover(server: Server, hf: HFGreedy, deployment: str, old_pid: int) -> None:
    """After a SIGKILL: a new replica process is up and the service answers correctly."""
    new_pid = wait_for_new_replica(APP, deployment, {old_pid}, RESTART_TIMEOUT_S)
    assert new_pid is not None, f"Serve did not restart {deployment} (pid {old_pid} killed)"
    wait_serving(server, hf)


def checksum_failures() -> list[str]:
    return replica_log_lines(APP, "decode", "ChecksumMismatch") + replica_log_lines(
        APP, "decode", "crc32"
    )


# ------------------------------------------------------------------------------- drills


def test_prefill_sigkilled_mid_transfer(server: Server, hf: HFGreedy) -> None:
    prompts = [long_prompt(i) for i in range(10)]
    expected = [hf.complete(p, 16).text for p in prompts]
    pid = the_pid("prefill")
    before = pool_stats(server)["decode"]["counters"]
    with ThreadPoolExecutor(max_workers=10) as pool:
        futures = [pool.submit(complete, server, p, 16) for p in prompts[:6]]
        time.sleep(0.3)  # their prefills and KV writes are under way
        assert signal_pid(pid, signal.SIGKILL)
        futures += [pool.submit(complete, server, p, 16) for p in prompts[6:]]  # to a dead one
        texts = [f.result(timeout=REQUEST_TIMEOUT_S) for f in futures]
    assert texts == expected
    restart_and_recover(server, hf, "prefill", pid)
    after = pool_stats(server)["decode"]["counters"]
    finished = sum(
        after.get(k, 0) - before.get(k, 0) for k in ("remote_prefill", "local_prefill_fallback")
    )
    assert finished >= len(prompts)  # every long prompt: remote, or retried then local
    wait_remote_prefill(server, hf)  # the new replica serves, not only the local fallback
    assert_quiescent(server)
    assert_greedy_still_correct(server, hf, 1)


def test_prefill_sigstopped_past_deadline_then_continued(server: Server, hf: HFGreedy) -> None:
    stalled = [long_prompt(100 + i) for i in range(6)]
    during = [long_prompt(200 + i) for i in range(4)]
    controls = [short_prompt(i) for i in range(60)]
    expected = {p: hf.complete(p, 24).text for p in stalled + during + controls}
    pid = the_pid("prefill")
    checksum_before = len(checksum_failures())
    before = pool_stats(server)["decode"]["counters"]
    done = threading.Event()
    control_results: list[tuple[str, str]] = []

    def control_loop() -> None:
        # Short prompts prefilled on decode; with 256 blocks the free list cycles within
        # seconds, so blocks freed by expired tickets soon hold these requests' KV.
        i = 0
        while not done.is_set() and i < 10_000:
            prompt = controls[i % len(controls)]
            control_results.append((prompt, complete(server, prompt, 24)))
            i += 1

    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(complete, server, p, 24) for p in stalled]
        time.sleep(0.3)
        assert signal_pid(pid, signal.SIGSTOP)
        try:
            loops = [pool.submit(control_loop) for _ in range(3)]
            futures += [pool.submit(complete, server, p, 24) for p in during]
            # Both remote attempts of every request expire; decode prefills them itself.
            time.sleep(2 * DEADLINE_S + 3.0)
        finally:
            assert signal_pid(pid, signal.SIGCONT)
        time.sleep(3.0)  # the thawed sender runs on while control requests use its old blocks
        done.set()
        texts = {
            p: f.result(timeout=REQUEST_TIMEOUT_S)
            for p, f in zip(stalled + during, futures, strict=True)
        }
        for loop in loops:
            loop.result(timeout=REQUEST_TIMEOUT_S)
    assert texts == {p: expected[p] for p in stalled + during}
    wrong = [(p, text) for p, text in control_results if text != expected[p]]
    assert control_results and not wrong, f"{len(wrong)}/{len(control_results)} wrong: {wrong[:3]}"
    assert the_pid("prefill") == pid  # stopped, not replaced: its late writes were possible
    assert_quiescent(server)
    counters = pool_stats(server)["decode"]["counters"]
    # The stop outlived ticket deadlines: attempts failed, and decode prefilled locally.
    for name in ("prefill_failures", "local_prefill_fallback"):
        assert counters.get(name, 0) > before.get(name, 0), (name, before, counters)
    assert not {k: v for k, v in counters.items() if "checksum" in k and v}, counters
    assert len(checksum_failures()) == checksum_before, checksum_failures()[-5:]
    assert_greedy_still_correct(server, hf, 2)


def test_decode_sigkilled_mid_stream(server: Server, hf: HFGreedy) -> None:
    pid = the_pid("decode")
    with ThreadPoolExecutor(max_workers=2) as pool:
        blocking: Future[httpx.Response] = pool.submit(
            httpx.post,
            f"{server.base_url}/v1/completions",
            json={
                "model": MODEL,
                "prompt": short_prompt(500),
                "max_tokens": KILLED_MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=REQUEST_TIMEOUT_S,
        )
        events = stream_events(server, short_prompt(501), KILLED_MAX_TOKENS)
        first = next(events)
        assert _has_text(first) or "choices" in first, first
        # Both requests must be on the decode replica when it dies, or the non-streaming one
        # may reach the replacement and be served (200) instead of losing its replica.
        wait_running(server, "decode", 2)
        assert not blocking.done(), "the non-streaming request finished before the kill"
        assert signal_pid(pid, signal.SIGKILL)
        rest = list(events)  # ends (read timeout 30 s would raise: a hung stream)
        response = blocking.result(timeout=REQUEST_TIMEOUT_S)
    errors = [e["error"] for e in rest if "error" in e]
    assert len(errors) == 1 and "error" in rest[-1], rest[-3:]  # the last event: the error
    assert 500 <= response.status_code < 600, response.text
    body = response.json()["error"]
    for error in (errors[0], body):
        assert error["type"], error
        # Says what happened (the replica serving it was lost), not a generic 500.
        assert "internal server error" not in error["message"].lower(), error
    restart_and_recover(server, hf, "decode", pid)
    assert_quiescent(server)
    assert_greedy_still_correct(server, hf, 3)


def test_fifty_disconnects_at_first_token(server: Server, hf: HFGreedy) -> None:
    prompts = [long_prompt(300 + i) if i % 2 else short_prompt(300 + i) for i in range(50)]

    def disconnect(prompt: str) -> int:
        return sum(1 for _ in stream_events(server, prompt, 200, stop_after_first_token=True))

    with ThreadPoolExecutor(max_workers=10) as pool:
        counts = list(pool.map(disconnect, prompts, timeout=REQUEST_TIMEOUT_S))
    assert all(n >= 1 for n in counts)  # each one saw its first token, then hung up
    assert_quiescent(server)
    assert_greedy_still_correct(server, hf, 4)


# ------------------------------------------------------------------- a hostile KV peer

OVERSIZED_NBYTES = 512 * 1024**2  # a HELLO claiming 512 MiB of JSON


def kv_control_address(pid: int) -> str:
    """The decode replica's shm control socket (abstract: `@pdkv-<pid>-<random>.ctl`)."""
    with open("/proc/net/unix", encoding="ascii") as f:
        names = [line.split()[-1] for line in f if f"@pdkv-{pid}-" in line]
    listening = sorted({name for name in names if name.endswith(".ctl")})
    assert len(listening) == 1, f"KV control sockets of pid {pid}: {listening}"
    return "\0" + listening[0].removeprefix("@")


def connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(address)
    return sock


def frame(kind: int, payload: bytes = b"", nbytes: int | None = None) -> bytes:
    from kvtransfer.wire import _HEADER, MAGIC

    size = len(payload) if nbytes is None else nbytes
    return _HEADER.pack(MAGIC, kind, 0, 0, 0, 0, size, 0) + payload


def read_until_closed(sock: socket.socket, timeout_s: float = 20.0) -> bytes:
    """Everything the peer sends until it closes the connection; fails if it never does."""
    received, closed = read_for(sock, timeout_s)
    if not closed:
        kinds = [kind for kind, _ in frames_in(received)]
        pytest.fail(f"the KV endpoint kept a hostile connection open {timeout_s}s; sent {kinds}")
    return received


def read_for(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """What the peer sends within `timeout_s`, and whether it closed the connection."""
    received = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return received, True
        if not chunk:
            return received, True
        received += chunk
    return received, False


def frames_in(data: bytes) -> list[tuple[int, bytes]]:
    """(kind, payload) of each whole frame in `data`."""
    from kvtransfer.wire import _HEADER, HEADER_SIZE

    out = []
    while len(data) >= HEADER_SIZE:
        _, kind, _, rid_len, _, _, nbytes, _ = _HEADER.unpack(data[:HEADER_SIZE])
        start = HEADER_SIZE + rid_len
        out.append((kind, data[start : start + nbytes]))
        data = data[start + nbytes :]
    return out


def hello_body(server: Server) -> dict[str, Any]:
    """A HELLO with the app's true protocol version and layout (what a peer could learn)."""
    from app.config import load_config
    from engine.builtin import resolve_model_dir
    from engine.kv_cache import KVCacheSpec
    from engine.loader import load_model_config
    from kvtransfer.base import KVLayout
    from kvtransfer.wire import PROTOCOL_VERSION
    from replica.engine_replica import model_id_for

    engine_config = load_config(server.args).model.to_engine_config()
    model_dir = str(resolve_model_dir(engine_config.model_dir))
    model_config = load_model_config(model_dir, engine_config.dtype)
    spec = KVCacheSpec.for_engine(engine_config, model_config)
    layout = KVLayout.from_spec(spec, model_id_for(model_config, model_dir))
    return {"version": PROTOCOL_VERSION, "layout": layout.to_dict()}


def wrong_secret_hello(sock: socket.socket, hello: dict[str, Any]) -> bytes:
    """Answer the receiver's CHALLENGE (if it sends one) with a HELLO whose proof is made
    with a wrong secret; returns the bytes read while waiting for the challenge."""
    from kvtransfer.wire import Kind

    received = b""
    sock.settimeout(2.0)
    with contextlib.suppress(TimeoutError):
        while len(frames_in(received)) == 0:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    sock.settimeout(5.0)
    challenge_kind = getattr(Kind, "CHALLENGE", None)  # absent: an unauthenticated protocol
    challenge = next((p for k, p in frames_in(received) if k == challenge_kind), None)
    if challenge is not None:
        from kvtransfer import auth  # the handshake with a challenge is authenticated

        nonce_r = str(json.loads(challenge)["nonce"])
        hello = {**hello, "nonce": auth.new_nonce()}
        hello["mac"] = auth.hello_mac("not the app's secret", nonce_r, hello["nonce"], hello)
    sock.sendall(frame(Kind.HELLO, json.dumps(hello).encode()))
    return received


def test_kv_endpoint_survives_garbage_and_oversized_frames(server: Server, hf: HFGreedy) -> None:
    from kvtransfer.wire import Kind

    pid = the_pid("decode")
    address = kv_control_address(pid)
    before = remote_prefills(server)

    with connect(address) as sock:  # garbage: no frame at all
        sock.sendall(os.urandom(64 * 1024))
        read_until_closed(sock)
    with connect(address) as sock:  # the right magic, a kind that does not exist
        sock.sendall(frame(200, b"{}"))
        read_until_closed(sock)
    with connect(address) as sock:  # a control frame claiming 512 MiB
        peak = peak_rss_bytes(pid)
        sock.sendall(frame(Kind.HELLO, nbytes=OVERSIZED_NBYTES))
        sock.sendall(b"{" * 4096)
        read_until_closed(sock)
        grown = peak_rss_bytes(pid) - peak
        assert grown < OVERSIZED_NBYTES // 4, f"the replica allocated {grown} bytes for it"

    assert the_pid("decode") == pid  # the replica survived all of it
    assert_greedy_still_correct(server, hf, 5)
    # A real prefill replica still hands KV over this endpoint.
    wait_remote_prefill(server, hf, lambda: remote_prefills(server) > before)
    assert_quiescent(server)


def test_kv_endpoint_refuses_a_wrong_secret(server: Server, hf: HFGreedy) -> None:
    from kvtransfer.wire import Kind

    pid = the_pid("decode")
    before = remote_prefills(server)
    with connect(kv_control_address(pid)) as sock:
        received = wrong_secret_hello(sock, hello_body(server))
        rest, closed = read_for(sock, 20.0)
    answered = frames_in(received + rest)
    kinds = [Kind(k).name if k in Kind._value2member_map_ else k for k, _ in answered]
    assert Kind.WELCOME not in [k for k, _ in answered], f"welcomed without the secret: {kinds}"
    assert closed, f"the connection stayed open after a failed handshake; sent {kinds}"
    for _, payload in answered:
        revealed = [word for word in (b"model_id", b"num_kv_heads", b"tiny/") if word in payload]
        assert not revealed, f"the refusal reveals the layout: {payload[:300]!r}"

    assert the_pid("decode") == pid
    assert_greedy_still_correct(server, hf, 6)
    # The app's own prefill replica still authenticates.
    wait_remote_prefill(server, hf, lambda: remote_prefills(server) > before)
    assert_quiescent(server)
