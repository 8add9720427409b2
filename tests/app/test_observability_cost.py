"""Unit cost: prices per pool, replica-hours integrated over time, $ per request and token."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.config import CostSettings, PDServeConfig
from app.observability.cost import CostMeter, fleet_cost, pool_rates, unit_cost


def _config(cost: dict[str, object]) -> PDServeConfig:
    return PDServeConfig.model_validate(
        {
            "pools": [
                {"name": "p", "role": "prefill", "num_replicas": 2, "num_gpus": 0},
                {"name": "d", "role": "decode", "num_replicas": 1, "num_gpus": 0},
            ],
            "observability": {"cost": cost},
        }
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_prices_per_replica_and_per_gpu() -> None:
    config = _config({"pools": {"p": {"usd_per_hour": 2.0}, "d": {"usd_per_hour": 3.0}}})
    pools = [pool.model_copy(update={"num_gpus": 4}) for pool in config.pools]
    cost = CostSettings.model_validate(
        {"pools": {"p": {"usd_per_hour": 2.0, "per": "gpu"}, "d": {"usd_per_hour": 3.0}}}
    )
    rates = pool_rates(cost, pools)
    assert rates["p"].usd_per_replica_hour == 8.0 and rates["p"].role == "prefill"
    assert rates["d"].usd_per_replica_hour == 3.0 and rates["d"].role == "decode"
    assert pool_rates(CostSettings(), pools)["d"].usd_per_replica_hour == 0.0


def test_unknown_pool_in_cost_is_rejected() -> None:
    with pytest.raises(ValidationError, match="unknown pool"):
        _config({"pools": {"nope": {"usd_per_hour": 1.0}}})


def test_unit_cost_math() -> None:
    out = unit_cost(2.0, 6.0, 4, 1_000_000, 500_000)
    assert out["usd_total"] == 8.0
    assert out["usd_per_request"] == 2.0
    assert out["usd_per_1m_tokens"] == pytest.approx(8.0 / 1.5)
    assert out["usd_per_1m_prompt_tokens"] == pytest.approx(2.0)
    assert out["usd_per_1m_generated_tokens"] == pytest.approx(12.0)
    colocated = unit_cost(0.0, 6.0, 0, 0, 0)
    assert colocated["usd_per_request"] is None and colocated["usd_per_1m_tokens"] is None
    assert colocated["usd_per_1m_prompt_tokens"] is None


def test_meter_integrates_replica_counts_over_time() -> None:
    config = _config({"pools": {"p": {"usd_per_hour": 2.0}, "d": {"usd_per_hour": 3.0}}})
    clock = FakeClock()
    meter = CostMeter(config.observability.cost, config.pools, clock)
    clock.now += 1800  # half an hour at the configured 2 + 1 replicas
    meter.observe_replicas({"p": 1, "d": 2})
    clock.now += 3600  # an hour at 1 + 2
    meter.add_usage(1000, 3000)
    report = meter.report()
    assert report["replica_hours"] == {"p": pytest.approx(2.0), "d": pytest.approx(2.5)}
    assert report["usd_per_hour"] == {"p": 2.0, "d": 6.0}
    assert report["usd_total"] == pytest.approx(2 * 2.0 + 2.5 * 3.0)
    assert report["usd_per_request"] == pytest.approx(11.5)
    assert report["usd_per_1m_prompt_tokens"] == pytest.approx(4.0 / 1000 * 1e6)
    assert report["usd_per_1m_generated_tokens"] == pytest.approx(7.5 / 3000 * 1e6)


def test_fleet_cost_splits_by_role() -> None:
    prefill, decode = fleet_cost({"p": 2.0, "d": 6.0}, {"p": "prefill", "d": "decode"}, 1800)
    assert (prefill, decode) == (pytest.approx(1.0), pytest.approx(3.0))
