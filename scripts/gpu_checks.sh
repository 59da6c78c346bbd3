#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the cuda-marked tests, bench/gpu.py, the update's
# attention kernels at the 0.5B shape (bench/real_size.py), then the unit tests, each under a time limit, with logs in $1 (default: gpu-checks/).
#
#   bash scripts/gpu_checks.sh [LOG_DIR] [bench/gpu.py arguments...]
#
# Made for a machine with torch, CUDA, transformers and pytest but without network: the packages it
# lacks go in as wheels from .whl/ (docs/development.md says how to fetch them), installed into
# /tmp/site. Nothing is installed when .whl/ is absent.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-gpu-checks}; shift || true
mkdir -p "$logs"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
} 2>&1 | tee "$logs/versions.txt"
timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$logs/cuda_tests.txt" | tail -30
timeout 240 python3 bench/gpu.py "$@" 2>&1 | tee "$logs/bench_gpu.txt"
# The update's attention at the 0.5B shape: the masked kernel (sdpa, shared prompts allowed) against
# attention by sequence boundaries (varlen, whole sequences), 2 steps each.
for attention in sdpa varlen; do
  extra=()
  [ "$attention" = varlen ] && extra=(--set model.attn_implementation=varlen --set training.share_prefixes=false)
  timeout 150 python3 bench/real_size.py --shape 0.5b --steps 2 "${extra[@]}" 2>&1 | tee "$logs/real_size_$attention.txt" | tail -8
done
timeout 120 python3 -m pytest -q -m "not cuda and not slow" -n 8 -p no:cacheprovider tests/unit 2>&1 \
  | tee "$logs/unit_tests.txt" | tail -40
