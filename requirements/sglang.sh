#!/usr/bin/env bash
# Installs the SGLang test/serving environment (CPU) into the virtual environment $1.
# The full `pip install sglang==0.5.23` pulls CUDA torch 2.14.1 and many CUDA libraries
# (11 GB) and still cannot start the CPU engine. Instead: CPU torch 2.13.0 (the wheel on
# disk), SGLang without dependencies, then its pure-Python needs with torch pinned.
# Two gaps remain on a CPU without AMX (no CPU sgl-kernel on PyPI; PyPI torchvision links
# CUDA); the SGLang test suite fills them with stand-ins under tests/support/ that are put
# on the path only by tests/sglang/conftest.py, never installed here.
set -euo pipefail
venv=$1
here=$(cd "$(dirname "$0")" && pwd)
pip=("$venv/bin/pip" install -q)
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps sglang==0.5.23
"${pip[@]}" torch==2.13.0 -r "$here/core.txt" \
    numpy transformers==5.19.0 tokenizers==0.23.2 safetensors \
    fastapi "uvicorn>=0.51" uvloop pyzmq psutil setproctitle orjson msgspec pydantic \
    requests aiohttp prometheus-client python-multipart pybase64 einops regex packaging \
    tqdm sentencepiece==0.2.1 xxhash interegular partial_json_parser pillow scipy \
    zstandard distro triton==3.7.1 IPython dill apache-tvm-ffi==0.1.11 \
    compressed-tensors==0.18.0 gguf openai==2.8.0 xgrammar==0.2.7 jsonschema \
    soundfile==0.13.1
# Anything above that dragged in PyPI torchvision/torchaudio/torchcodec needs CUDA and
# breaks `import transformers`: remove it.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import torch, sglang; assert torch.__version__.startswith('2.13.0')"
