"""Observability: tracing (`tracing.py`), the request log (`request_log.py`), unit cost
(`cost.py`), the TTFT breakdown (`ttft.py`), the ingress's per-request recorder of those
(`telemetry.py`), Prometheus metrics (`metrics.py`, `request_metrics.py`,
`replica_metrics.py`); settings in `config.py` (`PDServeConfig.observability`)."""
