#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the benchmark peer for GGUF models) from the llama.cpp sources
# that the llama-cpp-python source package on PyPI vendors, twice: for this CPU
# (.peers/llama-server, the `llama.cpp` system) and for AVX2 alone, no AVX-512, VNNI or AMX
# (.peers/llama-avx2/llama-server, the `llama.cpp-avx2` system: what most x86 machines run).
# Ignored; never part of `make test`; about 8 minutes a build on 2 cores (JOBS=1 leaves one
# core free). A build already there is kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=$PWD/.peers
PYTHON=${PYTHON:-python3.11}
JOBS=${JOBS:-2}

# build <build dir> <install dir> <cmake flags...>: llama-server and its shared libraries,
# copied into <install dir>; they find each other there (RPATH $ORIGIN), not in the build dir.
build() {
  local dir=$1 out=$2
  shift 2
  if [ -x "$out/llama-server" ]; then echo "llama-server already in $out"; return; fi
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' "$@" >/dev/null
  cmake --build "$dir" --target llama-server -j "$JOBS" >/dev/null
  mkdir -p "$out"
  cp "$dir/bin/llama-server" "$out/"
  find "$dir" -name '*.so*' -exec cp -P {} "$out/" \;
  echo "llama-server built: $out/llama-server"
}

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
build build "$PEERS/llama" -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX"
ln -sf llama/llama-server "$PEERS/llama-server"

# The flags are ggml/CMakeLists.txt's (llama-cpp-python 0.3.36); BMI2 and SSE4.2 stay on.
build build-avx2 "$PEERS/llama-avx2" -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
  -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF \
  -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
  -DGGML_AMX_BF16=OFF
