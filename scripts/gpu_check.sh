#!/usr/bin/env bash
# GPU checks, the code no CPU run covers first: CUDA graphs and the CUDA engine
# (transformers parity), cuda_ipc between two processes, the @gpu KV-transfer tests,
# tensor parallelism over two GPUs (skipped with fewer), compiled Triton kernels, decode
# TPOT with CUDA graphs on/off vs the roofline, FP8, and the transfer benchmark; short
# tables, then one table of every step's status and time (printed however the run ends).
# Installs nothing; needs the repo's Python env (torch with CUDA, nvidia-nccl-cu12 or
# torch's bundled NCCL). The steps share GPU_CHECK_BUDGET_S (default 440 s): each runs
# under `timeout`, its own limit or what is left of the budget if less, and a step that
# finds under 10 s left is skipped (and listed so); with nvidia-smi and the table printers
# (10 s each at most) the whole run stays within 8 minutes.
# With GPU_CHECK_LOG_DIR set, every step's whole stdout and stderr are kept there too
# (<step>.out, <step>.err). Exit status 0 only if every test step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
budget=${GPU_CHECK_BUDGET_S:-440}
budget_end=$((SECONDS + budget))
work="$(mktemp -d)"
steps=()    # "name|status|seconds" of every step, for the summary
failed=0    # 1 once a test step did not pass
last_rc=0

summary() {
  echo "== summary (budget ${budget} s, took ${SECONDS} s)"
  printf '%-34s %-18s %7s\n' step status seconds
  local row name status secs
  for row in "${steps[@]}"; do
    IFS='|' read -r name status secs <<<"$row"
    printf '%-34s %-18s %7s\n' "$name" "$status" "$secs"
  done
  rm -rf "$work"
}
trap summary EXIT
trap 'exit 130' INT TERM

# step KIND NAME LIMIT_S CMD...: run CMD (stdin passes through) under `timeout` (LIMIT_S,
# or the budget left if less), stdout to $work/out, stderr to $work/err; skipped with
# under 10 s left. KIND test: anything but a pass fails the run; KIND bench: reported only.
step() {
  local kind=$1 name=$2 want=$3 left start status
  shift 3
  : >"$work/out"
  : >"$work/err"
  left=$((budget_end - SECONDS))
  if ((left < 10)); then
    steps+=("$name|skipped (budget)|0")
    [ "$kind" = test ] && failed=1
    last_rc=125
    return 125
  fi
  start=$SECONDS
  timeout "$((want < left ? want : left))" "$@" >"$work/out" 2>"$work/err"
  last_rc=$?
  case $last_rc in
    0) status=ok ;;
    124) status="timed out" ;;
    *) status="failed (rc $last_rc)" ;;
  esac
  steps+=("$name|$status|$((SECONDS - start))")
  if [ -n "${GPU_CHECK_LOG_DIR:-}" ]; then
    mkdir -p "$GPU_CHECK_LOG_DIR"
    cp "$work/out" "$GPU_CHECK_LOG_DIR/${name// /_}.out"
    cp "$work/err" "$GPU_CHECK_LOG_DIR/${name// /_}.err"
  fi
  [ "$kind" = test ] && [ "$last_rc" -ne 0 ] && failed=1
  return "$last_rc"
}

# show N: the last N lines of the step's stdout, and of its stderr if it failed.
show() {
  tail -n "$1" "$work/out"
  if [ "$last_rc" -ne 0 ] && [ -s "$work/err" ]; then tail -n 5 "$work/err"; fi
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfEs --tb=short)  # failures, skips listed

echo "== device"
timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  2>/dev/null || echo "nvidia-smi unavailable"
step bench "device and nccl" 60 "$PY" - <<'PY'
import torch
fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
print(f"torch {torch.__version__} cuda={torch.cuda.is_available()} devices={torch.cuda.device_count()}")
try:
    from kvtransfer.nccl_lib import load_nccl
    lib = load_nccl()  # path: libnccl.so.2 when it took the one torch loaded
    mapped = sorted({l.split()[-1] for l in open("/proc/self/maps") if "/libnccl.so" in l})
    print(f"nccl {lib.version()} from {lib.path} (mapped: {', '.join(mapped) or 'none'})")
