"""What the HTTP endpoints share: the engine, the model, the limits and the counters."""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from jaxinfer.serve import metrics
from jaxinfer.serve.extensions import MAX_HIDDEN_STATES_BYTES, Extensions


def context_limit(engine) -> int:
    """The most tokens (prompt + max_tokens) one request may hold in `engine`: its max_len, which
    the engine already caps at what its page pool holds."""
    return engine.max_len


@dataclasses.dataclass
class Limits:
    max_slots: int = 8  # requests the engine runs at once
    max_waiting: int = 64  # requests admitted beyond max_slots before a 429
    max_body_bytes: int = 1 << 20
    max_hidden_states_bytes: int = MAX_HIDDEN_STATES_BYTES  # one response's hidden states, encoded


class ServerState:
    """What the endpoints share: the engine, the model, the limits and the counters."""

    def __init__(self, engine, model, model_name: str, api_key: Optional[str], limits: Limits, *,
                 steering_vectors: Optional[dict] = None, saes: Optional[dict] = None):
        self.engine, self.model, self.model_name, self.api_key, self.limits = engine, model, model_name, api_key, limits
        # the `steering` and `hidden_states` extensions, as far as the engine was built for them
        self.extensions = Extensions(steering=getattr(engine, "steering", None), vectors=steering_vectors or {},
                                     saes=saes or {}, hidden_sites=tuple(getattr(engine, "hidden_sites", ())),
                                     max_hidden_states_bytes=limits.max_hidden_states_bytes)
        self.lora_paths: dict[str, str] = {}  # LoRA adapter -> its folder (/v1/models' "root")
        self.in_flight = 0  # engine requests submitted and not finished
        self.ttft, self.tpot = metrics.Histogram(metrics.TTFT_BUCKETS), metrics.Histogram(metrics.TPOT_BUCKETS)
        self.counts = {"requests_total": 0, "requests_cancelled_total": 0, "requests_failed_total": 0,
                       "requests_rejected_total": 0}
        self.rejected: collections.Counter = collections.Counter()  # (status, code) -> refusals
        self.context = context_limit(engine)
        self.healthy = False
