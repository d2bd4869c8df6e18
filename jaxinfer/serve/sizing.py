"""The KV pool's size, and the engine's reports: at start-up, and its counts while it runs.

A pool is sized once, before anything is built: from `kv_memory` bytes, from `n_pages`, or by
default from a memory budget that does not change between starts (`default_kv_memory`), rounded
down to one of a few fixed sizes (`pool_size`). Every program's shapes follow the pool's, so
later starts and other Engines of the model get the same shapes and the persistent compile cache
serves them. `StartupReport` is what an engine holds and what building its programs cost.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
import numpy as np

from jaxinfer.model import cache as kv
from jaxinfer.model.model import Model
from jaxinfer.model.params import nbytes as params_nbytes
from jaxinfer.serve.pages import PagePool
from jaxinfer.serve.runner import Runner

CPU_MEMORY_FRACTION = 0.10  # default KV pool on a CPU: this share of the host's physical memory
DEVICE_MEMORY_FRACTION = 0.85  # default KV pool on an accelerator: this share of its memory less the weights
FREE_MEMORY_CAP = 0.95  # ... and never more than this share of the accelerator's memory free at that moment


def default_kv_memory(model: Model) -> int:
    """The KV pool's default byte budget, from what does not change between starts: on an
    accelerator DEVICE_MEMORY_FRACTION of its memory less this model's weights (at most what is
    free now), on a CPU CPU_MEMORY_FRACTION of the host's physical memory (at most half of what
    is available now). A budget from the memory free at that moment would move with every start
    and every Engine (the first Engine's pool is gone from the second's), and every program's
    shapes with it."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        limit, in_use = stats["bytes_limit"], stats.get("bytes_in_use", 0)
        weights = sum(s.data.nbytes for leaf in jax.tree.leaves(model.params) if isinstance(leaf, jax.Array)
                      for s in leaf.addressable_shards if s.device == dev)
        return int(min(DEVICE_MEMORY_FRACTION * (limit - weights), FREE_MEMORY_CAP * (limit - in_use)))
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total, available = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        total = available = 8 << 30
    return int(min(CPU_MEMORY_FRACTION * total, 0.5 * available))


def pool_size(n_pages: int) -> int:
    """The largest of the fixed pool sizes (2^k and 3 x 2^(k-1) pages) that is <= n_pages.

    A default pool takes one of these sizes, so a budget that moves a little (the memory free,
    another Engine's pool) keeps the same shapes and the compile cache serves them; it gives up
    at most a third of the budget."""
    if n_pages < 2:
        return n_pages
    p = 1 << (n_pages.bit_length() - 1)
    return p + p // 2 if p + p // 2 <= n_pages else p


