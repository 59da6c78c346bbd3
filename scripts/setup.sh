#!/usr/bin/env bash
# Create .venv (unless it exists) and install llmrl into it with the CPU build of PyTorch pinned.
#   bash scripts/setup.sh          # the library and the `llmrl` command
#   bash scripts/setup.sh dev      # plus test and lint tools (any extras: dev,wandb,trl)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
# torch first, on its own: with it already installed, the constraints keep every later resolve on it.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".${extras:+[$extras]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
.venv/bin/python -c "import torch, llmrl; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "llmrl installed in .venv (torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'))"
