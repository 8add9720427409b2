"""pdserve's benchmarks: `pdserve bench <name>` or `python -m bench <name>` (`bench/cli.py`
names them).

- `offline/`: one component without Serve: the engine, decode TPOT, FP8 accuracy, KV transfer;
- `serve/`: a deployed service: deploying it, its faults, capacity, load generation, metrics;
- `goodput/`: the knee search, its intervals and the goodput sweep;
- each other benchmark, a package of its own built on those: `compare/`, `overload/`,
  `autoscale/`, `chaos/`, `batch/`.
"""
