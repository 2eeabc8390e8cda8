#!/usr/bin/env bash
# Builds Arctic Inference's suffix-tree extension for a vLLM environment on a CPU, so that
# vLLM's `suffix` method (SuffixDecoding) runs there, and prints the folder to put on
# PYTHONPATH:
#
#   export PYTHONPATH=$(bash scripts/arctic_suffix.sh [VENV])${PYTHONPATH:+:$PYTHONPATH}
#   specplug bench --methods none,specplug,suffix
#
# VENV defaults to this repository's cached vLLM environment. PyPI ships arctic-inference as a
# source archive only; its CUDA ops are opt-in, so on a machine without a CUDA toolkit the build
# makes the suffix tree alone. The build tools (nanobind, ninja, grpcio-tools) go into a build
# environment of their own, so the build's protobuf stays out of vLLM's. The result is the bare
# package without its metadata: vLLM imports `arctic_inference.suffix_decoding` for `suffix`,
# while Arctic's own vLLM plugin (written for vLLM 0.26) is not registered and patches nothing.
# Cached under $SPECPLUG_CACHE/arctic-inference-VERSION-PYTHON; needs PyPI once.
set -euo pipefail
VERSION=0.3.0
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ $# -ge 1 ]; then venv=$1; else source "$ROOT/scripts/envs.sh"; venv=$(ensure_env vllm); fi
python="$venv/bin/python"
tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
out="${SPECPLUG_CACHE:-$HOME/.cache/specplug}/arctic-inference-$VERSION-$tag"
if [ ! -d "$out/arctic_inference" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "building arctic-inference $VERSION for $python (about a minute)" >&2
    "$python" -m venv "$work/build"
    "$work/build/bin/pip" install -q nanobind==2.9.2 ninja grpcio-tools cmake setuptools wheel 2>&1 \
        | grep -v -e "is ignored: it is neither" >&2 || true
    url=$(curl -fsSL https://pypi.org/simple/arctic-inference/ \
        | grep -o "https://[^\"#]*arctic_inference-$VERSION.tar.gz" | head -1)
    mkdir -p "$work/src" && curl -fsSL -o "$work/src/arctic_inference-$VERSION.tar.gz" "$url"
    tar xzf "$work"/src/arctic_inference-*.tar.gz -C "$work/src"
    site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')  # torch for setup.py
    (cd "$work/src/arctic_inference-$VERSION" && PATH="$work/build/bin:$PATH" PYTHONPATH="$site" \
        CMAKE_ARGS="-DPython_EXECUTABLE=$work/build/bin/python -Dnanobind_DIR=$("$work/build/bin/python" -m nanobind --cmake_dir)" \
        "$work/build/bin/pip" wheel -q --no-build-isolation --no-deps . -w "$work/wheel" >&2)
    mkdir -p "$work/unpacked"
    "$python" -m zipfile -e "$work"/wheel/arctic_inference-*.whl "$work/unpacked"
    rm -rf "$work"/unpacked/*.dist-info "$out" && mkdir -p "$(dirname "$out")" && mv "$work/unpacked" "$out"
fi
PYTHONPATH="$out" "$python" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache" >&2
echo "$out"
