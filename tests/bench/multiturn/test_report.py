"""The figures of a multi-turn run (`bench/multiturn/report.py`) from turn records, and the
usage fields the client reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.multiturn.client import TurnRecord, usage_figures
from bench.multiturn.report import (
    aggregate,
    conversation_shares,
    hit_rate,
    plot_ttft,
    route_kind,
)


def turn(
    conversation: int,
    index: int,
    prompt: int,
    cached: int | None,
    moved: int | None = None,
    ttft: float = 0.1,
    text: str = "ok",
) -> TurnRecord:
    record = TurnRecord(conversation, index, prompt, expected="ok", text=text)
    record.start_s, record.first_token_s, record.end_s = 0.0, ttft, ttft + 0.4
    record.chunk_times_s = [ttft, ttft + 0.4]
    record.output_tokens = 5
    record.cached_tokens, record.transferred_tokens = cached, moved
    return record


def test_later_turns_figures_hit_rate_and_wrong_answers() -> None:
    records = [
        turn(0, 0, 100, 0, 100, ttft=0.5),
        turn(0, 1, 200, 96, 100, ttft=0.1),  # hit: 96 = the previous prompt's full blocks
        turn(0, 2, 300, 80, 200, ttft=0.2, text="not ok"),  # a miss, and a wrong answer
        turn(1, 0, 100, 0, 100, ttft=0.6),
        turn(1, 1, 200, 192, 8, ttft=0.3),
    ]
    report = aggregate(records, block_size=16)
    later_prompt = 200 + 300 + 200
    assert report["computed_fraction_later_turns"] == pytest.approx(
        round((104 + 220 + 8) / later_prompt, 4)
    )
    assert report["transferred_fraction_later_turns"] == pytest.approx(round(308 / later_prompt, 4))
    assert report["ttft_p50_ms_later_turns"] == pytest.approx(200.0)
    assert report["hit_rate"] == pytest.approx(2 / 3, abs=1e-4)
    assert report["wrong"] == 1 and report["failed"] == 0
    assert [row["turn"] for row in report["turns"]] == [1, 2, 3]
    assert report["turns"][0]["computed_fraction"] == 1.0
    assert report["turns"][0]["ttft_p50_ms"] == pytest.approx(550.0)
    assert report["turns"][2]["tpot_p50_ms"] == pytest.approx(100.0)


def test_figures_the_server_does_not_report_stay_unknown() -> None:
    records = [turn(0, 0, 100, 0), turn(0, 1, 200, 96)]  # no kv_transferred_tokens
    report = aggregate(records, block_size=16)
    assert report["transferred_fraction_later_turns"] is None
    failed = turn(0, 2, 300, None)
    failed.error = "HTTP 503: overloaded"
    report = aggregate([*records, failed], block_size=16)
    assert report["failed"] == 1 and report["wrong"] == 0
    assert report["errors"] == ["HTTP 503: overloaded"]
    assert hit_rate([failed], 16) is None


def test_usage_fields() -> None:
    details = {"cached_tokens": 96, "kv_transferred_tokens": 40}
    assert usage_figures({"prompt_tokens_details": details}) == (96, 40)
    assert usage_figures({"kv_transferred_tokens": 7}) == (None, 7)
    assert usage_figures({}) == (None, None)


def test_the_plot_is_written(tmp_path: Path) -> None:
    report = aggregate([turn(0, 0, 100, 0), turn(0, 1, 200, 96)], block_size=16)
    path = tmp_path / "ttft.png"
    plot_ttft({"a": report, "b": report}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_route_kinds_and_conversation_shares() -> None:
    assert route_kind(None) == "-"
    assert (
        route_kind("len 513 < local_prefill_threshold 4097 -> local prefill on decode") == "local"
    )
    assert (
        route_kind(
            "adaptive: ... -> remote prefill; decode overflow: ... -> served whole on prefill"
        )
        == "whole"
    )
    assert (
        route_kind("len 705 in [1, inf] -> pool prefill, decode pool decode; admitted") == "remote"
    )
    routing = {
        "decode": {"replicas": {"a": {"conversations": 6}, "b": {"conversations": 4}}},
        "prefill": {"replicas": {}},
    }
    assert conversation_shares(routing) == {"decode": 0.6}
