"""Server metrics, exposed in the Prometheus text format (0.0.4) by ``prometheus-client``.

Counters and histograms live on the event loop thread only (request tasks update them), so
they need no locks. Each app has its own registry (no global state); a collector turns the
counts into metric families when scraped, and reads the running/waiting gauges then.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
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

    def family(self) -> HistogramMetricFamily:
        """The histogram as a ``prometheus-client`` metric family."""
        cumulative, buckets = 0, []
        for bound, n in zip([*self.bounds, math.inf], self.counts, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
        return HistogramMetricFamily(self.name, self.help_text, buckets=buckets, sum_value=self.sum)

    def render(self) -> list[str]:
        """The histogram's exposition lines."""
        return _expose([self.family()]).splitlines()


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
        self.stream_resumes = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0  # of requests that ended
        self.cached_prompt_tokens = 0  # of those, what the prefix cache served
        # running, waiting, ready, KV cache counters: set by each render
        self._live: tuple[int, int, bool, Mapping[str, int] | None] = (0, 0, False, None)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        """The registry's collector interface: this scrape's families."""
        yield from self.families(*self._live)

    def render(
        self, running: int, waiting: int, ready: bool, cache: Mapping[str, int] | None = None
    ) -> str:
        """The whole exposition text.

        Args:
            running: Requests in the engine's running batch.
            waiting: Requests queued for the engine.
            ready: Whether the engine loop is up.
            cache: The engine's KV cache counters (:meth:`Engine.cache_stats`), once loaded.

        Returns:
            Text for a ``text/plain; version=0.0.4`` response.
        """
        self._live = (running, waiting, ready, cache)
        return generate_latest(self.registry).decode("utf-8")

    def families(
        self, running: int, waiting: int, ready: bool, cache: Mapping[str, int] | None = None
    ) -> list[Metric]:
        """Every metric as a ``prometheus-client`` family, in exposition order."""
        finished = CounterMetricFamily(
            "infer_requests", "Requests that ended, by finish reason.", labels=["finish_reason"]
        )
        for reason, n in sorted(self.finished.items()):
            finished.add_metric([reason], n)
        rejected = CounterMetricFamily(
            "infer_requests_rejected",
            "Requests refused before generating, by code.",
            labels=["code"],
        )
        for code, n in sorted(self.rejected.items()):
            rejected.add_metric([code], n)
        return [
            GaugeMetricFamily("infer_requests_running", "Requests being generated.", running),
            GaugeMetricFamily("infer_requests_waiting", "Requests queued for the engine.", waiting),
            GaugeMetricFamily(
                "infer_ready", "1 when the model is loaded and the engine runs.", int(ready)
            ),
            finished,
            rejected,
            CounterMetricFamily(
                "infer_client_disconnects",
                "Streams whose client went away before the end.",
                self.client_disconnects,
            ),
            CounterMetricFamily(
                "infer_generated_tokens", "Tokens generated for clients.", self.generated_tokens
            ),
            CounterMetricFamily(
                "infer_prompt_tokens",
                "Prompt tokens of requests that ended.",
                self.prompt_tokens,
            ),
            CounterMetricFamily(
                "infer_prompt_tokens_cached",
                "Prompt tokens of requests that ended that the prefix cache served.",
                self.cached_prompt_tokens,
            ),
            CounterMetricFamily(
                "infer_stream_resumes",
                "Native streams read again by request_id (a reconnect or a takeover).",
                self.stream_resumes,
            ),
            self.ttft.family(),
            self.itl.family(),
            *_cache_families(cache or dict.fromkeys(CACHE_METRICS, 0)),
            *_gateway_families(running, waiting, cache),
        ]


# The engine's KV cache counters: name → (type, help).
CACHE_METRICS = {
    "infer_kv_blocks_used": ("gauge", "KV cache blocks held by requests."),
    "infer_kv_blocks_total": ("gauge", "KV cache blocks in the pool."),
    "infer_prefix_cache_hits_total": ("counter", "Prompt blocks found in the prefix cache."),
    "infer_prefix_cache_queries_total": ("counter", "Prompt blocks looked up in the prefix cache."),
    "infer_preemptions_total": ("counter", "Requests preempted (recomputed later) for KV room."),
    "infer_draft_tokens_total": ("counter", "Draft tokens verified (speculative decoding)."),
    "infer_draft_tokens_accepted_total": ("counter", "Draft tokens the model agreed with."),
}


def _cache_families(cache: Mapping[str, int]) -> list[Metric]:
    drafted = cache["infer_draft_tokens_total"]
    return [
        *(
            (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, help_text, value=cache[name]
            )
            for name, (kind, help_text) in CACHE_METRICS.items()
        ),
        GaugeMetricFamily(
            "infer_draft_acceptance_rate",
            "Share of verified draft tokens the model agreed with, 0 to 1 (0 before any).",
            cache["infer_draft_tokens_accepted_total"] / drafted if drafted else 0.0,
        ),
    ]


class _Families:
    """A collector that yields fixed families (a lone histogram's exposition)."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def _expose(families: Sequence[Metric]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode("utf-8")


def _gateway_families(
    running: int, waiting: int, cache: Mapping[str, int] | None
) -> list[GaugeMetricFamily]:
    """The three gauges the Kubernetes inference gateway's model-server protocol reads (vLLM's
    names), so llm-d or KServe can route to this server as they route to vLLM."""
    used = cache.get("infer_kv_blocks_used", 0) if cache else 0
    total = cache.get("infer_kv_blocks_total", 0) if cache else 0
    return [
        GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests queued (as vLLM names it).", waiting
        ),
        GaugeMetricFamily(
            "vllm:num_requests_running", "Requests running (as vLLM names it).", running
        ),
        GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "Share of KV cache blocks in use, 0 to 1 (as vLLM names it).",
            used / total if total else 0.0,
        ),
    ]
