"""Decode-as-orchestrator in one process: real prefill and decode servers, KV over loopback
`tcp`, and over `shm`/`tcp` for the ownership tests (a cancellation at each await point).

The prefill pool is reached through a small in-process stand-in for a Serve handle (the
Serve path itself is exercised end to end in tests/app).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from decode.reservations import Reservation
from decode.server import DecodeServer
from decode.warm_up import RETRY_AFTER_S, PrefillWarmer
from engine.builtin import write_builtin_model
from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from kvtransfer import (
    Ticket,
    TransferOptions,
    TransferState,
    UnknownTransferError,
    create_sender,
)
from prefill.server import PrefillServer
from replica.protocol import GenerationSpec, WarmRequest

PROMPTS = ["a prompt long enough to span a few blocks of the paged KV cache", "tiny", "x" * 70]


class InProcessHandle:
    """Calls a server's coroutine methods like `handle.method.remote(...)` would."""

    def __init__(self, server: object, fail_times: int = 0, hang: bool = False) -> None:
        self._server = server
        self.fail_times = fail_times
        self.hang = hang  # a pool whose replicas never answer (all dead, none restarting)
        self.calls = 0

    @property
    def prefill(self) -> InProcessHandle:
        return self

    def remote(self, *args: object) -> asyncio.Future:
        self.calls += 1
        if self.hang:
            return asyncio.get_running_loop().create_future()  # never resolves
        if self.calls <= self.fail_times:

            async def dead() -> None:
                raise ConnectionError("prefill replica died")

            return asyncio.ensure_future(dead())
        return asyncio.ensure_future(self._server.prefill(*args))  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[list[int]]:
    engine = Engine(EngineConfig(model_dir=str(model_dir)))
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    return [o.token_ids for o in outputs]


@pytest.fixture()
def servers(model_dir: Path):
    config = EngineConfig(model_dir=str(model_dir))
    prefill = PrefillServer(config, backend="tcp")
    handle = InProcessHandle(prefill)
    decode = DecodeServer(config, backend="tcp", prefill_pools={"p": handle}, deadline_s=10)
    yield prefill, decode, handle
    decode.shutdown()
    prefill.shutdown()


async def collect(decode: DecodeServer, spec: GenerationSpec) -> list[int]:
    tokens: list[int] = []
    async for delta in decode.generate(spec):
        tokens.extend(delta.new_token_ids)
    return tokens


def spec_for(decode: DecodeServer, i: int, prompt: str, pool: str | None = "p") -> GenerationSpec:
    return GenerationSpec(
        request_id=f"r{i}-{time.monotonic_ns()}",
        prompt_token_ids=tuple(decode.engine.tokenize(prompt)),
        sampling_params=SamplingParams(max_tokens=12, temperature=0.0),
        prefill_pool=pool,
    )


