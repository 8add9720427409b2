#!/usr/bin/env bash
# The product on one lent GPU, through Ray Serve: what no CPU run and no component check
# (scripts/gpu_check.sh) covers. Two device calls, on a machine that stays warm between them:
#
#   scripts/gpu_wheels.sh                                   # here, once: .whl/part1, part2
#   call 1, carry [".whl/part1"]:  bash scripts/gpu_serve_check.sh park
#   call 2, carry [".whl/part2"]:  bash scripts/gpu_serve_check.sh run   # < 10 minutes
#
# `park` copies part 1 of the wheels (Ray's wheel is larger than one call may carry) to
# /root/pdserve-part1, outside the working tree. `run` joins both parts, checks every wheel
# against the manifests (scripts/wheel_parts.py), installs them into /tmp/site (no index, no
# deps: the image has the rest), and then, with configs/gpu-single.yaml (one prefill and one
# decode replica on the GPU, half each, KV over cuda_ipc):
#   1. `serve run`, then the official `openai` client: greedy completions of the built-in
#      tiny model (float32) equal to `transformers` greedy on the same GPU, text for text;
#   2. `pdserve bench chaos` with decode kills (SIGKILL; Serve replaces the replica):
#      every request completed or failed cleanly, none wrong, no block leaked;
#   3. `pdserve bench compare` on the Llama-3-8B shape (random weights, bfloat16) at three
#      rates: TTFT, TPOT, goodput of gpu-single against configs/gpu-single-colocated.yaml
#      (the same GPU, two colocated replicas);
# and prints one table of every step for BENCHMARKS.md. Steps share GPU_SERVE_BUDGET_S
# (default 540 s); each runs under `timeout`. With $OUT set (the device tool), the JSON of
# each step lands there. Exit status 0 only if every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PARKED=/root/pdserve-part1
PY="${PYTHON:-python3}"

