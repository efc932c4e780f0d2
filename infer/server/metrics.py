"""Server metrics in the Prometheus text exposition format (version 0.0.4).

Counters and histograms live on the event loop thread only (request tasks update them), so
they need no locks. The running/waiting gauges are read from the worker when scraped.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Mapping, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "eos", "length", "abort", "error")

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class Histogram:
    """A cumulative Prometheus histogram with fixed upper bounds.

    Args:
        name: Metric name (``_bucket``, ``_sum`` and ``_count`` are appended).
        help_text: The ``# HELP`` line.
        buckets: Increasing upper bounds; ``+Inf`` is added.
    """

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help_text = help_text
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Record one observation (negative or NaN values are ignored)."""
        if not value >= 0:
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        """The histogram's exposition lines."""
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip([*self.bounds, math.inf], self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == math.inf else _number(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {cumulative}')
        lines.append(f"{self.name}_sum {_number(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class Metrics:
    """Everything ``GET /metrics`` reports, apart from the live queue gauges."""

    def __init__(self) -> None:
        self.ttft = Histogram(
            "infer_time_to_first_token_seconds",
            "Seconds from receiving a request to its first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "infer_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a stream.",
            ITL_BUCKETS,
        )
        self.finished: Counter[str] = Counter({reason: 0 for reason in FINISH_REASONS})
        self.rejected: Counter[str] = Counter()
        self.client_disconnects = 0
        self.generated_tokens = 0

    def render(self, running: int, waiting: int, ready: bool,
               cache: Mapping[str, int] | None = None) -> str:
        """The whole exposition text.

        Args:
            running: Requests in the engine's running batch.
            waiting: Requests queued for the engine.
            ready: Whether the engine loop is up.
            cache: The engine's KV cache counters (:meth:`Engine.cache_stats`), once loaded.

        Returns:
            Text for a ``text/plain; version=0.0.4`` response.
        """
        lines = [
            *_gauge("infer_requests_running", "Requests being generated.", running),
            *_gauge("infer_requests_waiting", "Requests queued for the engine.", waiting),
            *_gauge("infer_ready", "1 when the model is loaded and the engine runs.", int(ready)),
            "# HELP infer_requests_total Requests that ended, by finish reason.",
            "# TYPE infer_requests_total counter",
            *(f'infer_requests_total{{finish_reason="{reason}"}} {n}'
              for reason, n in sorted(self.finished.items())),
            "# HELP infer_requests_rejected_total Requests refused before generating, by code.",
            "# TYPE infer_requests_rejected_total counter",
            *(f'infer_requests_rejected_total{{code="{code}"}} {n}'
              for code, n in sorted(self.rejected.items())),
            *_counter("infer_client_disconnects_total",
                      "Streams whose client went away before the end.", self.client_disconnects),
            *_counter("infer_generated_tokens_total", "Tokens generated for clients.",
                      self.generated_tokens),
            *self.ttft.render(),
            *self.itl.render(),
            *_cache_lines(cache or dict.fromkeys(CACHE_METRICS, 0)),
        ]
        return "\n".join(lines) + "\n"


# The engine's KV cache counters: name → (type, help).
CACHE_METRICS = {
    "infer_kv_blocks_used": ("gauge", "KV cache blocks held by requests."),
    "infer_kv_blocks_total": ("gauge", "KV cache blocks in the pool."),
    "infer_prefix_cache_hits_total": ("counter", "Prompt blocks found in the prefix cache."),
    "infer_prefix_cache_queries_total": ("counter", "Prompt blocks looked up in the prefix cache."),
    "infer_preemptions_total": ("counter", "Requests preempted (recomputed later) for KV room."),
}


def _cache_lines(cache: Mapping[str, int]) -> list[str]:
    lines = []
    for name, (kind, help_text) in CACHE_METRICS.items():
        lines += (_gauge if kind == "gauge" else _counter)(name, help_text, cache[name])
    return lines


def _gauge(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {_number(value)}"]


def _counter(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {_number(value)}"]


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)