def wait_all_free(*servers: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = [s.stats() for s in servers]  # type: ignore[attr-defined]
        if all(st["num_free_blocks"] == st["num_blocks"] and st["num_held"] == 0 for st in stats):
            return
        time.sleep(0.05)
    raise AssertionError(f"blocks still held: {stats}")


def test_remote_prefill_matches_local_generation(servers, expected) -> None:
    prefill, decode, _ = servers

    async def run() -> list[list[int]]:
        specs = [spec_for(decode, i, p) for i, p in enumerate(PROMPTS)]
        return list(await asyncio.gather(*(collect(decode, s) for s in specs)))

    assert asyncio.run(run()) == expected
    assert decode.stats()["counters"]["remote_prefill"] == len(PROMPTS)
    assert prefill.stats()["counters"]["requests"] == len(PROMPTS)
    wait_all_free(prefill, decode)


def test_local_prefill_when_no_pool_named(servers, expected) -> None:
    prefill, decode, _ = servers
    tokens = asyncio.run(collect(decode, spec_for(decode, 0, PROMPTS[0], pool=None)))
    assert tokens == expected[0]
    assert decode.stats()["counters"]["local_prefill"] == 1
    assert "requests" not in prefill.stats()["counters"]
    wait_all_free(prefill, decode)


@pytest.mark.parametrize("pool", ["p", None])
def test_a_whole_answer_spec_gets_the_first_token_then_the_rest_merged(
    servers, expected, pool: str | None
) -> None:
    """`delta_interval_s` (a batch line, a response that is not streamed): remotely or
    locally prefilled, the stream is the first token, then one delta with the rest."""
    prefill, decode, _ = servers

    async def run(spec: GenerationSpec) -> list[list[int]]:
        return [list(delta.new_token_ids) async for delta in decode.generate(spec)]

    spec = dataclasses.replace(spec_for(decode, 0, PROMPTS[1], pool), delta_interval_s=3600.0)
    deltas = asyncio.run(run(spec))
    assert [len(d) for d in deltas] == [1, len(expected[1]) - 1]
    assert [t for d in deltas for t in d] == expected[1]
    wait_all_free(prefill, decode)


def test_failed_prefill_retries_then_falls_back(servers, expected) -> None:
    prefill, decode, handle = servers
    handle.fail_times = 1
    assert asyncio.run(collect(decode, spec_for(decode, 0, PROMPTS[0]))) == expected[0]
    counters = decode.stats()["counters"]
    assert counters["prefill_failures"] == 1 and counters["remote_prefill"] == 1
    handle.calls, handle.fail_times = 0, 2
    assert asyncio.run(collect(decode, spec_for(decode, 1, PROMPTS[2]))) == expected[2]
    assert decode.stats()["counters"]["local_prefill_fallback"] == 1
    wait_all_free(prefill, decode)


def test_client_disconnect_frees_both_pools(servers) -> None:
    prefill, decode, _ = servers

    async def run() -> None:
        spec = GenerationSpec(
            request_id="gone",
            prompt_token_ids=tuple(decode.engine.tokenize(PROMPTS[0])),
            sampling_params=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
            prefill_pool="p",
        )
        stream = decode.generate(spec)
        async for delta in stream:
            if delta.num_output_tokens >= 3:
                break
        await stream.aclose()

    asyncio.run(run())
    wait_all_free(prefill, decode)


def test_unresponsive_prefill_pool_times_out_then_prefills_locally(model_dir, expected) -> None:
    config = EngineConfig(model_dir=str(model_dir))
    prefill = PrefillServer(config, backend="tcp")
    handle = InProcessHandle(prefill, hang=True)
    decode = DecodeServer(config, backend="tcp", prefill_pools={"p": handle}, deadline_s=0.5)
    try:
        start = time.monotonic()
        assert asyncio.run(collect(decode, spec_for(decode, 0, PROMPTS[0]))) == expected[0]
        assert time.monotonic() - start < 30
        stats = decode.stats()
        counters = stats["counters"]
        # A timeout that no replica is known to have taken is not retried blindly.
        assert counters["prefill_failures"] == 1 and counters["local_prefill_fallback"] == 1
        assert "prefill_retries" not in counters
        reasons = [d["reason"] for d in stats["prefill_decisions"]]
        assert reasons[-1].endswith("#0 timed out unrouted -> local prefill")
        wait_all_free(prefill, decode)
    finally:
        decode.shutdown()
        prefill.shutdown()


# ---- KV ownership: every cancellation point leaves nothing behind (shm and tcp) ---------


class GatedHandle(InProcessHandle):
    """Runs the real prefill; `after_prefill` is called once the result is in (while the
    decode side has not yet seen it)."""

    def __init__(self, server: PrefillServer) -> None:
        super().__init__(server)
        self.after_prefill: Callable[[], None] = lambda: None

    def remote(self, *args: object) -> asyncio.Future:
        if self.calls < self.fail_times:
            return super().remote(*args)
        self.calls += 1

        async def call() -> object:
            result = await self._server.prefill(*args)  # type: ignore[attr-defined]
            self.after_prefill()
            return result

        return asyncio.ensure_future(call())


@pytest.fixture(params=["shm", "tcp"])
def kv_servers(request: pytest.FixtureRequest, model_dir: Path):
    config = EngineConfig(model_dir=str(model_dir))
    options = TransferOptions(fence_timeout_s=2.0, reap_interval_s=0.02)
    prefill = PrefillServer(config, backend=request.param, transfer_options=options)
    handle = GatedHandle(prefill)
    decode = DecodeServer(
        config,
        backend=request.param,
        transfer_options=options,
        prefill_pools={"p": handle},
        deadline_s=10,
    )
    yield prefill, decode, handle
    decode.shutdown()
    prefill.shutdown()


class Gate:
    """Holds an engine thread inside a command until opened (a busy step, made long)."""

    def __init__(self, server: PrefillServer | DecodeServer) -> None:
        self._open = threading.Event()
        self._server = server

    def close(self) -> None:
        self._server.replica.loop.call(lambda: self._open.wait(30.0))

    def open(self) -> None:
        self._open.set()


def assert_nothing_held(prefill: PrefillServer, decode: DecodeServer) -> None:
    """Every block of both pools free, no reservation, transfer or stream left on decode."""

    def engine_clean(server: PrefillServer | DecodeServer) -> bool:
        def check() -> bool:
            kv = server.engine.kv_manager
            return kv.num_free_blocks == server.engine.kv_spec.num_blocks

        return server.replica.loop.call(check).result(timeout=10)

    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if engine_clean(prefill) and engine_clean(decode) and not decode._reservations:
            break
        time.sleep(0.05)
    assert engine_clean(prefill) and engine_clean(decode)
    assert decode._reservations == {}
    assert decode.loop._streams == {}
    assert decode.stats()["kv_transfers"] == {"num_open": 0, "num_fenced": 0, "num_quarantined": 0}


async def cancel_when(task: asyncio.Task, ready: Callable[[], bool]) -> None:
    """Cancel `task` as soon as `ready()` holds (polled on the event loop)."""
    deadline = time.monotonic() + 20.0
    while not ready():
        assert time.monotonic() < deadline, "cancellation point never reached"
        assert not task.done(), task
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_cancel_between_reserve_and_ticket(kv_servers) -> None:
    prefill, decode, handle = kv_servers
    spec = spec_for(decode, 0, PROMPTS[0])
    gate = Gate(decode)

    async def run() -> None:
        gate.close()  # the reservation waits on the engine thread
        task = asyncio.ensure_future(collect(decode, spec))
        await cancel_when(task, lambda: f"{spec.request_id}#0" in decode._reservations)
        gate.open()

    asyncio.run(run())
    assert handle.calls == 0
    assert_nothing_held(prefill, decode)


def test_cancel_during_the_prefill_call_mid_transfer(kv_servers) -> None:
    prefill, decode, handle = kv_servers
    spec = spec_for(decode, 0, PROMPTS[0])
    gate = Gate(prefill)
    tid = f"{spec.request_id}#0"

    def bound() -> bool:  # the prefill's sender connected: a writer owns the blocks
        return _known(decode, tid) and decode.receiver.poll(tid) is TransferState.TRANSFERRING

    async def run() -> None:
        gate.close()  # prefill connects, then its engine is busy
        task = asyncio.ensure_future(collect(decode, spec))
        await cancel_when(task, bound)
        gate.open()

    asyncio.run(run())
    assert decode.receiver.poll(tid) is TransferState.ABORTED
    assert_nothing_held(prefill, decode)


def test_cancel_while_start_is_queued(kv_servers) -> None:
    prefill, decode, handle = kv_servers
    spec = spec_for(decode, 0, PROMPTS[0])
    gate = Gate(decode)
    handle.after_prefill = gate.close  # the KV landed; decode's engine is busy

    async def run() -> None:
        task = asyncio.ensure_future(collect(decode, spec))
        await cancel_when(task, lambda: decode.replica.counters["remote_prefill"] == 1)
        gate.open()

    asyncio.run(run())
    # start and then the abort ran right away, before any step could decode a token
    known = decode.loop.call(lambda: list(decode.engine.scheduler.requests))
    assert known.result(timeout=10) == []
    assert decode.receiver.poll(f"{spec.request_id}#0") is TransferState.DONE
    assert_nothing_held(prefill, decode)


def test_kv_servers_retry_after_a_failed_attempt(kv_servers, expected) -> None:
    prefill, decode, handle = kv_servers
    handle.fail_times = 1
    tokens = asyncio.run(collect(decode, spec_for(decode, 0, PROMPTS[0])))
    assert tokens == expected[0]
    counters = decode.stats()["counters"]
    assert counters["prefill_failures"] == 1 and counters["remote_prefill"] == 1
    assert_nothing_held(prefill, decode)


def test_expired_leases_of_gone_owners_come_back(kv_servers) -> None:
    """The lease check is a backstop for an owner that vanished without cleaning up (no
    code path does that: the reservations are made by hand here). A transfer still open is
    aborted through the receiver; KV that landed but never started decoding is freed."""
    prefill, decode, _ = kv_servers
    pending, landed = (spec_for(decode, i, PROMPTS[0]) for i in range(2))

    async def reserve(spec: GenerationSpec) -> tuple[Reservation, Ticket]:
        reservation = Reservation(f"{spec.request_id}#0")
        assert decode.remote is not None
        ticket = await decode.remote.reserve(spec, reservation)
        assert ticket is not None
        return reservation, ticket

    async def run() -> tuple[Reservation, Ticket, Reservation, Ticket]:
        return (*await reserve(pending), *await reserve(landed))  # type: ignore[return-value]

    open_res, _, landed_res, landed_ticket = asyncio.run(run())
    kv = prefill.engine.kv_cache
    for layer in range(prefill.engine.kv_spec.num_layers):
        src = list(range(landed_ticket.num_blocks))
        prefill.sender.send_layer(
            landed_ticket, layer, kv.key_caches[layer], kv.value_caches[layer], src
        )
    prefill.sender.finish(landed_ticket)
    assert decode.receiver.wait(landed_res.transfer_id, 10.0) is TransferState.DONE
    assert decode.receiver.poll(open_res.transfer_id) is TransferState.PENDING
    for reservation in (open_res, landed_res):
        assert decode._reservations[reservation.transfer_id] is reservation
        reservation.owned, reservation.expires_at = False, 0.0
    assert_nothing_held(prefill, decode)
    assert decode.receiver.poll(open_res.transfer_id) is TransferState.ABORTED
    assert decode.receiver.poll(landed_res.transfer_id) is TransferState.DONE


def test_retry_does_not_wait_for_a_dead_attempts_fenced_blocks(kv_servers, expected) -> None:
    """Attempt 0's writer never confirms it stopped (its copy is stuck holding the write
    lock): its blocks stay fenced (shm: quarantined) while attempt 1 serves the request;
    they come back once the writer lets go."""
    prefill, decode, handle = kv_servers
    backend = decode.receiver.backend
    stuck = create_sender(
        backend,
        prefill.engine.kv_spec,
        model_id=prefill.replica.model_id,
        release=lambda rid: None,
        options=TransferOptions(),
    )
    holding, let_go = threading.Event(), threading.Event()

    def hold(lock: object) -> None:
        with lock:  # type: ignore[attr-defined]
            holding.set()
            let_go.wait(30.0)

    async def stuck_prefill(request: object, ticket: Ticket) -> None:
        await asyncio.to_thread(stuck.connect, ticket, 5.0)
        lock = stuck._table.require(ticket.request_id).write_lock  # type: ignore[attr-defined]
        threading.Thread(target=hold, args=(lock,), daemon=True).start()
        await asyncio.to_thread(holding.wait, 10.0)
        raise ConnectionError("prefill replica died mid-copy")

    real_remote = handle.remote

    def remote(*args: object) -> asyncio.Future:
        if handle.calls == 0:
            handle.calls += 1
            return asyncio.ensure_future(stuck_prefill(*args))  # type: ignore[arg-type]
        return real_remote(*args)

    handle.remote = remote  # type: ignore[method-assign]
    try:
        spec = spec_for(decode, 0, PROMPTS[0])
        assert asyncio.run(collect(decode, spec)) == expected[0]
        counters = decode.stats()["counters"]
        assert counters["prefill_failures"] == 1 and counters["remote_prefill"] == 1
        dead = f"{spec.request_id}#0"
        assert decode.receiver.poll(dead) is TransferState.ABORTED
        if backend == "shm":  # (tcp cuts the connection at the fence timeout, and frees)
            assert eventually(lambda: decode.stats()["kv_transfers"]["num_quarantined"] == 1)
            assert dead in decode._reservations  # not freed while its writer may still write
        let_go.set()
        assert_nothing_held(prefill, decode)
    finally:
        let_go.set()
        stuck.close()


def eventually(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _known(decode: DecodeServer, transfer_id: str) -> bool:
    assert decode.receiver is not None
    try:
        decode.receiver.poll(transfer_id)
    except UnknownTransferError:
        return False
    return True


class WarmHandle:
    """`handle.warm.remote(request)` of a pool whose one replica is `prefill` (or, with
    `prefill` None, of a pool whose calls fail)."""

    def __init__(self, prefill: PrefillServer | None) -> None:
        self._prefill = prefill
        self.probes: list[str | None] = []

    @property
    def warm(self) -> WarmHandle:
        return self

    def remote(self, request: WarmRequest) -> asyncio.Future:
        self.probes.append(request.probe_replica)
        prefill = self._prefill
        if prefill is None:

            async def dead() -> str:
                raise ConnectionError("no replica")

            return asyncio.ensure_future(dead())
        return asyncio.ensure_future(prefill.warm(request))


def test_the_warmer_connects_each_prefill_replica_once_before_any_request(servers) -> None:
    prefill, decode, _ = servers
    name, handle, seen = prefill.replica.name, WarmHandle(prefill), {}
    clock = [0.0]
    warmer = PrefillWarmer({"p": handle}, decode.receiver.endpoint, seen.get, lambda: clock[0])

    async def rounds() -> None:
        await warmer.tick()  # the router has seen no replica yet: the pool at large
        assert handle.probes == [None] and warmer.warmed == {("p", name)}
        assert decode.receiver.endpoint_stats()["connections"] == 1
        seen["p"] = [name]
        await warmer.tick()  # nothing new
        seen["p"] = [name, "prefill:p@elsewhere:1"]
        await warmer.tick()  # the call meant for the new replica came back from ours
        await warmer.tick()  # ... so it waits RETRY_AFTER_S
        assert handle.probes == [None, "prefill:p@elsewhere:1"]
        clock[0] += RETRY_AFTER_S
        await warmer.tick()
        assert handle.probes == [None, "prefill:p@elsewhere:1", "prefill:p@elsewhere:1"]

    asyncio.run(rounds())
    assert decode.receiver.endpoint_stats()["connections"] == 1  # the one kept open

    failing = WarmHandle(None)
    warmer = PrefillWarmer({"p": failing}, decode.receiver.endpoint, {}.get, lambda: clock[0])

    async def failed_rounds() -> None:
        await warmer.tick()
        await warmer.tick()  # a failure is not retried at once
        assert failing.probes == [None] and not warmer.warmed

    asyncio.run(failed_rounds())


def test_a_warmed_connection_serves_the_first_remote_prefill(servers, expected) -> None:
    prefill, decode, _ = servers
    warmer = PrefillWarmer({"p": WarmHandle(prefill)}, decode.receiver.endpoint, {}.get)

    async def run() -> tuple[set[object], list[int]]:
        await warmer.tick()
        connections = set(prefill.sender.connections)
        return connections, await collect(decode, spec_for(decode, 0, PROMPTS[0]))

    connections, tokens = asyncio.run(run())
    assert tokens == expected[0]
    assert len(connections) == 1 and set(prefill.sender.connections) == connections
