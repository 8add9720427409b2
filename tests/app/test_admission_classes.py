"""SLO classes: which class a request runs in, and its priority reaching the decode pool."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.admission.classes import ClassResolver, requested_class
from app.config import AdmissionSettings, SLOClass, TenantConfig, load_config
from app.errors import BadRequestError, PermissionDeniedError
from app.frontend import Frontend
from engine.builtin import write_builtin_model
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from replica.protocol import GenerationSpec

# ---- resolution ---------------------------------------------------------------------------


def _resolver() -> ClassResolver:
    admission = AdmissionSettings(
        classes=[
            SLOClass(name="interactive", ttft_s=1, tpot_s=0.1, priority=0),
            SLOClass(name="batch", ttft_s=60, tpot_s=1, priority=10),
        ]
    )
    tenants = [
        TenantConfig(name="a", api_keys=["ka"], default_class="interactive"),
        TenantConfig(name="b", api_keys=["kb"], default_class="batch"),
        TenantConfig(name="c", api_keys=["kc"], priority=5),
    ]
    return ClassResolver(admission, tenants)


def test_class_defaults_lowering_and_refusals() -> None:
    resolver = _resolver()
    assert resolver.resolve("a", None).priority == 0
    assert resolver.resolve("a", "batch").name == "batch"
    assert resolver.resolve("c", None).priority == 5  # no class: the tenant's priority
    assert resolver.resolve("c", "batch").priority == 10
    with pytest.raises(PermissionDeniedError) as raised:
        resolver.resolve("b", "interactive")
    assert raised.value.code == "slo_class_not_allowed"
    with pytest.raises(BadRequestError) as unknown:
        resolver.resolve("a", "gold")
    assert unknown.value.code == "unknown_slo_class"


def test_requested_class_header_wins_and_body_is_checked() -> None:
    body = {"pdserve": {"slo_class": "batch"}}
    assert requested_class({"x-pdserve-slo-class": "x"}, body) == "x"
    assert requested_class({}, body) == "batch"
    assert requested_class({}, {}) is None
    with pytest.raises(BadRequestError, match="pdserve.slo_class"):
        requested_class({}, {"pdserve": {"slo_class": 3}})
    with pytest.raises(BadRequestError, match="must be an object"):
        requested_class({}, {"pdserve": "batch"})


# ---- the class's priority travels to decode ----------------------------------------------


class _RecordingDecodePool:
    """Stands in for a decode pool's handle: records each spec, answers one final delta."""

    def __init__(self) -> None:
        self.specs: list[GenerationSpec] = []
        self.generate = self

    def options(self, stream: bool) -> _RecordingDecodePool:
        return self

    def remote(self, spec: GenerationSpec) -> Any:
        self.specs.append(spec)
        return self._deltas(spec)

    async def _deltas(self, spec: GenerationSpec) -> AsyncIterator[RequestOutput]:
        yield RequestOutput(spec.request_id, [5], "x", [], True, "length", 3, 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


def test_class_priority_is_the_generation_priority(model_dir: Path) -> None:
    config = load_config(
        {
            "model": {"model": str(model_dir)},
            "pools": [
                {"name": "prefill", "role": "prefill"},
                {"name": "decode", "role": "decode"},
            ],
            "admission": {
                "classes": [
                    {"name": "interactive", "ttft_s": 1, "tpot_s": 0.1, "priority": 0},
                    {"name": "batch", "ttft_s": 60, "tpot_s": 1, "priority": 10},
                ]
            },
            "tenants": [
                {"name": "a", "api_keys": ["ka"], "default_class": "interactive", "priority": 3}
            ],
        }
    )
    pool = _RecordingDecodePool()
    front = Frontend(config, {"decode": pool})

    async def run(slo_class: str | None) -> None:
        ids = await front.tokenize_prompt("hello there")
        prepared = front.prepare(
            front.authenticate("ka"), ids, SamplingParams(max_tokens=1), 2, slo_class=slo_class
        )
        assert prepared.service_class.name == (slo_class or "interactive")
        async for _ in front.run(prepared):
            pass

    asyncio.run(run(None))
    asyncio.run(run("batch"))
    assert [spec.priority for spec in pool.specs] == [0, 0, 10, 10]  # n=2: both choices
