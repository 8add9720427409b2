"""The cuda_ipc backend: selection and config on any machine; on a GPU, a real transfer between
two processes sharing one device (NCCL cannot put two ranks on one GPU; CUDA IPC can).

The GPU tests run the receiver here and the sender in the session's spawned prefill process
(`kvt_peers.serve`), as the other multi-process tests do. Run by scripts/gpu_check.sh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from kvt_peers import (
    FAST,
    Peer,
    Released,
    SendJob,
    eventually,
    layers_landed,
    random_ids,
    source_cache,
)
from pydantic import ValidationError

from app.config import PDServeConfig
from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer import (
    BACKENDS,
    BackendUnavailableError,
    Receiver,
    TransferOptions,
    TransferState,
    create_receiver,
    create_sender,
)

SPEC = KVCacheSpec(4, 128, 16, 4, 64, "bfloat16")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# -- any machine ----------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_selectable_without_cuda_and_fails_clearly() -> None:
    assert "cuda_ipc" in BACKENDS
    message = "the cuda_ipc backend needs a CUDA device .* use shm or tcp on CPU"
    with pytest.raises(BackendUnavailableError, match=message):
        create_receiver("cuda_ipc", SPEC, model_id="m", release=lambda r: None)
    with pytest.raises(BackendUnavailableError, match=message):
        create_receiver(
            "cuda_ipc", SPEC, KVCache.allocate(SPEC), model_id="m", release=lambda r: None
        )
    with pytest.raises(BackendUnavailableError, match=message):
        create_sender("cuda_ipc", SPEC, model_id="m", release=lambda r: None)


def _config(device: str, backend: str) -> dict[str, Any]:
    return {
        "pools": [
            {"name": "prefill", "role": "prefill", "num_gpus": 1 if device == "cuda" else 0},
            {"name": "decode", "role": "decode", "num_gpus": 1 if device == "cuda" else 0},
        ],
        "local_prefill_threshold": 32,
        "model": {"device": device},
        "transfer": {"backend": backend},
    }


def test_config_accepts_cuda_ipc_on_cuda() -> None:
    config = PDServeConfig.model_validate(_config("cuda", "cuda_ipc"))
    assert config.transfer.backend == "cuda_ipc"


@pytest.mark.parametrize(
    ("device", "backend", "message"),
    [
        ("cpu", "cuda_ipc", "transfer.backend 'cuda_ipc' requires model.device 'cuda'"),
        ("cpu", "nccl", "transfer.backend 'nccl' requires model.device 'cuda'"),
        ("cuda", "cuda-ipc", "'shm', 'tcp', 'nccl' or 'cuda_ipc'"),
    ],
)
def test_config_refuses(device: str, backend: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PDServeConfig.model_validate(_config(device, backend))


# -- one GPU, two processes -------------------------------------------------------------------


def _receiver(released: Released, checksum: bool = False) -> Receiver:
    options = dataclasses.replace(FAST, checksum=checksum)
    return create_receiver(
        "cuda_ipc", SPEC, model_id="test-model", release=released, device="cuda:0", options=options
    )


def _blocks(receiver: Receiver, dst: tuple[int, ...]) -> torch.Tensor:
    """The destination blocks of every layer, K then V, copied to the host."""
    cache = receiver.kv_cache
    return torch.stack(
        [torch.stack((cache.key_caches[i][list(dst)], cache.value_caches[i][list(dst)])).cpu()
         for i in range(SPEC.num_layers)]
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.timeout(300)
@needs_cuda
@pytest.mark.parametrize("ids", ["random", "contiguous"])  # gather/scatter; one copy per run
def test_transfer_between_two_processes_on_one_gpu(peer: Peer, ids: str) -> None:
    rng = np.random.default_rng(7)
    if ids == "random":
        dst, src = random_ids(rng, SPEC.num_blocks, 40), random_ids(rng, SPEC.num_blocks, 40)
    else:
        dst, src = tuple(range(10, 50)), tuple(range(70, 110))
    released = Released()
    with _receiver(released, checksum=True) as receiver:
        ticket = receiver.open_ticket(f"ipc-{ids}", dst, 120.0)
        options = TransferOptions(checksum=True)
        job = SendJob("cuda_ipc", SPEC, ((ticket, src),), seed=3, device="cuda:0", options=options)
        peer.start(job)
        result = peer.result(240.0)
        assert result["states"] == {ticket.request_id: "done"}, result
        assert result["released"] == [ticket.request_id]  # the sender's blocks went back
        assert receiver.wait(ticket.request_id, 30.0) is TransferState.DONE
        source = source_cache(SPEC, 3)
        expected = torch.stack(
            [torch.stack((source.key_caches[i][list(src)], source.value_caches[i][list(src)]))
             for i in range(SPEC.num_layers)]
        )  # fmt: skip
        assert torch.equal(_blocks(receiver, dst), expected)
        assert released.ids == []  # DONE blocks belong to the decode request


@pytest.mark.gpu
@pytest.mark.timeout(300)
@needs_cuda
def test_abort_mid_transfer_leaves_the_blocks_untouched_afterwards(peer: Peer) -> None:
    spec_layers = SPEC.num_layers
    dst, src = tuple(range(0, 128, 3))[:40], tuple(range(40))
    released = Released()
    with _receiver(released) as receiver:
        ticket = receiver.open_ticket("ipc-abort", dst, 120.0)
        job = SendJob(
            "cuda_ipc", SPEC, ((ticket, src),), seed=5, device="cuda:0", layer_delay_s=1.0
        )
        peer.start(job)
        assert eventually(lambda: layers_landed(receiver, "ipc-abort") >= 1, 120.0)
        receiver.abort("ipc-abort")
        assert released.wait_for("ipc-abort", 30.0)  # the sender acknowledged: no copy left
        landed = _blocks(receiver, dst)
        result = peer.result(240.0)  # the sender went on calling send_layer for every layer
        assert result["states"] == {"ipc-abort": "aborted"}, result
        assert result["released"] == ["ipc-abort"]
        assert torch.equal(_blocks(receiver, dst), landed)
        assert landed[0].any() and not landed[spec_layers - 1].any()  # 1 s between layers
