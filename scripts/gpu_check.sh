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
exit "$tests_rc"
