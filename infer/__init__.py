"""infer: a small LLM inference server with its own models, a batched engine and SSE streams.

Importing it sets nothing: the ``infer`` command sets how OpenMP waits
(:func:`infer.cli.quiet_openmp`) before torch loads.
"""

__version__ = "0.1.0"