except Exception as exc:  # report and go on: the tests say the rest
    print(f"nccl unavailable: {exc}")
print(f"FLAGS {int(torch.cuda.is_available())} {torch.cuda.device_count()} {int(fp8)}")
PY
grep -v '^FLAGS ' "$work/out"
show 0
read -r has_cuda num_gpus has_fp8 < <(sed -n 's/^FLAGS //p' "$work/out")
has_cuda=${has_cuda:-0} num_gpus=${num_gpus:-0} has_fp8=${has_fp8:-0}

# ---- The engine on CUDA: CUDA graphs (captured vs eager), transformers parity.
echo "== engine on cuda: CUDA graphs vs eager; fp32 token for token with transformers (graphs on/off), bf16 close"
step test "cuda graphs + engine on cuda" 150 \
  "${PYTEST[@]}" -m gpu tests/engine/test_cuda_graphs.py tests/engine/test_prompt_graphs.py \
  tests/engine/test_engine_cuda.py
show 6

# ---- Two processes on one GPU: NCCL refuses two ranks on one device, CUDA IPC does not.
# Between two GPUs (if present) cuda_ipc is measured against nccl, the default.
echo "== two-process KV transfer on one GPU (cuda_ipc)"
step test "cuda_ipc tests" 90 "${PYTEST[@]}" -m gpu tests/kvtransfer/test_cuda_ipc.py
show 4
ipc_bench() {  # name backend receiver-device sender-device
  step bench "bench $1" 30 "$PY" -m bench.offline.transfer --backend "$2" --device "$3" \
    --sender-device "$4" --model "$work" --tokens 8192 --repeats 3 --json \
    || echo "bench $1 failed"
  tail -n 1 "$work/out" >"$work/$1.json"
}
cat >"$work/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
 "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
 "num_hidden_layers": 30, "head_dim": 64, "vocab_size": 49152, "torch_dtype": "float32",
 "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
JSON
if [ "$has_cuda" -eq 1 ]; then
  ipc_bench ipc1 cuda_ipc cuda:0 cuda:0
  if [ "$num_gpus" -ge 2 ]; then
    ipc_bench ipc2 cuda_ipc cuda:0 cuda:1
    ipc_bench nccl2 nccl cuda:0 cuda:1
  else
    echo "cuda_ipc vs nccl between GPUs skipped: one GPU (nccl needs a device per rank)"
  fi
  timeout 10 "$PY" - "$work" <<'PY'
import json, os, sys
print(f"{'path':20} {'tokens':>6} {'MB':>7} {'GB/s':>6} {'copy':>6} {'ratio':>5} {'raw ms':>7} "
      f"{'handover':>8} {'ok':>3}")
for name, label in (("ipc1", "cuda_ipc cuda:0->0"), ("ipc2", "cuda_ipc cuda:1->0"),
                    ("nccl2", "nccl cuda:1->0")):
    try:
        r = json.load(open(os.path.join(sys.argv[1], f"{name}.json")))
    except (OSError, ValueError):
        continue
    print(f"{label:20} {r['tokens']:>6} {r['bytes'] / 1e6:7.1f} {r['transfer_gb_s']:6.1f} "
          f"{r['reference_gb_s']:6.1f} {r['ratio']:5.2f} {r['raw_transfer_ms']:7.2f} "
          f"{r['handover_ms']:8.2f} {'yes' if r['verified'] else 'NO':>3}")
PY
else
  echo "== cuda_ipc benchmark skipped: no CUDA device"
fi

