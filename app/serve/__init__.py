"""Everything that touches Ray Serve's API: the replica router, the pools' autoscaling
policies, the call helpers (a call's routing identity, Serve's backpressure error), which
application is pdserve (`apps.py`) and whether its pools are ready (`readiness.py`)."""
