"""Row copies (`kvtransfer.rowcopy`): copy plans, the streaming-copy helper and its
trust checks, and the layer checksum of `kvtransfer.payload`."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer import rowcopy
from kvtransfer.payload import layer_crc
from kvtransfer.rowcopy import CopyPlan, block_rows, contiguous_runs, matched_runs


def copy_rows(src: np.ndarray, dst: np.ndarray, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """`dst[dst_ids] = src[src_ids]` for two `[rows, bytes]` matrices, with streaming stores."""
    rowcopy.copy_rows_many(
        [(src.ctypes.data, dst.ctypes.data)],
        src_ids,
        dst_ids,
        row_bytes=src.shape[1],
        src_num_rows=src.shape[0],
        dst_num_rows=dst.shape[0],
    )


@given(st.lists(st.integers(0, 40), max_size=30, unique=True))
def test_contiguous_runs_cover_ids_in_order(ids: list[int]) -> None:
    arr = np.asarray(ids, dtype=np.int64)
    runs = contiguous_runs(arr)
    rebuilt = [int(arr[i]) + j for i, k in runs for j in range(k)]
    assert rebuilt == ids
    for i, k in runs:  # maximal: the next id does not continue the run
        assert i + k == len(ids) or ids[i + k] != ids[i + k - 1] + 1


def test_matched_runs_need_both_sides_consecutive() -> None:
    src = np.array([3, 4, 5, 9, 10, 11], dtype=np.int64)
    dst = np.array([0, 1, 7, 8, 9, 10], dtype=np.int64)
    assert matched_runs(src, dst) == [(3, 0, 2), (5, 7, 1), (9, 8, 3)]


def layouts() -> st.SearchStrategy[tuple[list[int], list[int]]]:
    def pick(n: int) -> st.SearchStrategy[tuple[list[int], list[int]]]:
        ids = st.one_of(
            st.permutations(list(range(40))).map(lambda p: p[:n]),  # random
            st.integers(0, 40 - n).map(lambda s: list(range(s, s + n))),  # contiguous
        )
        return st.tuples(ids, ids)

    return st.integers(1, 24).flatmap(pick)


@given(layouts(), st.booleans(), st.sampled_from([4, 64, 3072]))
@settings(max_examples=80, deadline=None)
def test_copy_plan_copies_exactly_the_planned_rows(
    ids: tuple[list[int], list[int]], streaming: bool, row_bytes: int
) -> None:
    src_ids, dst_ids = ids
    rng = np.random.default_rng(len(src_ids))
    src = rng.integers(0, 255, size=(40, row_bytes), dtype=np.uint8)
    dst = np.zeros((40, row_bytes), dtype=np.uint8)
    plan = CopyPlan.build(src_ids, dst_ids, row_bytes)
    if streaming and rowcopy.available():  # the path shm takes for large transfers
        copy_rows(src, dst, plan.src_ids, plan.dst_ids)
    else:
        plan.copy(src, dst)
    assert np.array_equal(dst[dst_ids], src[src_ids])
    others = [b for b in range(40) if b not in dst_ids]
    assert not dst[others].any()


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "kind"),
    [
        (list(range(8)), list(range(10, 18)), "slices"),
        (list(range(8)), [9, 2, 30, 4, 17, 11, 0, 25], "scatter"),
        ([9, 2, 30, 4, 17, 11, 0, 25], list(range(8)), "gather"),
        ([9, 2, 30, 4, 17, 11, 0, 25], [1, 5, 3, 28, 7, 13, 21, 19], "staged"),
    ],
)
def test_plan_kind_follows_the_id_structure(
    src_ids: list[int], dst_ids: list[int], kind: str
) -> None:
    assert CopyPlan.build(src_ids, dst_ids, 64).kind == kind


def test_block_rows_are_byte_views_of_any_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(6, 4, 2, 8).to(dtype)
        rows = block_rows(cache)
        assert rows.shape == (6, 4 * 2 * 8 * cache.element_size())
        rows[2] = 0
        assert not cache[2].any()  # a view, not a copy
    with pytest.raises(ValueError):
        block_rows(torch.randn(6, 4, 2, 8).transpose(0, 1))


def test_layer_crc_equals_crc_of_the_packed_payload() -> None:
    k, v = torch.randn(20, 4, 2, 8), torch.randn(20, 4, 2, 8)
    ids = np.array([5, 6, 7, 1, 12, 13], dtype=np.int64)
    packed = torch.stack([k[ids], v[ids]]).contiguous()
    assert layer_crc(block_rows(k), block_rows(v), ids) == zlib.crc32(packed.numpy().data)


def test_streaming_copy_checks_bounds() -> None:
    if not rowcopy.available():
        pytest.skip("no C compiler for the streaming-copy helper")
    src, dst = np.ones((4, 64), np.uint8), np.zeros((4, 64), np.uint8)
    with pytest.raises(IndexError):
        copy_rows(src, dst, np.array([0], np.int64), np.array([4], np.int64))
    with pytest.raises(ValueError):
        copy_rows(src, dst, np.array([0, 1], np.int64), np.array([0], np.int64))
    copy_rows(src, dst, np.array([3, 0], np.int64), np.array([1, 2], np.int64))
    assert dst[[1, 2]].all() and not dst[[0, 3]].any()


# -- the compiled copy helper (its build and checks: tests/kernels/test_native.py) --------


def test_ntcopy_is_built_as_a_kernel() -> None:
    if not rowcopy.available():
        pytest.skip("no C compiler: the helper is never built")
    src = np.arange(4 * 4160, dtype=np.int64).astype(np.uint8).reshape(4, 4160)  # > a page
    dst = np.zeros_like(src)
    src_ids, dst_ids = np.array([3, 0], np.int64), np.array([1, 2], np.int64)
    pairs = [(src.ctypes.data, dst.ctypes.data)]
    rowcopy.copy_rows_many(pairs, src_ids, dst_ids, row_bytes=4160, src_num_rows=4, dst_num_rows=4)
    assert np.array_equal(dst[1], src[3]) and np.array_equal(dst[2], src[0])
    assert not dst[[0, 3]].any()
