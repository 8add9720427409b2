"""Fixtures of the routing tests: this process's prefix indexes, fresh for each test."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from app.routing import prefix_index
from replica.prefix_digest import KEY_BYTES, prompt_block_keys


class Caches:
    """The prefix indexes the ingress's replica routers keep (`prefix_index.shared`), as
    replicas' digests fill them."""

    def __init__(self, indexes: prefix_index.PerPool[prefix_index.PrefixIndex]) -> None:
        self.indexes = indexes

    def hold(self, pool: str, prompt: Sequence[int], tenant: str) -> None:
        """The pool's router saw its replica report `prompt`'s blocks for `tenant` (an empty
        prompt: it holds nothing)."""
        keys = prompt_block_keys(prompt, 16, tenant)
        blob = b"".join(k.to_bytes(KEY_BYTES, "little") for k in keys)
        self.indexes.pool(pool).update(f"{pool}-0", {"prefix_digest": blob, "block_size": 16})


@pytest.fixture
def caches(monkeypatch: pytest.MonkeyPatch) -> Caches:
    """This process's prefix indexes, fresh for the test (the replica routers' view)."""
    fresh = prefix_index.PerPool(prefix_index.PrefixIndex)
    monkeypatch.setattr(prefix_index, "shared", fresh)
    return Caches(fresh)
