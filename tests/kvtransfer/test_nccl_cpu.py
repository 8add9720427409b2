"""The nccl backend's CPU-testable parts: selection, clear errors, library discovery."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from kvtransfer import BackendUnavailableError, create_receiver, create_sender, nccl_lib
from kvtransfer.nccl import require_cuda

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
    monkeypatch.setattr(nccl_lib, "candidates", lambda: [("/nope/libnccl.so.2", 0)])
    with pytest.raises(BackendUnavailableError, match="/nope/libnccl.so.2"):
        nccl_lib.load_nccl()
    nccl_lib.load_nccl.cache_clear()


def test_candidates_start_in_this_process_and_end_with_the_system_loader() -> None:
    candidates = nccl_lib.candidates()
    assert candidates[0] == ("libnccl.so.2", os.RTLD_NOLOAD)
    assert candidates[-1] == ("libnccl.so.2", ctypes.DEFAULT_MODE)
    assert all("nccl" in path for path, _ in candidates)


def test_unique_id_struct_is_128_bytes() -> None:
    assert ctypes.sizeof(nccl_lib.NcclUniqueId) == nccl_lib.UNIQUE_ID_BYTES == 128
