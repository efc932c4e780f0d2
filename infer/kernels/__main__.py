"""``python -m infer.kernels``: build the kernels for this machine (``make`` runs it)."""

from infer.kernels import build_dir, ops

ops()
print(f"infer kernels ready in {build_dir()}")
