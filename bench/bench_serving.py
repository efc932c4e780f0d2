"""Serving benchmark: the same as ``infer bench`` (``python bench/bench_serving.py --help``).

Kept as a script for those who look for it here; the code lives in ``infer/bench/`` so that
the installed ``infer`` command has it too. Reports go to ``bench/results/``.
"""

import sys

from infer.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
