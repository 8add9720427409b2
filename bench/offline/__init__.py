"""Benchmarks of one component on this machine, without Serve: the engine against `transformers`
and the machine's roofline (`throughput`, `step_profile`, `roofline`), decode time per token
(`tpot`), FP8 accuracy (`accuracy`), and KV transfer between two processes (`transfer`)."""
