"""``python -m infer``: the same as the ``infer`` command."""

from infer.cli import main

raise SystemExit(main())
