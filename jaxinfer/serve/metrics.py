"""GET /metrics: the engine's stats and the server's counters and histograms as Prometheus text."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


# The engine's stats (EngineStats fields) -> metric names (without the jaxinfer_ prefix).
METRIC_NAMES = {"running": "requests_running", "waiting": "requests_waiting", "pages_total": "kv_pages_total",
                "pages_in_use": "kv_pages_in_use", "pages_cached": "kv_pages_cached", "pages_free": "kv_pages_free",
                "prefix_hit_pages": "prefix_cache_hit_pages_total", "prefix_hit_tokens": "prefix_cache_hit_tokens_total",
                "tokens_generated": "generated_tokens_total", "requests_finished": "requests_finished_total",
                "preemptions": "preemptions_total", "steps": "engine_steps_total", "pool_bytes": "kv_pool_bytes",
                "compiles": "serving_compiles_total"}


def engine_stats(engine) -> dict:
    """The engine's gauges and counters under their metric names (stats() is a dataclass or a dict)."""
    s = engine.stats()
    s = dataclasses.asdict(s) if dataclasses.is_dataclass(s) else dict(s)
    return {METRIC_NAMES[k]: v for k, v in s.items() if k in METRIC_NAMES}


def render(stats: dict, in_flight: int, counts: dict, ttft: Histogram, tpot: Histogram,
           rejected: Optional[Mapping[tuple[int, str], int]] = None) -> str:
    """Prometheus text exposition format (version 0.0.4), every name prefixed jaxinfer_.

    Args:
      stats: the engine's metrics (`engine_stats`).
      in_flight: engine requests the server has submitted and not finished.
      counts: the server's counters, exposed as jaxinfer_http_<name>.
      ttft, tpot: time to first token and time per output token.
      rejected: refused requests per (HTTP status, error code), exposed as
        jaxinfer_requests_rejected_total{status, code}.
    Returns:
      the text of GET /metrics.
    """
    lines = []
    for k, v in stats.items():
        lines += [f"# TYPE jaxinfer_{k} {'counter' if k.endswith('_total') else 'gauge'}", f"jaxinfer_{k} {v}"]
    lines += ["# TYPE jaxinfer_http_in_flight gauge", f"jaxinfer_http_in_flight {in_flight}"]
    for k, v in counts.items():
        lines += [f"# TYPE jaxinfer_http_{k} counter", f"jaxinfer_http_{k} {v}"]
    lines += ["# TYPE jaxinfer_requests_rejected_total counter"]
    lines += [f'jaxinfer_requests_rejected_total{{status="{status}",code="{_label(code)}"}} {n}'
              for (status, code), n in sorted((rejected or {}).items())]
    lines += ttft.lines("jaxinfer_time_to_first_token_seconds")
    lines += tpot.lines("jaxinfer_time_per_output_token_seconds")
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
