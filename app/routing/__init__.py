"""Where a request runs: which pools, and whether its prompt is prefilled remotely.

- `pool_router`: the configured rules (context length → prefill pool, tenant → allowed
  pools and priority, short prompts prefilled on decode): `RouterPolicy.route`.
- `adaptive`: a routed prompt prefilled locally when the prefill pool would be later.
- `overflow`: a whole request sent to a prefill pool that serves whole requests while the
  decode pool is busier, or caches less of the request's history (`history`).
- `fallback`: a degradable request moved to the fallback model's pool when it would be
  shed, its prefill pool's breaker is open, or its decode pool's queue is full.
- `log`: the routing decisions an ingress replica made, for its report.
- `prefix_index`, `prefix_choice`: which replica caches which prefixes, and the replica
  routers' preference for the one caching the longest prefix of a prompt, within a load margin.

`Placement.place` chains the first three; fallback acts after admission's shedding check.
"""
