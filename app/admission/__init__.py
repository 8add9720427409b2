"""Admission control: tenant quotas shared by every ingress replica, SLO classes, overload.

Quotas and classes (their config sections: `app/config/tenants.py`, `admission.py`):
- `quotas`: token buckets, slot counts and the priority wait queue (pure, injected clock).
- `leases`: an ingress replica's local share of the global buckets (pure).
- `classes`: which SLO class (and so which priority) a request runs in.
- `quota_service`: the global state (`QuotaLedger` actor, owned by the `QuotaService`
  Serve deployment).
- `controller`: what the ingress calls per request (`Admission.admit`).

Overload (deadlines, load shedding; config `app/config/overload.py`): `overload`, `deadlines`,
`shedding`, `load_monitor`.
"""
