"""A real Prometheus scrapes pdserve's metrics from Ray's metrics endpoint.

Ray starts with a fixed metrics export port; a `prometheus` process (installed from the OS
packages when absent) scrapes it every second. Requests go through the official `openai`
client, and Prometheus' query API must then report exactly what the client saw: a TTFT
sample per request and the `usage` token counts, per tenant; plus the replicas' gauges
(KV blocks, configured cost) and transfer counters, and every metric the dashboard
(`docs/grafana/pdserve.json`) draws that this traffic produces.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from app.observability.metrics import BY_NAME
from tests.app.test_grafana_dashboard import dashboard_metric_names

if TYPE_CHECKING:  # conftest is pytest's to import; its types are only needed for hints
    from tests.app.conftest import Server

pytestmark = pytest.mark.slow

ACME = "sk-acme-prom-0001"
GLOBEX = "sk-globex-prom-0001"
ADMIN = "sk-admin-prom-0001"
PRICES = {"prefill": 2.5, "decode": 4.0}  # $ per replica-hour
INSTALL_TIMEOUT_S = 900.0
PROMETHEUS_READY_TIMEOUT_S = 60.0
SCRAPE_TIMEOUT_S = 90.0  # Ray's export interval (1 s here) + scrape interval + slack
STARTUP_TIMEOUT_S = 180.0
# Counters and histograms appear only once something is recorded; these only on failures,
# refusals or memory pressure, which this module's traffic does not cause.
ONLY_ON_TROUBLE = frozenset(
    {
        "pdserve_shed_requests",
        "pdserve_retries",
        "pdserve_fallbacks",
        "pdserve_preemptions",
        "pdserve_kv_transfer_failures",
        "pdserve_good_requests",  # depends on the machine's speed against the targets
    }
)


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"model": str(model_dir), "num_threads": 1, "kv_cache_bytes": 16 * 1024**2},
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.5},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm"},
        "local_prefill_threshold": 0,
        "tenants": [
            {"name": "acme", "api_keys": [ACME]},
            {"name": "globex", "api_keys": [GLOBEX]},
        ],
        "admin_api_keys": [ADMIN],
        "observability": {
            "cost": {"pools": {name: {"usd_per_hour": usd} for name, usd in PRICES.items()}},
            "metrics": {"publish_interval_s": 0.5},
        },
    }


def _free_port() -> int:
    from tests.app.conftest import free_port

    return free_port()


def _prometheus_binary() -> str:
    """The `prometheus` executable, installed from the OS packages when absent."""
    found = shutil.which("prometheus")
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("prometheus is not installed and apt-get as root is not available here")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = "apt-get update && apt-get install -y --no-install-recommends prometheus"
    try:
        done = subprocess.run(
            ["bash", "-c", command],
            env=env,
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"installing prometheus took over {INSTALL_TIMEOUT_S:.0f} s")
    found = shutil.which("prometheus")
    if done.returncode != 0 or not found:
        pytest.skip(f"could not install prometheus (exit {done.returncode}): {done.stderr[-500:]}")
    return found


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return _free_port()


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, model_dir: Path, metrics_port: int) -> Iterator[Server]:
    """conftest's `server`, on a Ray instance exporting metrics on `metrics_port` every 1 s."""
    import ray
    from ray import serve

    from app.main import build_app
    from bench.serve.deploy import start_serve
    from tests.app.conftest import Server, wait_until

    args = pdserve_args(model_dir)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        port = start_serve()
        serve.run(build_app(args), name="pdserve", route_prefix="/")
        base_url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base_url, timeout=120) as http:
            wait_until(lambda: _answers(http, "/health"), STARTUP_TIMEOUT_S, "GET /health")
            yield Server(base_url=base_url, http=http, args=args)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def prometheus(metrics_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus server scraping Ray's metrics endpoint every second; its base URL."""
    binary = _prometheus_binary()
    root = tmp_path_factory.mktemp("prometheus")
    config = root / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: ray\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{metrics_port}']\n"
    )
    port = _free_port()
    log = (root / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + PROMETHEUS_READY_TIMEOUT_S
        while not _answers(httpx.Client(base_url=base_url, timeout=5), "/-/ready"):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not start: {(root / 'prometheus.log').read_text()}")
            time.sleep(0.2)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


def _answers(http: httpx.Client, path: str) -> bool:
    try:
        return http.get(path).status_code == 200
    except httpx.HTTPError:
        return False


def query(prometheus: str, promql: str) -> float | None:
    """The instant value of a PromQL expression yielding one sample; None: no sample."""
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=10)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    result = body["data"]["result"]
    if not result:
        return None
    assert len(result) == 1, f"{promql} gave {len(result)} series"
    return float(result[0]["value"][1])


