"""cluster.yaml: valid for `ray up`, and big enough for configs/h200.yaml's pools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config import PDServeConfig, PoolConfig, load_config
from app.serve.cadence import SERVE_ENV_VARS

ROOT = Path(__file__).resolve().parents[2]
GPUS_PER_P5E = 8

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def h200() -> PDServeConfig:
    return load_config(ROOT / "configs" / "h200.yaml")


def _workers(cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    head = cluster["head_node_type"]
    return {k: v for k, v in cluster["available_node_types"].items() if k != head}


def _demand(pools: list[PoolConfig], key: str, *, at_max: bool) -> float:
    """Total amount of resource `key` the pools hold (at their fixed or min/max replicas)."""
    total = 0.0
    for pool in pools:
        per_replica = {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}
        if pool.autoscaling is not None:
            auto = pool.autoscaling
            replicas = auto.max_replicas if at_max else auto.min_replicas
        else:
            assert pool.num_replicas is not None
            replicas = pool.num_replicas
        total += per_replica.get(key, 0.0) * replicas
    return total


def _capacity(cluster: dict[str, Any], key: str, *, at_max: bool) -> float:
    """Total amount of `key` the worker nodes declare (at min_workers or max_workers)."""
    return sum(
        node["resources"].get(key, 0) * node.get("max_workers" if at_max else "min_workers", 0)
        for node in _workers(cluster).values()
    )


def test_matches_ray_cluster_schema(cluster: dict[str, Any]) -> None:
    import ray.autoscaler

    schema_path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    jsonschema.validate(cluster, schema)


def test_node_types(cluster: dict[str, Any]) -> None:
    assert cluster["provider"]["type"] == "aws"
    assert cluster["head_node_type"] in cluster["available_node_types"]
    workers = _workers(cluster)
    assert workers, "no worker node type"
    for name, node in workers.items():
        assert node["node_config"]["InstanceType"] == "p5e.48xlarge", name
        assert node["resources"]["GPU"] == GPUS_PER_P5E
        assert 1 <= node["min_workers"] <= node["max_workers"] <= cluster["max_workers"]


def test_repository_is_mounted_and_installed_with_gpu_extra(cluster: dict[str, Any]) -> None:
    (remote,) = [k for k, v in cluster["file_mounts"].items() if v == "."]
    assert any(f'pip install -e "{remote}[gpu]"' in cmd for cmd in cluster["setup_commands"])


def test_every_pool_resource_exists_on_a_worker(
    cluster: dict[str, Any], h200: PDServeConfig
) -> None:
    declared = {key for node in _workers(cluster).values() for key in node["resources"]}
    for pool in h200.pools:
        assert pool.resources, f"pool {pool.name} is not pinned to a node type"
        missing = set(pool.resources) - declared
        assert not missing, f"pool {pool.name} requests undeclared resources {missing}"


@pytest.mark.parametrize("at_max", [False, True], ids=["min_workers", "max_workers"])
def test_capacity_covers_pools(cluster: dict[str, Any], h200: PDServeConfig, at_max: bool) -> None:
    keys = {"CPU", "GPU"} | {key for pool in h200.pools for key in pool.resources}
    for key in sorted(keys):
        demand = _demand(h200.pools, key, at_max=at_max)
        capacity = _capacity(cluster, key, at_max=at_max)
        assert demand <= capacity, f"{key}: pools need {demand}, workers have {capacity}"


def test_gpus_fit_on_p5e_nodes(cluster: dict[str, Any], h200: PDServeConfig) -> None:
    num_workers = sum(node["max_workers"] for node in _workers(cluster).values())
    assert _demand(h200.pools, "GPU", at_max=True) <= num_workers * GPUS_PER_P5E


def test_each_replica_fits_on_one_node(cluster: dict[str, Any], h200: PDServeConfig) -> None:
    nodes = list(_workers(cluster).values())
    for pool in h200.pools:
        need = {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}
        assert any(
            all(node["resources"].get(k, 0) >= v for k, v in need.items()) for node in nodes
        ), f"a replica of pool {pool.name} ({need}) fits on no worker node"


def test_ray_starts_at_the_apps_serve_cadence(cluster: dict[str, Any]) -> None:
    """Every node's Ray runs Serve's processes with `app/serve/cadence.py`'s values (an app
    deployed by `serve run app.main:app` on the cluster starts its controller from there)."""
    exports = " ".join(f"{name}={value}" for name, value in SERVE_ENV_VARS.items())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in cluster[key] if "ray start" in c]
        assert f"export {exports};" in start, start
