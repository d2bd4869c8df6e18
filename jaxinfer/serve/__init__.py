"""Serving many requests: continuous batching on the decode core, over a paged KV pool with prefix caching.

  pages.py      host-side page allocator and prefix cache (pure Python)
  scheduler.py  admission, chunked prefill, preemption, the chunks of one call (pure Python)
  runner.py     the device side: the pool, the core's mixed, decode and scoring calls
  buckets.py, slot_tables.py, call_programs.py, warmup.py, step_results.py   its parts: call shapes,
                packed slot tables, the jitted programs, building them ahead of time, the results
  live.py       a running request's host state: tokens, detokenizing, stop strings, deltas
  request.py    Request (stream / async stream / result / cancel) and Delta
  engine.py     Engine: submit, step, run_until_idle, start/stop, warmup, stats, fault recovery,
                update_params (new weights between steps: updates.py)
  http_api.py   `jaxinfer serve`: OpenAI's HTTP API over the Engine; its parts: protocol.py (a body ->
                a Job) with fields.py, prompts.py, extensions.py, structured.py (response_format,
                guided_*, tools -> a constraint) and api_errors.py; http_checks.py, server_state.py,
                generation.py, responses.py, metrics.py, listen.py (the socket and uvicorn)
"""

from jaxinfer.serve.engine import Engine, EngineStats
from jaxinfer.serve.request import Delta, Request

__all__ = ["Engine", "EngineStats", "Request", "Delta"]
