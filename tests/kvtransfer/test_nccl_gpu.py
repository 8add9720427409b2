"""NCCL on real GPUs (skipped without CUDA). Run by scripts/gpu_check.sh.

NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected"), so
on a one-GPU machine the binding is checked with a one-rank communicator sending to itself
(grouped send + recv) and the backend's two-process test needs two devices.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch
from kvt_peers import SendJob, serve, source_cache

from engine.kv_cache import KVCacheSpec
from kvtransfer import TransferOptions, TransferState, create_receiver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_nccl_binding_grouped_self_send_recv() -> None:
    from kvtransfer.nccl_lib import load_nccl

    lib = load_nccl()
    assert lib.version() >= 21800
    comm = lib.comm_init_rank(1, lib.unique_id(), 0)
    src = torch.randn(3 << 20, device="cuda")
    dst = torch.zeros_like(src)
    stream = torch.cuda.current_stream().cuda_stream
    nbytes = src.numel() * src.element_size()
    with lib.group():
        lib.send(src.data_ptr(), nbytes, 0, comm, stream)
        lib.recv(dst.data_ptr(), nbytes, 0, comm, stream)
    torch.cuda.synchronize()
    assert torch.equal(src, dst)
    lib.comm_abort(comm)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl_backend_between_two_processes() -> None:
    spec = KVCacheSpec(4, 128, 16, 4, 64, "bfloat16")
    released: list[str] = []
    receiver = create_receiver(
        "nccl",
        spec,
        model_id="m",
        release=released.append,
        device="cuda:0",
        options=TransferOptions(checksum=True),
    )
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=serve, args=(child,), daemon=True)
    process.start()
    try:
        rng = np.random.default_rng(0)
        dst = tuple(int(b) for b in rng.choice(128, 40, replace=False))
        src = tuple(int(b) for b in rng.choice(128, 40, replace=False))
        ticket = receiver.open_ticket("n", dst, 120.0)
        job = SendJob(
            "nccl",
            spec,
            ((ticket, src),),
            seed=4,
            device="cuda:1",
            wait_s=60.0,
            options=TransferOptions(checksum=True),
        )
        conn.send(job)
        assert conn.poll(240)
        result = conn.recv()
        assert result.get("states") == {"n": "done"}, result
        assert receiver.wait("n", 30.0) is TransferState.DONE
        source = source_cache(spec, 4)
        cache = receiver.kv_cache
        for layer in range(spec.num_layers):
            got = cache.key_caches[layer][list(dst)].cpu()
            assert torch.equal(got, source.key_caches[layer][list(src)])
    finally:
        conn.send(None)
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
        receiver.close()
