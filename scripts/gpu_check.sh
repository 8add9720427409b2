#!/usr/bin/env bash
# GPU checks: the @gpu KV-transfer tests, tensor parallelism over two GPUs (skipped with
# fewer), then the transfer benchmark, as a short table.
# Installs nothing; needs the repo's Python env (torch with CUDA, nvidia-nccl-cu12 or
# torch's bundled NCCL). Finishes in a few minutes; each step has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
  || echo "nvidia-smi unavailable"
"$PY" - <<'PY'
import torch
print(f"torch {torch.__version__} cuda={torch.cuda.is_available()} devices={torch.cuda.device_count()}")
try:
    from kvtransfer.nccl_lib import load_nccl
    lib = load_nccl()
    print(f"nccl {lib.version()} from {lib.path}")
except Exception as exc:  # report and go on: the tests say the rest
    print(f"nccl unavailable: {exc}")
PY

echo "== gpu tests"
timeout 300 "$PY" -m pytest -m gpu tests/kvtransfer -q -p no:cacheprovider -rs 2>&1 | tail -15
tests_rc=${PIPESTATUS[0]}

echo "== tensor parallelism (GPU-only: NCCL ranks on cuda:0..1; skipped with under 2 GPUs)"
timeout 300 "$PY" -m pytest -m gpu tests/engine/test_tensor_parallel.py -q -p no:cacheprovider \
  -rs 2>&1 | tail -5
tp_rc=${PIPESTATUS[0]}
[ "$tests_rc" -eq 0 ] && tests_rc=$tp_rc

echo "== transfer benchmark (135M-class shape: 30 layers, 3 kv heads, head_dim 64, fp32)"
cat > "$work/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
 "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
 "num_hidden_layers": 30, "head_dim": 64, "vocab_size": 49152, "torch_dtype": "float32",
 "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
JSON
for backend in shm tcp; do
  timeout 150 "$PY" -m bench.transfer --backend "$backend" --model "$work" \
    --tokens 512 2048 8192 --repeats 3 --json 2>/dev/null | tail -1 > "$work/$backend.json" \
    || echo "bench $backend failed"
done
"$PY" - "$work" <<'PY'
import json, os, sys
rows = []
for backend in ("shm", "tcp"):
    path = os.path.join(sys.argv[1], f"{backend}.json")
    try:
        data = json.load(open(path))
    except (OSError, ValueError):
        continue
    rows += data if isinstance(data, list) else [data]
print(f"{'backend':7} {'tokens':>6} {'MB':>7} {'GB/s':>6} {'ref':>6} {'ratio':>5} "
      f"{'raw ms':>7} {'handover':>8} {'overlap/sum':>11}")
for r in rows:
    print(f"{r['backend']:7} {r['tokens']:>6} {r['bytes'] / 1e6:7.1f} {r['transfer_gb_s']:6.2f} "
          f"{r['reference_gb_s']:6.2f} {r['ratio']:5.2f} {r['raw_transfer_ms']:7.1f} "
          f"{r['handover_ms']:8.2f} {r['overlap_ratio']:11.2f}")
PY

# ---- FP8 (weights and KV cache). GPU-only: the tests skip themselves without an sm_89+ GPU,
# and the benchmarks below need CUDA; CPU CI covers the reference path (tests/engine/test_fp8*).
echo "== fp8 tests (scaled_mm vs reference, CUDA FP8 engine vs CPU FP8 engine, Triton FP8 kernels)"
timeout 180 "$PY" -m pytest -m gpu tests/engine/test_fp8_gpu.py -q -p no:cacheprovider -rs 2>&1 \
  | tail -6
fp8_rc=${PIPESTATUS[0]}
timeout 240 "$PY" -m pytest tests/kernels/test_triton_kernels.py -k fp8 -q -p no:cacheprovider \
  -rs 2>&1 | tail -4
[ "${PIPESTATUS[0]}" -eq 0 ] || fp8_rc=1
if "$PY" -c 'import sys, torch; sys.exit(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)))'; then
  echo "== fp8 accuracy on small (fp32 reference; bf16 engines with fp8 on/off), 1024 tokens"
  timeout 150 "$PY" -m bench.accuracy --model small --device cuda --dtype float32 \
    --candidate-dtype bfloat16 --baseline-dtype bfloat16 --quantization fp8 \
    --kv-cache-dtype fp8 --tokens 1024 --free-tokens 0 2>/dev/null | tail -1 > "$work/fp8_acc.json" \
    || echo "fp8 accuracy failed"
  "$PY" - "$work/fp8_acc.json" <<'PY'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(0)
print(f"{'dtype':9} {'weights':7} {'kv':4} {'rel err':>8} {'p99':>6} {'agree':>6}")
for r in data["results"]:
    print(f"{r['dtype']:9} {r['quantization'] or '-':7} {r['kv_cache_dtype']:4} "
          f"{r['rel_logit_error_mean']:8.4f} {r['rel_logit_error_p99']:6.3f} {r['greedy_agreement']:6.3f}")
PY
  echo "== fp8 on/off decode TPOT on small (bf16, eager), batch 1 and 32"
  timeout 180 "$PY" - <<'PY' || echo "fp8 TPOT failed"
import statistics, time
import torch
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.request import SamplingParams

HBM_BYTES_S = 4.8e12  # H200
print(f"{'weights':7} {'kv':4} {'batch':>5} {'TPOT ms':>8} {'weights GB':>10} {'roofline ms':>11}")
for quantization, kv in [(None, "auto"), ("fp8", "auto"), (None, "fp8"), ("fp8", "fp8")]:
    engine = Engine(EngineConfig(
        model_dir="small", dtype="bfloat16", device="cuda", quantization=quantization,
        cache=CacheConfig(kv_cache_bytes=2 << 30, kv_cache_dtype=kv, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=8192,
                                  long_prefill_token_threshold=512)))
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    for batch in (1, 32):
        params = SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True)
        engine.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
        for i in range(batch):
            engine.add_request(engine.make_request([65 + i % 26] * 128, params))
        steps = []
        while engine.has_unfinished:
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - start)
        tpot = statistics.median(steps[1:]) * 1e3  # the first step is the prefill
        print(f"{quantization or '-':7} {kv:4} {batch:5} {tpot:8.2f} {weight_bytes / 1e9:10.3f} "
              f"{weight_bytes / HBM_BYTES_S * 1e3:11.3f}")
PY
else
  echo "== fp8 benchmarks skipped: no CUDA device with FP8 (sm_89+)"
fi
[ "$tests_rc" -eq 0 ] && [ "$fp8_rc" -eq 0 ]
exit $?
