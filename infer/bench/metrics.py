"""What one request measured, and the summary of a run: percentiles, throughput, errors.

Definitions (all times from ``time.perf_counter``):

- TTFT: request sent → first token received.
- ITL: gap between consecutive token arrivals, pooled over every request of the run.
- TPOT: per request, (last token − first token) / (tokens − 1); percentiles across requests.
- E2E: request sent → terminal event (``done``, ``error``, ``[DONE]``) received.
- Output tok/s and req/s: completed tokens and requests over the run's wall time (first send
  to last terminal event).
- Follow-up TTFT: the TTFT of the requests a workload names as follow-ups (the later turns of
  a conversation, whose prompt extends an earlier request's: what a prefix cache serves).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 95, 99)
LATENCY_METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


@dataclass
class RequestResult:
    """Timestamps of one request, filled in by whoever ran it (HTTP client or in-process).

    ``token_times`` has one entry per received token event; ``output_tokens`` is the count
    the server reported (``usage``) when it did, else the number of token events.
    """

    start: float
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    expected_tokens: int = 0  # what the request asked for
    error: str | None = None  # an error code (``OVERLOADED``, ``HTTP_503``, ...) or None
    label: str = ""  # the request's label in its workload (``turn 2``)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        if len(t) < 2 or self.output_tokens < 2:
            return None
        return (t[-1] - t[0]) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.end is not None else None


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    """p50/p95/p99/mean of durations given in seconds, in milliseconds (None when empty)."""
    stats: dict[str, float | None] = dict.fromkeys([*(f"p{p}" for p in PERCENTILES), "mean"])
    if values_s:
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        for p in PERCENTILES:
            stats[f"p{p}"] = round(float(np.percentile(ms, p)), 3)
        stats["mean"] = round(float(ms.mean()), 3)
    return stats


def summarize(results: list[RequestResult], follow_ups: Collection[str] = ()) -> dict[str, Any]:
    """The metrics of one run, as plain JSON-ready values.

    Args:
        results: What each request of the run measured.
        follow_ups: Labels of the follow-up requests: with any, ``ttft_follow_up_ms`` is the
            TTFT distribution of the requests that carry one of them.
    """
    done = [r for r in results if r.ok]
    errors = Counter(r.error or "INCOMPLETE" for r in results if not r.ok)
    starts = [r.start for r in results]
    ends = [r.end for r in results if r.end is not None]
    wall = max(ends) - min(starts) if ends and starts else 0.0
    tokens = sum(r.output_tokens for r in done)
    metrics = {
        "requests": len(results),
        "completed": len(done),
        "errors": sum(errors.values()),
        "error_codes": dict(sorted(errors.items())),
        # Completed with fewer tokens than asked (EOS or a stop the system would not ignore):
        # their throughput is not comparable with the others'.
        "short": sum(1 for r in done if r.output_tokens < r.expected_tokens),
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": tokens,
        "wall_s": round(wall, 4),
        "output_tok_s": round(tokens / wall, 3) if wall > 0 else None,
        "req_s": round(len(done) / wall, 4) if wall > 0 else None,
        "ttft_ms": distribution_ms([t for r in done if (t := r.ttft) is not None]),
        "itl_ms": distribution_ms([d for r in done for d in r.itls]),
        "tpot_ms": distribution_ms([t for r in done if (t := r.tpot) is not None]),
        "e2e_ms": distribution_ms([t for r in done if (t := r.e2e) is not None]),
    }
    if follow_ups:
        later = [t for r in done if r.label in follow_ups and (t := r.ttft) is not None]
        metrics["ttft_follow_up_ms"] = distribution_ms(later)
    return metrics