echo "== gpu tests (kvtransfer)"
step test "kvtransfer gpu tests" 120 \
  "${PYTEST[@]}" -m gpu tests/kvtransfer --ignore=tests/kvtransfer/test_cuda_ipc.py
show 15

echo "== tensor parallelism (GPU-only: NCCL ranks on cuda:0..1; skipped with under 2 GPUs)"
step test "tensor parallelism" 90 "${PYTEST[@]}" -m gpu tests/engine/test_tensor_parallel.py
show 5

echo "== compiled Triton kernels vs references (the fp8 ones below)"
step test "triton kernels" 120 "${PYTEST[@]}" tests/kernels/test_triton_kernels.py -k "not fp8"
show 4

if [ "$has_cuda" -eq 1 ]; then
  echo "== decode TPOT, CUDA graphs on/off, bf16, vs the weight-bandwidth roofline (H200 4.8 TB/s)"
  step bench "decode TPOT" 150 "$PY" -m bench.offline.tpot --models small llama3-8b --batch 1 32 \
    ${GPU_CHECK_LOG_DIR:+--profile "$GPU_CHECK_LOG_DIR/profiles"} \
    || echo "decode TPOT benchmark failed"
  show 12
  echo "== a 512-token prefill step, eager vs CUDA graphs split around attention (engine.prompt_graphs)"
  step bench "prompt graphs" 120 "$PY" -m bench.offline.tpot --models small llama3-8b --batch 1 \
    --prompt-len 512 --output-len 4 --modes eager prompt-graphs \
    || echo "prompt graphs benchmark failed"
  show 6
else
  echo "== decode TPOT benchmark skipped: no CUDA device"
fi

# ---- FP8 (weights and KV cache). GPU-only: the tests skip themselves without an sm_89+ GPU,
# and the benchmarks below need CUDA; CPU CI covers the reference path (tests/engine/test_fp8*).
echo "== fp8 tests (scaled_mm vs reference, CUDA FP8 engine vs CPU FP8 engine, Triton FP8 kernels)"
step test "fp8 tests" 120 "${PYTEST[@]}" -m gpu tests/engine/test_fp8_gpu.py
show 6
step test "triton fp8 kernels" 120 "${PYTEST[@]}" tests/kernels/test_triton_kernels.py -k fp8
show 4
if [ "$has_fp8" -eq 1 ]; then
  echo "== fp8 accuracy on small (fp32 reference; bf16 engines with fp8 on/off), 1024 tokens"
  step bench "fp8 accuracy" 90 "$PY" -m bench.offline.accuracy --model small --device cuda \
    --dtype float32 --candidate-dtype bfloat16 --baseline-dtype bfloat16 --quantization fp8 \
    --kv-cache-dtype fp8 --tokens 1024 --free-tokens 0 --json "$work/fp8_acc.json" \
    || echo "fp8 accuracy failed"
  timeout 10 "$PY" - "$work/fp8_acc.json" <<'PY'
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
  echo "== fp8 weights + fp8 KV: decode TPOT with CUDA graphs, batch 1 and 32 (bf16 rows above)"
  step bench "fp8 TPOT" 120 "$PY" -m bench.offline.tpot --models small llama3-8b --modes graphs \
    --batch 1 32 --quantization fp8 --kv-cache-dtype fp8 || echo "fp8 TPOT failed"
  show 10
else
  echo "== fp8 benchmarks skipped: no CUDA device with FP8 (sm_89+)"
fi

# ---- Host-side transfer backends last: they need no GPU.
echo "== transfer benchmark (135M-class shape: 30 layers, 3 kv heads, head_dim 64, fp32)"
for backend in shm tcp; do
  step bench "bench $backend" 60 "$PY" -m bench.offline.transfer --backend "$backend" --model "$work" \
    --tokens 2048 8192 --repeats 3 --json || echo "bench $backend failed"
  tail -n 1 "$work/out" >"$work/$backend.json"
done
timeout 10 "$PY" - "$work" <<'PY'
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
exit "$failed"