if [ "${1:-}" = park ]; then
  [ -f .whl/part1/MANIFEST.json ] || { echo "no .whl/part1: run scripts/gpu_wheels.sh here and carry it"; exit 1; }
  rm -rf "$PARKED" && mkdir -p "$PARKED" && cp .whl/part1/* "$PARKED"/ || exit 1
  echo "parked $(du -sm "$PARKED" | cut -f1) MiB in $PARKED; next call: carry .whl/part2, run"
  exit 0
fi
[ "${1:-}" = run ] || { echo "usage: $0 park|run"; exit 2; }

budget=${GPU_SERVE_BUDGET_S:-540}
budget_end=$((SECONDS + budget))
out="${OUT:-$(mktemp -d)}"
work="$(mktemp -d)"
rows=()  # "step|status|seconds|figures"
failed=0
serve_pid=""

summary() {
  [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null
  echo "== summary (budget ${budget} s, took ${SECONDS} s)"
  printf '%-28s %-16s %5s  %s\n' step status s figures
  local row name status secs figures
  for row in "${rows[@]}"; do
    IFS='|' read -r name status secs figures <<<"$row"
    printf '%-28s %-16s %5s  %s\n' "$name" "$status" "$secs" "$figures"
  done
}
trap summary EXIT
trap 'exit 130' INT TERM

# step NAME LIMIT_S CMD...: CMD under `timeout` (LIMIT_S, or the budget left if less), output
# in $work/NAME.log; its last line starting "FIGURES " is the table's figures column.
step() {
  local name=$1 want=$2 left start rc status figures
  shift 2
  left=$((budget_end - SECONDS))
  if ((left < 15)); then
    rows+=("$name|skipped (budget)|0|")
    failed=1
    return 125
  fi
  start=$SECONDS
  timeout "$((want < left ? want : left))" "$@" >"$work/$name.log" 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124) status="timed out" ;; *) status="failed (rc $rc)" ;; esac
  figures=$(sed -n 's/^FIGURES //p' "$work/$name.log" | tail -n 1)
  rows+=("$name|$status|$((SECONDS - start))|$figures")
  [ "$rc" -ne 0 ] && failed=1 && tail -n 15 "$work/$name.log"
  return "$rc"
}

install() {
  "$PY" scripts/wheel_parts.py join "$PARKED" .whl/part2 "$work/wheels" || return 1
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$work"/wheels/*.whl || return 1
  PYTHONPATH=/tmp/site "$PY" -c 'import ray, fastapi, openai; from ray import serve
print(f"FIGURES ray {ray.__version__}, fastapi {fastapi.__version__}, openai {openai.__version__}")'
}
echo "== device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
step install 120 install || exit 1
export PYTHONPATH="/tmp/site:$PWD"
export PATH="/tmp/site/bin:$PATH"
pdserve() { "$PY" -m app.cli "$@"; }

wait_healthy() {  # the app answers /health within $1 s
  local deadline=$((SECONDS + $1))
  while ((SECONDS < deadline)); do
    "$PY" -c 'import urllib.request,sys; urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2)' \
      2>/dev/null && return 0
    kill -0 "$serve_pid" 2>/dev/null || return 1
    sleep 2
  done
  return 1
}

openai_check() {
  "$PY" /tmp/site/bin/serve run configs/gpu-single.yaml >"$work/serve.log" 2>&1 &
  serve_pid=$!
  wait_healthy 180 || { tail -n 30 "$work/serve.log"; return 1; }
  "$PY" - <<'PY'
import openai, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from engine.builtin import resolve_model_dir

prompts = ["hello", "The capital of France is", "def fibonacci(n):",
           "a prompt long enough to cross several sixteen-token KV blocks " * 8]
client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
model = client.models.list().data[0].id
path = resolve_model_dir("tiny")
tok = AutoTokenizer.from_pretrained(path)
ref = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).cuda().eval()
equal = 0
for prompt in prompts:
    got = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
    ids = tok(prompt, return_tensors="pt").input_ids.cuda()
    with torch.no_grad():
        gen = ref.generate(ids, max_new_tokens=32, do_sample=False)
    want = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    same = got.choices[0].text == want
    equal += same
    print(f"{'equal' if same else 'DIFFERENT':9} {len(ids[0]):4} tokens  {prompt[:40]!r}")
print(f"FIGURES {equal}/{len(prompts)} greedy completions equal to transformers (tiny, fp32)")
raise SystemExit(0 if equal == len(prompts) else 1)
PY
}
echo "== 1. serve run configs/gpu-single.yaml, openai client vs transformers"
step openai 240 openai_check
tail -n 6 "$work/openai.log"
"$PY" /tmp/site/bin/serve shutdown -y >/dev/null 2>&1
kill "$serve_pid" 2>/dev/null
wait "$serve_pid" 2>/dev/null
serve_pid=""
"$PY" -m ray.scripts.scripts stop --force >/dev/null 2>&1

chaos() {
  pdserve bench chaos --config gpu-single --num-cpus 16 --faults kill --targets decode \
    --duration 60 --fault-every 20 --seed 0 --no-progress --json "$out/chaos.json" || return 1
  "$PY" - "$out/chaos.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("completed", "failed_clean", "failed_unclean", "hung", "wrong", "leaked_blocks")
print("FIGURES " + ", ".join(f"{k} {r.get(k)}" for k in keys))
raise SystemExit(0 if not (r.get("failed_unclean") or r.get("hung") or r.get("wrong")
                           or r.get("leaked_blocks")) else 1)
PY
}
echo "== 2. chaos: decode replica SIGKILLed under load"
step chaos 150 chaos

speed() {
  "$PY" - "$work" <<'PY' || return 1
import sys
from pathlib import Path
import yaml
from bench.offline.tpot import shape_dir

work = Path(sys.argv[1])
model = shape_dir("llama3-8b", work / "llama3-8b")
for name in ("gpu-single", "gpu-single-colocated"):
    config = yaml.safe_load(open(f"configs/{name}.yaml"))
    args = config["applications"][0]["args"]
    # 16 GB of weights per replica, two replicas: 16 GiB of KV each fits an H100 too
    args["model"].update(model=str(model), dtype="bfloat16", load_format="dummy",
                         kv_cache_bytes=16 * 1024**3)
    yaml.safe_dump(config, open(work / f"{name}-8b.yaml", "w"))
PY
  pdserve bench compare --configs "$work/gpu-single-8b.yaml,$work/gpu-single-colocated-8b.yaml" \
    --num-cpus 16 --rates "${GPU_SERVE_RATES:-4,8,16}" --seeds 1 --requests-per-point 60 \
    --workload mixed --slo-ttft 500 --slo-tpot 50 --json "$out/compare-8b.json" || return 1
  "$PY" - "$out/compare-8b.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{'config':24} {'rate':>5} {'attain':>6} {'TTFT p50':>9} {'TPOT p50':>9}")
for name, runs in r["runs"].items():
    for point in runs[0]["points"]:
        s = point["summary"]
        print(f"{name.split('/')[-1]:24} {point['rate']:5.1f} {point['attainment']:6.2f} "
              f"{s['ttft_ms']['p50']:9.1f} {s['tpot_ms']['p50']:9.2f}")
print(f"FIGURES goodput ratio {r['ratio']:.2f} (disaggregated / colocated, 8B shape, bf16)")
PY
}
echo "== 3. Llama-3-8B shape: disaggregated vs colocated on one GPU, three rates"
step speed 300 speed
tail -n 8 "$work/speed.log"
exit "$failed"
