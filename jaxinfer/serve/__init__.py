"""Serving many requests: continuous batching over a paged KV pool with prefix caching.

  pages.py      host-side page allocator and prefix cache (pure Python)
  paged.py      the paged KV cache pytree that `forward` reads and writes
  scheduler.py  admission, chunked prefill, preemption (pure Python)
  request.py    Request (stream / async stream / result / cancel) and Delta
  engine.py     Engine: submit, step, run_until_idle, start/stop, warmup, stats
  protocol.py, structured.py, responses.py, server.py   `jaxinfer serve`: OpenAI's HTTP API over the
                the Engine (structured.py: response_format, guided_*, tools -> a constraint)
"""

from jaxinfer.serve.engine import Engine, EngineStats
from jaxinfer.serve.request import Delta, Request

__all__ = ["Engine", "EngineStats", "Request", "Delta"]
