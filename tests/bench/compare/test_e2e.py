"""`pdserve bench compare` end to end, short: two real configs on the tiny model, one seed,
a two-point knee search of 8 requests per point, each pool pinned to cores of its own.

Proves the pipeline (deploy, isolated requests, knee search, drift, aggregates, plots, JSON,
`--resume` of a finished file); the figures themselves are not evidence (BENCHMARKS.md has
the full command). Resuming an interrupted search is `test_store.py`'s (no deployment)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.cli import main

# Four deployments on fresh Ray instances: ~2 min on an idle 2-core host, far longer on a
# loaded one, hence more than the suite's 600 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REQUESTS = 8


def test_compare_pipeline(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp.json"
    cores = sorted(os.sched_getaffinity(0))
    argv = ["bench", "compare", "--configs", "cpu-disagg,cpu-colocated", "--no-progress"]
    argv += ["--model", str(tiny_model_dir), "--seeds", "1", "--max-points", "2"]
    argv += ["--requests-per-point", str(REQUESTS), "--rate-start", "1", "--bootstrap", "50"]
    argv += ["--workload", "multi-tenant", "--short-input-len", "24", "--short-output-len", "6"]
    argv += ["--long-input-min", "200", "--long-input-max", "300", "--long-output-len", "4"]
    argv += ["--long-share", "0.25", "--isolated-repeats", "1", "--json", str(out)]
    argv += ["--replica-cores", ",".join(map(str, cores))]
    assert main(argv) == 0
    document = json.loads(out.read_text())

    assert set(document["runs"]) == {"cpu-disagg", "cpu-colocated"}
    assert "ratio" in document and len(document["ratio_ci"]) == 2
    assert set(document["ratios"]) == {"cpu-disagg"}
    assert document["slo"]["shared"] is None  # multi-tenant: one SLO per class
    assert set(document["slo"]["classes"]) == {"interactive", "batch"}
    assert document["replica_cores"] == cores
    for name, (run,) in document["runs"].items():
        pinned = [pool["cpu_affinity"] for pool in run["args"]["pools"]]
        assert all(affinity and set(affinity) <= set(cores) for affinity in pinned)
        assert run["points"][0]["rate"] == 1.0 and 1 <= len(run["points"]) <= 2
        assert set(run["isolated_before"]) == set(run["isolated_after"]) == {"interactive", "batch"}
        assert run["noisy"] == (run["drift"] is None or run["drift"] > 0.25)
        assert len(run["host_before"]["load_avg"]) == 3
        for point in run["points"]:
            assert point["num_requests"] == len(point["records"]) == REQUESTS
            classes = point["classes"]
            assert sum(c["n"] for c in classes.values()) == REQUESTS
            shares = [c["met"] / c["n"] for c in classes.values() if c["n"]]
            assert point["attainment"] == pytest.approx(min(shares))
            low, high = point["attainment_ci"]
            assert 0.0 <= low <= point["attainment"] <= high <= 1.0
            for record in point["records"]:
                assert record["success"], record["error"]
            # each part of the deployment is named by its role; every request passes the
            # proxy and the ingress
            pools = {pool["name"] for pool in run["args"]["pools"]}
            used = point["cpu"]["cpu_ms_per_request"]
            assert {"ingress", "proxy", "client", *pools} <= set(used), used
            assert used["ingress"] > 0 and used["proxy"] > 0, used
        pools = {pool["name"] for pool in run["args"]["pools"]}
        assert set(document["cpu_ms_per_request"][name]) >= {"ingress", "total", *pools}
        goodput = document["goodput"][name]
        assert goodput["per_run"] == [run["goodput"]["goodput"]]
    ratio = document["ratio"]
    if ratio is not None:  # None only if the baseline's goodput came out 0
        disagg = document["goodput"]["cpu-disagg"]["mean"]
        assert ratio == pytest.approx(disagg / document["goodput"]["cpu-colocated"]["mean"])
    # The configs took turns: every config's k-th point came before any (k+1)-th point.
    rounds: dict[int, list[float]] = {}
    for (run,) in document["runs"].values():
        for k, point in enumerate(run["points"]):
            rounds.setdefault(k, []).append(point["started_at"])
    for k in range(1, len(rounds)):
        assert max(rounds[k - 1]) < min(rounds[k])
    assert len(document["plots"]) == 5
    assert all(Path(p).stat().st_size > 1000 for p in document["plots"])

    # --resume keeps every run the file holds: nothing is deployed again, same figures.
    assert main([*argv, "--resume"]) == 0
    again = json.loads(out.read_text())
    assert again["runs"] == document["runs"] and again["complete"] is True
    assert again["goodput"] == document["goodput"]
    # ... and refuses a file written with other settings, naming them.
    with pytest.raises(SystemExit, match="requests_per_point"):
        main([*argv, "--resume", "--requests-per-point", str(REQUESTS + 1)])
