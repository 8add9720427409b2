"""The nccl backend's CPU-testable parts: selection, clear errors, communicator cache."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from kvtransfer import BackendUnavailableError, create_receiver, create_sender, nccl_lib
from kvtransfer.nccl import CommunicatorCache, require_cuda

SPEC = KVCacheSpec(2, 8, 4, 2, 8, "float32")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_selectable_without_cuda_and_fails_clearly() -> None:
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        create_receiver("nccl", SPEC, model_id="m", release=lambda r: None)
    with pytest.raises(BackendUnavailableError, match="shm or tcp"):
        create_sender("nccl", SPEC, model_id="m", release=lambda r: None)
    with pytest.raises(BackendUnavailableError):
        require_cuda(torch.device("cpu"))


def test_missing_library_names_every_place_searched(monkeypatch: pytest.MonkeyPatch) -> None:
    nccl_lib.load_nccl.cache_clear()
    monkeypatch.setattr(nccl_lib, "candidate_paths", lambda: iter(["/nope/libnccl.so.2"]))
    with pytest.raises(BackendUnavailableError, match="/nope/libnccl.so.2"):
        nccl_lib.load_nccl()
    nccl_lib.load_nccl.cache_clear()


def test_candidate_paths_end_with_the_system_loader() -> None:
    paths = list(nccl_lib.candidate_paths())
    assert paths[-1] == "libnccl.so.2"
    assert all("nccl" in p for p in paths)


def test_unique_id_struct_is_128_bytes() -> None:
    import ctypes

    assert ctypes.sizeof(nccl_lib.NcclUniqueId) == nccl_lib.UNIQUE_ID_BYTES == 128


def test_communicator_cache_creates_once_per_peer_even_under_races() -> None:
    cache: CommunicatorCache[int] = CommunicatorCache()
    calls: list[str] = []
    lock = threading.Lock()

    def create(key: str) -> int:
        with lock:
            calls.append(key)
        time.sleep(0.02)  # a slow ncclCommInitRank
        return len(key)

    barrier = threading.Barrier(8)

    def user(key: str) -> None:
        barrier.wait()
        assert cache.get_or_create(key, lambda: create(key)) == len(key)

    threads = [threading.Thread(target=user, args=(k,)) for k in ["ab", "cde"] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == ["ab", "cde"]
    assert sorted(cache.keys()) == ["ab", "cde"]
    assert cache.pop("ab") == 2 and cache.pop("ab") is None
    assert cache.get_or_create("ab", lambda: 7) == 7  # recreated after the peer went away
