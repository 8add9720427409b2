"""Everything that touches Ray Serve's API: the replica router, the pools' autoscaling
policies, and the call helpers (a call's routing identity, Serve's backpressure error)."""
