"""Server metrics, exposed in the Prometheus text format (0.0.4) by ``prometheus-client``.

Counters and histograms live on the event loop thread only (request tasks update them), so
they need no locks. Each served model has its own :class:`Metrics` (no global state); a
scrape turns the counts into metric families, every series labelled with its model, and
reads the running/waiting gauges then.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

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

    def family(self, model: str | None = None) -> HistogramMetricFamily:
        """The histogram as a ``prometheus-client`` metric family (labelled with ``model``)."""
        cumulative, buckets = 0, []
        for bound, n in zip([*self.bounds, math.inf], self.counts, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
        if model is None:
            return HistogramMetricFamily(
                self.name, self.help_text, buckets=buckets, sum_value=self.sum
            )
        family = HistogramMetricFamily(self.name, self.help_text, labels=["model"])
        family.add_metric([model], buckets, self.sum)
        return family

    def render(self) -> list[str]:
        """The histogram's exposition lines."""
        return _expose([self.family()]).splitlines()


class Live(NamedTuple):
    """What a model's metrics read at a scrape: its queue, whether it runs, its KV cache."""

    running: int = 0
    waiting: int = 0
    ready: bool = False
    cache: Mapping[str, int] | None = None  # the engine's counters (:meth:`Engine.cache_stats`)


class Metrics:
    """What ``GET /metrics`` reports of one model, apart from the live gauges (:class:`Live`).

    Every series is labelled with the model's name (``model="..."``); a server of several
    models writes each family once, with a series per model (:func:`exposition`).
    """

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

    def render(self, model: str, live: Live) -> str:
        """The exposition text of this model alone (``text/plain; version=0.0.4``)."""
        return exposition([(model, self, live)])

    def families(self, model: str, live: Live) -> list[Metric]:
        """Every metric as a ``prometheus-client`` family, in exposition order."""
        cache = live.cache or dict.fromkeys(CACHE_METRICS, 0)
        drafted, accepted = cache["infer_draft_tokens_total"], cache[_ACCEPTED]
        used, total = cache["infer_kv_blocks_used"], cache["infer_kv_blocks_total"]
        values = {
            "infer_requests_running": live.running,
            "infer_requests_waiting": live.waiting,
            "infer_ready": int(live.ready),
            "infer_client_disconnects": self.client_disconnects,
            "infer_generated_tokens": self.generated_tokens,
            "infer_prompt_tokens": self.prompt_tokens,
            "infer_prompt_tokens_cached": self.cached_prompt_tokens,
            "infer_stream_resumes": self.stream_resumes,
            **cache,
            "infer_draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "vllm:num_requests_waiting": live.waiting,
            "vllm:num_requests_running": live.running,
            "vllm:kv_cache_usage_perc": used / total if total else 0.0,
        }
        series = {**SERIES, **CACHE_METRICS, **GATEWAY}
        return [
            _counts(
                model,
                "infer_requests",
                "Requests that ended, by finish reason.",
                "finish_reason",
                self.finished,
            ),
            _counts(
                model,
                "infer_requests_rejected",
                "Requests refused before generating, by code.",
                "code",
                self.rejected,
            ),
            *(_one(model, kind, name, text, values[name]) for name, (kind, text) in series.items()),
            self.ttft.family(model),
            self.itl.family(model),
        ]


def exposition(models: Sequence[tuple[str, Metrics, Live]]) -> str:
    """The exposition text of every model: each family once, a series per model."""
    merged: dict[str, Metric] = {}
    for name, metrics, live in models:
        for family in metrics.families(name, live):
            if family.name in merged:
                merged[family.name].samples += family.samples
            else:
                merged[family.name] = family
    return _expose(list(merged.values()))


def _one(model: str, kind: str, name: str, help_text: str, value: float) -> Metric:
    """A family of one series, labelled with the model."""
    family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
        name, help_text, labels=["model"]
    )
    family.add_metric([model], value)
    return family


def _counts(model: str, name: str, help_text: str, label: str, counts: Counter[str]) -> Metric:
    """A counter family with a series per value of ``label``."""
    family = CounterMetricFamily(name, help_text, labels=["model", label])
    for value, n in sorted(counts.items()):
        family.add_metric([model, value], n)
    return family


# Each model's one-series metrics: name → (type, help); then its engine's KV cache counters.
SERIES = {
    "infer_requests_running": ("gauge", "Requests being generated."),
    "infer_requests_waiting": ("gauge", "Requests queued for the engine."),
    "infer_ready": ("gauge", "1 when the model is loaded and its engine runs."),
    "infer_client_disconnects": ("counter", "Streams whose client went away before the end."),
    "infer_generated_tokens": ("counter", "Tokens generated for clients."),
    "infer_prompt_tokens": ("counter", "Prompt tokens (inputs embedded) of requests that ended."),
    "infer_prompt_tokens_cached": (
        "counter",
        "Prompt tokens of requests that ended that the prefix cache served.",
    ),
    "infer_stream_resumes": (
        "counter",
        "Native streams read again by request_id (a reconnect or a takeover).",
    ),
}
CACHE_METRICS = {
    "infer_kv_blocks_used": ("gauge", "KV cache blocks held by requests."),
    "infer_kv_blocks_total": ("gauge", "KV cache blocks in the pool."),
    "infer_prefix_cache_hits_total": ("counter", "Prompt blocks found in the prefix cache."),
    "infer_prefix_cache_queries_total": ("counter", "Prompt blocks looked up in the prefix cache."),
    "infer_preemptions_total": ("counter", "Requests preempted (recomputed later) for KV room."),
    "infer_draft_tokens_total": ("counter", "Draft tokens verified (speculative decoding)."),
    "infer_draft_tokens_accepted_total": ("counter", "Draft tokens the model agreed with."),
    "infer_draft_acceptance_rate": (
        "gauge",
        "Share of verified draft tokens the model agreed with, 0 to 1 (0 before any).",
    ),
}
# The three gauges the Kubernetes inference gateway's model-server protocol reads (vLLM's
# names), so llm-d or KServe can route to this server as they route to vLLM.
GATEWAY = {
    "vllm:num_requests_waiting": ("gauge", "Requests queued (as vLLM names it)."),
    "vllm:num_requests_running": ("gauge", "Requests running (as vLLM names it)."),
    "vllm:kv_cache_usage_perc": (
        "gauge",
        "Share of KV cache blocks in use, 0 to 1 (as vLLM names it).",
    ),
}
_ACCEPTED = "infer_draft_tokens_accepted_total"


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
