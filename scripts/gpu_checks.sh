#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run of at most 8 minutes (GPU_CHECKS_BUDGET_S, default 470 s,
# counted from the start; each step's time limit is cut to what is left, a step with under 10 s left
# is skipped): the versions, the cuda-marked tests, bench/gpu.py at 0.5B (engine with CUDA graphs off
# and on, HF generate, the update kept and checkpointed), `llmrl train` at the 1.5B shape
# (bench/real_size.py) with inference.cuda_graphs off and on, and a profiler trace of one generation
# and one update at 0.5B (bench/profile_step.py, $LOG_DIR/trace.json). Then a summary: each step's
# exit status (124: its time limit) and the key figures from its log. Logs in $1 (default:
# gpu-checks/). The unit tests are not run here (CI runs them).
#
#   bash scripts/gpu_checks.sh [LOG_DIR] [bench/gpu.py arguments...]
#
# bench/gpu.py's arguments go after the trimmed defaults below, so they override them. Sized on an
# H100 (0.5B eager generation ~16k tokens/s): versions ~5 s, cuda tests <= 140 s, bench/gpu.py
# ~70 s (limit 120), real_size 2 x ~60 s (limit 90 each), profile ~30 s (limit 45).
#
# Made for a machine with torch, CUDA, transformers and pytest but without network: the packages it
# lacks go in as wheels from .whl/ (docs/development.md says how to fetch them), installed into
# /tmp/site. Nothing is installed when .whl/ is absent.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-gpu-checks}; shift || true
mkdir -p "$logs"
budget=${GPU_CHECKS_BUDGET_S:-470}
SECONDS=0
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

names=() statuses=() patterns=()
# run_step NAME LIMIT_S PATTERN TAIL COMMAND...: COMMAND under `timeout`, its output in $logs/NAME.txt
# (shown whole when TAIL is 0, else its last TAIL lines); PATTERN (grep -E) picks the summary's lines.
run_step() {
  local name=$1 limit=$2 pattern=$3 tail_lines=$4 left status
  shift 4
  left=$((budget - SECONDS))
  ((limit > left)) && limit=$left
  names+=("$name") patterns+=("$pattern")
  if ((limit < 10)); then
    echo "== $name: skipped, ${left}s of the ${budget}s budget left" | tee "$logs/$name.txt"
    statuses+=(skipped)
    return
  fi
  local shown="$*"
  echo "== $name (limit ${limit}s, ${SECONDS}s in): ${shown//$'\n'/ }"
  if ((tail_lines == 0)); then
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$logs/$name.txt"
    status=${PIPESTATUS[0]}
  else
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$logs/$name.txt" | tail -n "$tail_lines"
    status=${PIPESTATUS[0]}
  fi
  statuses+=("$status")
}

errors='^[A-Za-z_.]*(Error|Exception)\b'
run_step versions 15 '.' 0 bash -c '
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"transformers\", transformers.__version__)"'
run_step cuda_tests 140 '(passed|failed|error|no tests ran).* in [0-9.]+s' 30 \
  python3 -m pytest -q -m cuda -p no:cacheprovider tests
# 32 prompts x 8 samples x 256 new tokens: ~65k tokens per engine run, a few seconds each at 0.5B.
run_step bench_gpu 120 "^[0-9a-z.]+[ :].*tok/s|failed:|$errors" 0 \
  python3 bench/gpu.py --sizes 0.5b --prompts 32 --new-tokens 256 --cuda-graphs both "$@"
# `llmrl train` at the 1.5B shape, 3 steps of 32 prompts x 8 samples x 128 new tokens, the engine's
# decode steps captured as CUDA graphs or eager.
for graphs in off on; do
  run_step "real_size_graphs_$graphs" 90 "^\| (step|[0-9])|$errors" 8 \
    python3 bench/real_size.py --shape 1.5b --steps 3 --prompts 32 --new-tokens 128 --set "inference.cuda_graphs=$graphs"
done
run_step profile 45 "tok/s|s/step|^trace:|$errors" 25 \
  python3 bench/profile_step.py --size 0.5b --out "$logs/trace.json"

echo
echo "== summary (${SECONDS}s of ${budget}s; logs in $logs/)"
printf '%-22s %-8s %s\n' step status "key lines"
for i in "${!names[@]}"; do
  status=${statuses[$i]}
  [ "$status" = 124 ] && status="124 (time limit)"
  mapfile -t lines < <(grep -E "${patterns[$i]}" "$logs/${names[$i]}.txt" 2>/dev/null | tail -n 12)
  printf '%-22s %-8s %s\n' "${names[$i]}" "$status" "${lines[0]:-}"
  for line in "${lines[@]:1}"; do
    printf '%-22s %-8s %s\n' "" "" "$line"
  done
done | tee "$logs/summary.txt"
for status in "${statuses[@]}"; do
  [ "$status" = 0 ] || exit 1
done
