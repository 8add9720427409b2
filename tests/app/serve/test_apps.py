"""Finding the pdserve application among Serve's apps by its ingress deployment, whatever
Serve named it; a clear error when there is none or several."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from ray import serve
from ray.serve.exceptions import RayServeException

from app.serve import apps
from app.serve.apps import INGRESS_DEPLOYMENT, AppNotFoundError, find_app_name, own_app_name


def _cluster(monkeypatch: pytest.MonkeyPatch, ingress_of: dict[str, tuple[str, ...]]) -> None:
    """Serve runs the apps `ingress_of` names, each with its deployments (ingress first)."""
    status = SimpleNamespace(
        applications={
            name: SimpleNamespace(deployments={d: None for d in deployments})
            for name, deployments in ingress_of.items()
        }
    )

    def get_app_handle(name: str) -> Any:
        if name not in ingress_of:
            raise RayServeException(f"Application '{name}' does not exist.")
        return SimpleNamespace(deployment_name=ingress_of[name][0])

    monkeypatch.setattr(apps, "replica_states", lambda: status)
    monkeypatch.setattr(apps.serve, "get_app_handle", get_app_handle)


PDSERVE = (INGRESS_DEPLOYMENT, "prefill", "decode")


@pytest.mark.parametrize("name", ["default", "pdserve", "llm"])
def test_finds_the_app_whatever_its_name(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    # Another app with a deployment called "ingress" that is not its ingress is not ours.
    _cluster(monkeypatch, {name: PDSERVE, "other": ("router", INGRESS_DEPLOYMENT)})
    assert find_app_name() == name


def test_none_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _cluster(monkeypatch, {"other": ("router",)})
    with pytest.raises(AppNotFoundError, match="no pdserve application runs.*serve run"):
        find_app_name()


def test_several_ask_for_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    _cluster(monkeypatch, {"b": PDSERVE, "a": PDSERVE})
    with pytest.raises(
        AppNotFoundError, match=r"several pdserve applications .*\(a, b\).*app_name"
    ):
        find_app_name()


def test_an_app_deleted_meanwhile_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    _cluster(monkeypatch, {"default": PDSERVE, "gone": PDSERVE})
    real = serve.get_app_handle

    def vanished(name: str) -> Any:
        if name == "gone":
            raise RayServeException("Application 'gone' does not exist.")
        return real(name)

    monkeypatch.setattr(apps.serve, "get_app_handle", vanished)
    assert find_app_name() == "default"


def test_own_app_name_outside_serve_is_empty() -> None:
    assert own_app_name() == ""
