"""The Grafana dashboard (`docs/grafana/pdserve.json`) draws only metrics pdserve exports.

Every panel's PromQL is parsed for metric names (label matchers, ranges, grouping clauses,
strings and function calls removed); each must be a series of `app/observability/metrics.py`'s
registry. `test_serve_prometheus.py` checks the same names against a real scrape.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from app.observability.metrics import METRICS, NAMESPACE, exported_series

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pdserve.json"
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "inf", "nan"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# Whole identifiers not followed by "(" (a function) and not inside a number (1e9).
_IDENTIFIER = re.compile(r"(?<![\w.$:])[A-Za-z_:][A-Za-z0-9_:]*(?![\w:]|\s*\()")


def load_dashboard() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return result


def metric_names(promql: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    stripped = _STRING.sub(" ", promql)
    stripped = _MATCHERS.sub(" ", stripped)
    stripped = _RANGE.sub(" ", stripped)
    stripped = _GROUPING.sub(" ", stripped)
    return {name for name in _IDENTIFIER.findall(stripped) if name not in _KEYWORDS}


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and templating query."""
    dashboard = load_dashboard()
    found = [
        (f"panel {panel['title']!r} target {target['refId']}", target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["definition"])
            assert inner is not None, variable["definition"]
            found.append((f"variable {variable['name']!r}", inner.group(1)))
    return found


def dashboard_metric_names() -> set[str]:
    """Every metric name the dashboard reads."""
    return {name for _, expr in dashboard_expressions() for name in metric_names(expr)}


def test_the_parser_finds_metric_names() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, tenant) (rate(ray_pdserve_ttft_seconds_bucket"
        '{tenant=~"$tenant",status="200"}[$__rate_interval]))) / 1e9 + on (pool) '
        "sum(ray_pdserve_kv_blocks_free) and ignoring (x) bogus_metric offset 5m"
    )
    assert metric_names(expr) == {
        "ray_pdserve_ttft_seconds_bucket",
        "ray_pdserve_kv_blocks_free",
        "bogus_metric",
    }


def test_every_panel_queries_exported_metrics() -> None:
    exported = exported_series()
    expressions = dashboard_expressions()
    assert expressions
    for where, expr in expressions:
        names = metric_names(expr)
        assert names, f"{where} reads no metric: {expr}"
        unknown = names - exported
        assert not unknown, f"{where} reads metrics pdserve does not export: {sorted(unknown)}"


def test_the_dashboard_covers_the_operating_questions() -> None:
    """Latency percentiles by pool and tenant, goodput, KV occupancy, transfer rate,
    shedding and unit cost each have a panel."""
    names = dashboard_metric_names()
    for needed in (
        "ray_pdserve_ttft_seconds_bucket",
        "ray_pdserve_itl_seconds_bucket",
        "ray_pdserve_good_requests_total",
        "ray_pdserve_kv_blocks_used",
        "ray_pdserve_kv_transfer_bytes_total",
        "ray_pdserve_shed_requests_total",
        "ray_pdserve_replica_cost_per_hour",
    ):
        assert needed in names, f"no panel reads {needed}"
    exprs = " ".join(expr for _, expr in dashboard_expressions())
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le, prefill_pool, tenant)" in exprs


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"


def test_metric_definitions_are_prefixed_and_bounded() -> None:
    """Names start with pdserve_ (Ray adds its namespace); no label can hold a request id."""
    names = [spec.name for spec in METRICS]
    assert len(names) == len(set(names))
    for spec in METRICS:
        assert spec.name.startswith("pdserve_"), spec.name
        assert spec.exported_name.startswith(f"{NAMESPACE}_pdserve_")
        assert not {"request_id", "trace_id", "id"} & set(spec.labels), spec.name
        assert bool(spec.buckets) == (spec.kind == "histogram"), spec.name
        assert list(spec.buckets) == sorted(set(spec.buckets)), spec.name
