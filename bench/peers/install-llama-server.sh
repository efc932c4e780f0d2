#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the benchmark peer for GGUF models) into .peers/llama-server
# from the llama.cpp sources that the llama-cpp-python source package on PyPI vendors. Ignored;
# never part of `make test`; about 8 minutes on 2 cores (JOBS=1 leaves one core free).
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=$PWD/.peers
PYTHON=${PYTHON:-python3.11}
JOBS=${JOBS:-2}
if [ -x "$PEERS/llama-server" ]; then echo "llama-server already in $PEERS"; exit 0; fi
mkdir -p "$PEERS/llama-src"
cd "$PEERS/llama-src"
ls llama_cpp_python-*.tar.gz >/dev/null 2>&1 \
  || "$PYTHON" -m pip download -q --no-deps --no-binary :all: llama-cpp-python -d .
src=$(ls -d llama_cpp_python-*/ 2>/dev/null | head -1 || true)
if [ -z "$src" ]; then tar xzf llama_cpp_python-*.tar.gz; src=$(ls -d llama_cpp_python-*/ | head -1); fi
cd "$src/vendor/llama.cpp"
# On CPUs with AMX, ggml's AMX matmul dies at its first tile instruction here (SIGILL in
# ggml_backend_amx_mul_mat, seen on an Emerald Rapids VM): build native without AMX.
NO_AMX=""
if grep -qw amx_int8 /proc/cpuinfo; then NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" >/dev/null
cmake --build build --target llama-server -j "$JOBS" >/dev/null
# The binary finds its shared libraries next to itself (RPATH $ORIGIN) when they are copied along.
mkdir -p "$PEERS/llama"
cp build/bin/llama-server build/bin/*.so* "$PEERS/llama/" 2>/dev/null || cp build/bin/llama-server "$PEERS/llama/"
find build -name '*.so*' -exec cp {} "$PEERS/llama/" \; 2>/dev/null || true
ln -sf llama/llama-server "$PEERS/llama-server"
echo "llama-server built: $PEERS/llama-server"
