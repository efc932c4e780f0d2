"""infer: a small LLM inference server with its own models, a batched engine and SSE streams."""

import os

# OpenMP's default wait policy spins at barriers. On a 2-core machine where anything else
# runs (the server's event loop thread, a test client, another process), a spinning thread
# waits out a whole scheduler quantum for its descheduled partner (bench/results/LOG.md has
# the figures). PASSIVE makes waiting threads sleep. It must be in the environment before
# torch loads libgomp, so it is set here, before any module imports torch; a value the user
# set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but sleeping between the ~600 parallel regions of a decode step costs a futex wake each.
# A short spin first (libgomp's GOMP_SPINCOUNT overrides PASSIVE's 0) catches the next region
# of the same step and still sleeps through anything longer (served throughput and latency
# both gain; figures in bench/results/LOG.md). Longer spins (10k and up) collapse when
# another process takes a core; `make test` runs with 0.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

__version__ = "0.1.0"
