"""What both pools stand on: the engine replica (its loop thread, stats, signals and the
whole-request local path), generate streams with their slot gate and timelines, the span
base of both pools' traces, and the request protocol between the ingress and the pools.

`prefill/` and `decode/` import this layer, `engine/` and `kvtransfer/`, never each other.
"""
