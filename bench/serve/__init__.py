"""Benchmarks against a running service, and what the other serving benchmarks stand on.

`deploy` starts and stops a config on a private Ray instance, `faults` finds and signals its
replica processes, `capacity` measures what it takes (closed loop); `workloads` says what is
sent and when (`conversations`: multi-turn ones), `loadgen` sends it (`pdserve bench serve`),
`sse` splits the streams, `metrics` turns per-request records into TTFT/TPOT/attainment,
`server_report` adds the server's own figures; `itl` is inter-token latency through HTTP
against the bare engine step.
"""
