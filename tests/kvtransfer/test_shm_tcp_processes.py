"""shm and tcp between two real OS processes: this one decodes, a spawned one prefills."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time

import numpy as np
import pytest
from kvt_peers import (
    FAST,
    Peer,
    Released,
    SendJob,
    assert_landed,
    eventually,
    layers_landed,
    make_receiver,
    random_ids,
    spec,
)

from kvtransfer import TransferState
from kvtransfer.shm import list_segments

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_layers", [1, 4])
def test_destination_blocks_equal_source_blocks(
    peer: Peer, backend: str, dtype: str, num_layers: int
) -> None:
    rng = np.random.default_rng(num_layers * 7 + len(dtype))
    released = Released()
    dst_spec, src_spec = spec(num_layers, 64, dtype), spec(num_layers, 48, dtype)
    with make_receiver(backend, dst_spec, released) as receiver:
        jobs, free = [], [int(b) for b in rng.permutation(64)]
        for i, n in enumerate((5, 17, 1)):  # three requests interleaved on one connection
            dst, free = tuple(free[:n]), free[n:]
            jobs.append((receiver.open_ticket(f"r{i}", dst, 20.0), random_ids(rng, 48, n)))
        result = peer.run(SendJob(backend, src_spec, tuple(jobs), seed=3, options=FAST))
        assert result["states"] == {t.request_id: "done" for t, _ in jobs}
        for ticket, src in jobs:
            assert receiver.wait(ticket.request_id, 5.0) is TransferState.DONE
            assert layers_landed(receiver, ticket.request_id) == num_layers
            assert_landed(receiver, src_spec, 3, ticket.block_ids, src)
        touched = {b for t, _ in jobs for b in t.block_ids}
        untouched = [b for b in range(64) if b not in touched]
        assert not receiver.kv_cache.flat[:, :, untouched].any()
        assert released.ids == []  # DONE keeps the destination blocks
        assert sorted(result["released"]) == ["r0", "r1", "r2"]  # sources freed once each


def test_checksums_pass_on_clean_data(peer: Peer, backend: str) -> None:
    released = Released()
    s = spec(2, 32, "bfloat16")
    with make_receiver(backend, s, released) as receiver:
        ticket = receiver.open_ticket("c", (3, 4, 5, 9), 20.0)
        options = dataclasses.replace(FAST, checksum=True)
        result = peer.run(SendJob(backend, s, ((ticket, (0, 1, 2, 3)),), seed=5, options=options))
        assert result["states"] == {"c": "done"}
        assert_landed(receiver, s, 5, ticket.block_ids, (0, 1, 2, 3))


def test_each_layer_lands_before_the_next_is_computed(peer: Peer, backend: str) -> None:
    """Streaming: the prefill holds after each layer it sends and goes on only once the
    receiver has it, so every layer lands while later layers are still to be computed
    (and before FINISH), whatever the machine's speed."""
    released = Released()
    s = spec(8, 256, block_size=16, num_kv_heads=4, head_dim=64)
    with make_receiver(backend, s, released) as receiver:
        dst = tuple(range(0, 200, 2))
        ticket = receiver.open_ticket("o", dst, 60.0)
        holds = frozenset(range(s.num_layers))
        peer.start(SendJob(backend, s, ((ticket, tuple(range(100))),), hold_after_layers=holds))
        for layer in range(s.num_layers):
            assert peer.held() == layer  # layer `layer` sent, the next one not computed
            assert eventually(lambda n=layer + 1: layers_landed(receiver, "o") == n, 20.0)
            assert receiver.poll("o") is TransferState.TRANSFERRING
            peer.go()
        assert receiver.wait("o", 20.0) is TransferState.DONE
        assert peer.result()["states"] == {"o": "done"}
        assert_landed(receiver, s, 0, dst, tuple(range(100)))


def test_segments_are_unlinked_on_close() -> None:
    before = set(list_segments())
    receiver = make_receiver("shm", spec(2), Released())
    segment = receiver.endpoint.removeprefix("shm://")
    assert segment in list_segments()
    receiver.close()
    receiver.close()
    assert set(list_segments()) <= before


def test_orphaned_segments_of_dead_owners_are_swept() -> None:
    ctx = mp.get_context("spawn")
    gone = ctx.Process(target=time.sleep, args=(0,))
    gone.start()
    gone.join(timeout=30)
    assert gone.pid is not None
    orphan = f"pdkv-{gone.pid}-deadbeef"
    with open(f"/dev/shm/{orphan}", "wb") as f:
        f.write(b"\0" * 4096)
    live = f"pdkv-{os.getpid()}-cafe0000"  # its owner (this process) is alive: kept
    with open(f"/dev/shm/{live}", "wb") as f:
        f.write(b"\0" * 4096)
    try:
        receiver = make_receiver("shm", spec(2), Released())
        receiver.close()
        assert orphan not in list_segments()
        assert live in list_segments()
    finally:
        for name in (orphan, live):
            if name in list_segments():
                os.unlink(f"/dev/shm/{name}")
