"""``python -m infer.kernels [TARGET ...]``: build the kernels for this machine (``make`` runs
it). Targets are ``infer.kernels.ISAS`` names; ``all`` builds every one this CPU can run (the
tests compare them); none builds ``INFER_KERNEL_ISA``'s, else this CPU's own."""

import sys

from infer.kernels import build_dir, isa, ops_for, runnable_isas

targets = sys.argv[1:] or [isa()]
if targets == ["all"]:
    targets = runnable_isas()
for target in targets:
    ops_for(target)
    print(f"infer kernels ({target}) ready in {build_dir(target)}")
