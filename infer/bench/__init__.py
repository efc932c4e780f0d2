"""The serving benchmark behind ``infer bench``: workloads, load generator, baselines, report.

It lives inside the package so that ``infer bench`` works from any install; the repository's
``bench/bench_serving.py`` is a thin script over :func:`infer.bench.main.main`, and its
``bench/results/`` holds the reports.
"""
