"""Which Serve application is pdserve: found by its ingress, never by a configured name.

Serve names an application where it is deployed, not where it is built: `serve run
app.main:app` calls it `default` (or `--name`), a config file calls it what its `name`
says. So nothing at run time trusts `PDServeConfig.app_name`: an ingress replica reads its
own application's name from Serve's replica context, and a caller of the handle API looks
for the application whose ingress deployment is pdserve's (`INGRESS_DEPLOYMENT`).
"""

from __future__ import annotations

from ray import serve
from ray.serve.exceptions import RayServeException

from app.serve.readiness import replica_states

INGRESS_DEPLOYMENT = "ingress"  # the deployment name `build_app` gives the HTTP ingress


class AppNotFoundError(LookupError):
    """No pdserve application runs in this Ray cluster, or several do and none was named."""


def find_app_name() -> str:
    """The name of the one pdserve application Serve runs on the connected Ray cluster.

    An application is pdserve's when its ingress deployment (the one its handle calls) is
    named `INGRESS_DEPLOYMENT`. Blocks on the Serve controller (one call per application
    that has such a deployment, after one read of the controller's details: `replica_states`,
    not `serve.status()`, whose models cost the caller ~40 ms of CPU). Raises
    `AppNotFoundError` when there is none, or when there are several (the caller must then
    name one).
    """
    candidates = [
        name
        for name, app in replica_states().applications.items()
        if INGRESS_DEPLOYMENT in app.deployments and _ingress_name(name) == INGRESS_DEPLOYMENT
    ]
    if not candidates:
        raise AppNotFoundError(
            "no pdserve application runs on this Ray cluster (none has an "
            f"{INGRESS_DEPLOYMENT!r} ingress deployment): start one with "
            "`serve run app.main:app` or `serve run configs/<name>.yaml`"
        )
    if len(candidates) > 1:
        names = ", ".join(sorted(candidates))
        raise AppNotFoundError(
            f"several pdserve applications run on this Ray cluster ({names}): "
            "pass app_name to choose one"
        )
    return candidates[0]


def _ingress_name(app_name: str) -> str | None:
    """The name of `app_name`'s ingress deployment (another app may have a deployment called
    `INGRESS_DEPLOYMENT` that is not its ingress); None once the app is gone."""
    try:
        return serve.get_app_handle(app_name).deployment_name
    except RayServeException:  # deleted since the controller listed it
        return None


def own_app_name() -> str:
    """The name Serve gave the application of the replica this runs in ("" outside Serve)."""
    try:
        return serve.get_replica_context().app_name
    except RayServeException:
        return ""
