"""How much memory a model takes: measured once loaded, estimated from its files before.

A server that loads models on demand within a memory budget must decide what to unload
before it loads the next one; the file's size is what it knows then. Once loaded, the
measured size (weights, and what the engine adds: its KV cache) replaces the estimate.
"""

from __future__ import annotations

from pathlib import Path

import torch

from infer.models.default import DEFAULT_GGUF_FILE, DEFAULT_GGUF_PACKAGE, package_file
from infer.models.packaged import PACKAGED_FOLDERS, PACKAGED_MODELS

# A GGUF file's Q4 weights dequantized to bf16 take about this many times its size.
DEQUANTIZED_RATIO = 3.5


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's weights: its parameters and buffers, and the tensors its layers
    hold packed for the kernels."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                tensors[id(value)] = value
    return sum(t.numel() * t.element_size() for t in tensors.values())


def source_bytes(source: str, weights: str = "auto") -> int:
    """An estimate of the bytes the weights of ``source`` (what ``load_model`` takes) will
    hold once loaded, from its files alone; 0 when nothing is known of it (a hub id not yet
    downloaded, a missing path: its load will say why)."""
    if source == "default":  # converted to bf16 once; about 3.5 times its Q4_1 file
        file = package_file(DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILE)
        return int(file.stat().st_size * DEQUANTIZED_RATIO) if file else 0
    if source in PACKAGED_MODELS:
        size = PACKAGED_MODELS[source].size
        return int(size * DEQUANTIZED_RATIO) if weights == "bf16" else size
    if source in PACKAGED_FOLDERS:
        spec = PACKAGED_FOLDERS[source]
        archive = package_file(spec.package, spec.archive)
        return archive.stat().st_size if archive else 0
    path = Path(source).expanduser()
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    if path.is_file():
        ratio = DEQUANTIZED_RATIO if weights == "bf16" and path.suffix == ".gguf" else 1.0
        return int(path.stat().st_size * ratio)
    return 0