def wait_for_value(prometheus: str, promql: str, expected: float) -> None:
    """Poll until `promql` equals `expected` (scrapes lag the requests); fail past the
    deadline with the last value seen."""
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    value = query(prometheus, promql)
    while value is None or abs(value - expected) > 1e-9:
        if time.monotonic() > deadline:
            pytest.fail(f"{promql} = {value} after {SCRAPE_TIMEOUT_S:.0f} s, expected {expected}")
        time.sleep(0.5)
        value = query(prometheus, promql)


def scraped_names(prometheus: str) -> set[str]:
    response = httpx.get(f"{prometheus}/api/v1/label/__name__/values", timeout=10)
    response.raise_for_status()
    return set(response.json()["data"])


def test_prometheus_sees_what_the_clients_saw(server: Server, prometheus: str) -> None:
    usage: dict[str, dict[str, int]] = {}
    requests = {"acme": (ACME, ["hello there", "a somewhat longer prompt", "x"]),
                "globex": (GLOBEX, ["the globex prompt", "bye"])}  # fmt: skip
    for tenant, (key, prompts) in requests.items():
        client = server.openai(api_key=key)
        totals = usage.setdefault(tenant, {"requests": 0, "prompt": 0, "completion": 0})
        for i, prompt in enumerate(prompts):
            if i == 0:  # one streamed request per tenant: usage from the last chunk
                stream = client.completions.create(
                    model="pdserve-tiny",
                    prompt=prompt,
                    max_tokens=6,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = list(stream)
                assert chunks[-1].usage is not None
                got = chunks[-1].usage
            else:
                completion = client.completions.create(
                    model="pdserve-tiny", prompt=prompt, max_tokens=4 + i, temperature=0
                )
                assert completion.usage is not None
                got = completion.usage
            assert got.completion_tokens > 0
            totals["requests"] += 1
            totals["prompt"] += got.prompt_tokens
            totals["completion"] += got.completion_tokens

    for tenant, totals in usage.items():
        match = f'tenant="{tenant}"'
        wait_for_value(
            prometheus, f"sum(ray_pdserve_ttft_seconds_count{{{match}}})", totals["requests"]
        )
        wait_for_value(
            prometheus,
            f'sum(ray_pdserve_requests_total{{{match},status="200"}})',
            totals["requests"],
        )
        wait_for_value(
            prometheus, f"sum(ray_pdserve_prompt_tokens_total{{{match}}})", totals["prompt"]
        )
        wait_for_value(
            prometheus,
            f"sum(ray_pdserve_generated_tokens_total{{{match}}})",
            totals["completion"],
        )
    # Every request was prefilled remotely and its KV streamed over shm.
    num_requests = sum(t["requests"] for t in usage.values())
    wait_for_value(
        prometheus,
        'sum(ray_pdserve_ttft_seconds_count{prefill_pool="prefill",decode_pool="decode"})',
        num_requests,
    )
    wait_for_value(prometheus, 'sum(ray_pdserve_queue_seconds_count{pool="prefill"})', num_requests)
    bytes_sent = query(prometheus, 'sum(ray_pdserve_kv_transfer_bytes_total{backend="shm"})')
    assert bytes_sent is not None and bytes_sent > 0

    # Replica gauges: the configured price of each pool's one replica; every block free
    # again once the requests are done.
    for pool, usd in PRICES.items():
        wait_for_value(prometheus, f'sum(ray_pdserve_replica_cost_per_hour{{pool="{pool}"}})', usd)
    pools = server.stats()["pools"]
    for pool in PRICES:
        wait_for_value(
            prometheus,
            f'sum(ray_pdserve_kv_blocks_free{{pool="{pool}"}})',
            pools[pool]["num_blocks"],
        )
        wait_for_value(prometheus, f'sum(ray_pdserve_kv_blocks_used{{pool="{pool}"}})', 0)

    # The dashboard draws metrics that exist: all of them that this traffic produces.
    names = scraped_names(prometheus)
    missing = {
        name
        for name in dashboard_metric_names()
        if name not in names and _defined_as(name) not in ONLY_ON_TROUBLE
    }
    assert not missing, f"dashboard metrics Prometheus never scraped: {sorted(missing)}"


def _defined_as(series: str) -> str:
    """The registry name of an exported series (`ray_pdserve_x_total` -> `pdserve_x`)."""
    for spec in BY_NAME.values():
        if series in spec.series:
            return spec.name
    raise AssertionError(f"{series} is not a pdserve metric")
