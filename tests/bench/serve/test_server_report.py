"""The server side of a bench report: cost over the run from rates, duration and tokens."""

from __future__ import annotations

import pytest

from bench.serve.server_report import server_side

SUMMARY = {
    "duration_s": 1800.0,
    "num_completed": 4,
    "num_input_tokens": 300_000,
    "num_output_tokens": 100_000,
}
STATS = {
    "ttft_breakdown": {"num_requests": 4},
    "cost": {"usd_per_hour": {"p": 2.0, "d": 6.0}, "pool_roles": {"p": "prefill", "d": "decode"}},
}


def test_cost_from_the_servers_prices() -> None:
    server = server_side(STATS, SUMMARY, None)
    cost = server["cost"]
    assert server["ttft_breakdown"] == {"num_requests": 4}
    assert cost["usd_total"] == pytest.approx(4.0)  # half an hour at $8/h
    assert cost["usd_per_request"] == pytest.approx(1.0)
    assert cost["usd_per_1m_tokens"] == pytest.approx(10.0)
    assert cost["usd_per_1m_prompt_tokens"] == pytest.approx(1.0 / 0.3)
    assert cost["usd_per_1m_generated_tokens"] == pytest.approx(30.0)


def test_fleet_price_overrides_and_other_servers() -> None:
    cost = server_side({"error": "HTTP 404"}, SUMMARY, 8.0)
    assert cost["ttft_breakdown"] == {"error": "HTTP 404"}
    assert cost["cost"]["usd_per_1m_tokens"] == pytest.approx(10.0)
    assert cost["cost"]["usd_per_1m_prompt_tokens"] is None  # no split without pool roles
    assert "error" in server_side({"error": "HTTP 404"}, SUMMARY, None)["cost"]