def size_pool(model: Model, *, max_slots: int, page_size: int, kv_memory: Optional[int],
              n_pages: Optional[int], max_len: Optional[int]) -> tuple[int, int]:
    """The pool's pages (the trash page included) and the longest context of one request, from
    `Engine`'s arguments of the same names (see there).

    Raises:
      ValueError: both kv_memory and n_pages, a bad kv_memory or max_len, or a pool under 2 pages.
    """
    cfg = model.config
    if kv_memory is not None and n_pages is not None:
        raise ValueError("pass kv_memory (bytes) or n_pages, not both")
    if max_len is not None and not (isinstance(max_len, int) and 0 < max_len <= cfg.max_seq_len):
        raise ValueError(f"max_len must be an int in [1, {cfg.max_seq_len}] (the context length), got {max_len!r}")
    want_len = cfg.max_seq_len if max_len is None else max_len
    bpt = kv.bytes_per_token(cfg)
    if n_pages is None:
        if kv_memory is not None and not (isinstance(kv_memory, (int, float)) and kv_memory > 0
                                          and np.isfinite(kv_memory)):
            raise ValueError(f"kv_memory must be a positive number of bytes, got {kv_memory!r}")
        if kv_memory is not None:
            n_pages = int(kv_memory) // (bpt * page_size)  # the whole pool, trash page included
        else:
            n_pages = min(pool_size(default_kv_memory(model) // (bpt * page_size)),
                          (max_slots * want_len + page_size) // page_size)
    if n_pages < 2:
        raise ValueError(f"the pool needs at least 2 pages (one is the trash page), got {n_pages} "
                         f"(kv_memory={kv_memory!r} at {bpt} bytes per token, page_size={page_size})")
    return n_pages, min(want_len, (n_pages - 1) * page_size)


def requests_that_fit(pool: PagePool, n_tokens: int) -> int:
    """How many requests of n_tokens (prompt + new) the whole pool holds at once."""
    return pool.capacity // kv.pages_for(n_tokens, pool.page_size)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics."""

    running: int  # requests holding a slot (prefilling or decoding)
    waiting: int  # queued (including preempted ones)
    pages_total: int  # allocatable pages in the pool
    pages_in_use: int  # held by requests
    pages_cached: int  # unreferenced, kept by the prefix cache (evictable)
    pages_free: int
    prefix_hit_pages: int  # pages taken from the prefix cache, total
    prefix_hit_tokens: int  # prompt tokens not recomputed thanks to it, total
    tokens_generated: int
    requests_finished: int
    requests_failed: int  # ended by an error: an engine fault, or its constraint engine giving up
    preemptions: int
    steps: int
    scans: int  # decode scans run (host syncs of the decode loop)
    page_size: int
    bytes_per_token: int  # KV bytes of one token (k and v, all layers, scales included)
    pool_bytes: int
    call_rows: int  # a device call's fixed cost in token rows, as prompt chunks are scheduled (measured at warmup)
    compiles: int  # programs built by `step` and `submit` (after `warmup`: 0)
    healthy: bool


@dataclasses.dataclass(frozen=True)
class StartupReport:
    """An Engine at start-up (`Engine.startup_report`, printed by `jaxinfer serve`)."""

    weights_bytes: int
    pool_bytes: int  # the KV pool (its trash page included)
    pool_tokens: int  # tokens the pool holds for requests (pages x page_size, the trash page not counted)
    page_size: int
    bytes_per_token: int
    max_len: int
    fits: dict  # request length -> how many of them the pool holds at once
    programs: int  # programs built
    pending: int  # programs a background warmup still builds
    compiled: int  # XLA executables compiled afresh
    loaded: int  # ... loaded from the persistent compile cache
    in_memory: int  # programs this process had built already (another Engine of the same shapes)
    compile_seconds: float  # building them, summed over the threads that did
    warmup_seconds: float  # wall time of the warmup
    compile_cache: Optional[str]  # the persistent compile cache's folder (None: off)

    def __str__(self) -> str:
        fits = ", ".join(f"{k} x {n}" for n, k in self.fits.items())
        programs = f"programs {self.programs} (compiled {self.compiled}, loaded from cache {self.loaded}"
        programs += f", in memory {self.in_memory}" if self.in_memory else ""
        programs += f", {self.warmup_seconds:.1f} s)"
        programs += f", {self.pending} more building" if self.pending else ""
        return (f"weights {self.weights_bytes / 1e9:.2f} GB, KV pool {self.pool_bytes / 1e9:.2f} GB = "
                f"{self.pool_tokens:,} tokens ({self.pool_tokens // self.page_size:,} pages x {self.page_size}, "
                f"{self.bytes_per_token:,} bytes/token; at once: {fits} tokens), {programs}; compile cache "
                f"{self.compile_cache or 'off'}")


def engine_stats(engine) -> EngineStats:
    """`Engine.stats`: the engine's scheduler, pool and held requests' counters now."""
    s, pool, held = engine.scheduler, engine.pool, engine.held
    queued = engine.admission.inbox.queued()
    return EngineStats(running=len(s.running), waiting=len(s.waiting) + queued,
                       pages_total=pool.capacity, pages_in_use=pool.in_use, pages_cached=pool.cached,
                       pages_free=pool.available() - pool.cached, prefix_hit_pages=pool.hit_pages,
                       prefix_hit_tokens=pool.hit_pages * engine.page_size, tokens_generated=held.tokens_generated,
                       requests_finished=held.requests_finished, requests_failed=held.requests_failed,
                       preemptions=s.preemptions, steps=engine.steps, scans=engine.scans, page_size=engine.page_size,
                       bytes_per_token=kv.bytes_per_token(engine.cfg), pool_bytes=engine.runner.cache.nbytes,
                       call_rows=engine.runner.call_rows, compiles=engine.compiles_while_serving,
                       healthy=engine.dead is None)


def startup_report(model: Model, runner: Runner, pool: PagePool, max_len: int,
                   warmup_seconds: Optional[float]) -> StartupReport:
    """What an engine of this model, runner and pool holds, and what building its programs cost
    (`warmup_seconds`: the last warmup's wall time; None: the programs' own)."""
    r = runner.programs.report()
    page_size = pool.page_size
    return StartupReport(weights_bytes=params_nbytes(model.params), pool_bytes=runner.cache.nbytes,
                         pool_tokens=pool.capacity * page_size, page_size=page_size,
                         bytes_per_token=kv.bytes_per_token(model.config), max_len=max_len,
                         fits={n: requests_that_fit(pool, n) for n in (512, 2048, max_len) if n <= max_len},
                         programs=r.programs, pending=r.pending, compiled=r.compiled, loaded=r.loaded,
                         in_memory=r.in_memory, compile_seconds=r.seconds,
                         warmup_seconds=warmup_seconds if warmup_seconds is not None else r.wall_seconds,
                         compile_cache=jax.config.jax_compilation_cache_dir or None)
