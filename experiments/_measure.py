"""The measurements every speed runner shares, one definition each (`decode`, `walkthrough
roofline`, `device_check`): bandwidth, matmul peak, model variants, and decode and prefill speed
against the roofline B x bandwidth / (weight bytes + B x KV bytes per row).
"""

from __future__ import annotations

import time
from statistics import median
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from experiments._common import text_ids
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.inspect import roofline
from jaxinfer.model import cache, config, params
from jaxinfer.model import layout as LY
from jaxinfer.model import quantize as Q
from jaxinfer.model.model import Model


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median wall seconds of `repeats` calls of `fn` (`timed`), after one that warms (compiles)."""
    fn()
    run = timed(fn)
    return median(run() for _ in range(repeats))


def bandwidth(n_bytes: int, repeats: int, dtype: str = "float32") -> dict:
    """Memory bandwidth of the default device, bytes/s: the medians of a jitted read of n bytes
    (`sum`) and of a jitted copy (`a + 1`: 2n bytes). The roofline's is the larger: decode mostly
    reads; a GPU's copy comes closer to its datasheet, XLA's CPU copy is compute-bound.

    Args:
      n_bytes: array size; pick it larger than the last-level cache.
      repeats: timed calls per probe (medians).
      dtype: the array's dtype (float32 on a CPU, whose bf16 arithmetic is emulated).
    Returns:
      {"bytes", "dtype", "read_Bps", "copy_Bps", "roofline_Bps"}.
    """
    dt = jnp.dtype(dtype)
    x = jnp.ones((n_bytes // dt.itemsize,), dt)
    read = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    copy = jax.jit(lambda a: a + jnp.asarray(1, dt))
    res = {"bytes": int(x.nbytes), "dtype": dt.name,
           "read_Bps": x.nbytes / median_seconds(lambda: read(x).block_until_ready(), repeats),
           "copy_Bps": 2 * x.nbytes / median_seconds(lambda: copy(x).block_until_ready(), repeats)}
    res["roofline_Bps"] = max(res["read_Bps"], res["copy_Bps"])
    return res


def matmul_peak(n: int, repeats: int, dtype: str = "float32") -> float:
    """FLOP/s of a jitted n x n x n matmul on random data: 2 n^3 / median seconds."""
    ka, kb = jax.random.split(jax.random.key(1))
    a, b = jax.random.normal(ka, (n, n), dtype), jax.random.normal(kb, (n, n), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n ** 3 / median_seconds(lambda: mm(a, b).block_until_ready(), repeats)


def random_model(preset: str, dtype: str, layout: str = "per_layer"):
    """A model of a `jaxinfer.model.config` preset function's shapes with random weights (key 0),
    built on the device, in `layout`: weight values do not matter for speed."""
    cfg = getattr(config, preset)(dtype=dtype)
    p = jax.jit(params.init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), dtype)
    if layout != "stacked":
        p = jax.jit(LY.convert, static_argnums=(1, 2))(p, cfg, layout)
    return Model(config=cfg.replace(layout=layout), params=p)


def variant(model, name: str):
    """`model` as a named variant: "default" (as given), "stacked" / "per_layer" (the float weights
    in that layout), "int8" / "int4" (quantized weights, in the layout `load` gives them: int8
    per_layer off the CPU, else stacked), "int8_stacked", "int8kv" (an int8 KV cache), "fused_attention"
    (prompt chunks through `kernels.prefill_attention`: cuDNN on a GPU, XLA's fused form elsewhere)."""
    import dataclasses

    def to(m, layout):  # one compiled program: eager slicing would dispatch one copy per layer and weight
        if m.config.layout == layout:
            return m
        return dataclasses.replace(m, config=m.config.replace(layout=layout), params=jax.jit(
            LY.convert, static_argnums=(1, 2))(m.params, m.config, layout))

    if name == "default":
        return model
    if name in ("stacked", "per_layer"):
        return to(model, name)
    if name == "int8kv":
        return dataclasses.replace(model, config=model.config.replace(kv_dtype="int8"))
    if name == "fused_attention":
        fused = "cudnn" if jax.default_backend() == "gpu" else "xla"  # "cudnn" falls back by rule per layer
        return dataclasses.replace(model, config=model.config.replace(prefill_attention=fused))
    mode, _, where = name.partition("_")
    if mode not in ("int8", "int4") or where not in ("", "stacked"):
        raise ValueError(f"unknown variant {name!r}: default, stacked, per_layer, int8, int8_stacked, int4, int8kv, "
                         f"fused_attention")
    base = to(model, "stacked")
    q = dataclasses.replace(base, params=jax.jit(Q.quantize, static_argnums=(1, 2))(base.params, base.config, mode))
    return to(q, "per_layer") if mode == "int8" and not where and jax.default_backend() != "cpu" else q


def prompts(model, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of `length` tokens: slices of the held-out text, or random ids without a tokenizer."""
    rng = np.random.default_rng(seed)
    if model.tokenizer is None:
        return [rng.integers(3, model.config.vocab_size, length).tolist() for _ in range(batch)]

    ids = text_ids(model.tokenizer)
    return [ids[s:s + length] for s in rng.integers(0, len(ids) - length, batch).tolist()]


def decode_call(model, batch_prompts, new_tokens: int, chunk: Optional[int] = None) -> Callable[[], float]:
    """A call of `generate` (greedy, no early stop) returning its decode tokens/s."""
    kw = {} if chunk is None else {"chunk_size": chunk}

    def run() -> float:
        return jaxinfer.generate(model, batch_prompts, max_new_tokens=new_tokens, stop_at_eos=False,
                                 **kw).timings.decode_tokens_per_s

    return run


def roofline_row(model, batch: int, tok_s: list[float], filled: float, bandwidth_Bps: float) -> dict:
    """The median of `tok_s` against the decode roofline of `model` at `batch` rows of `filled` tokens."""
    wb, per_row = params.nbytes(model.params), filled * cache.bytes_per_token(model.config)
    roof = roofline.decode_ceiling(bandwidth_Bps, wb, batch=batch, cache_bytes_per_row=per_row)
    med = median(tok_s)
    return {"batch": batch, "tok_s": med, "all_tok_s": list(tok_s), "roofline_tok_s": roof,
            "pct_roofline": 100 * med / roof, "weight_bytes": wb, "kv_bytes_per_row": per_row}


def measure_decode(model, batch: int, *, prompt: int, new_tokens: int, repeats: int, bandwidth_Bps: float,
                   chunk: Optional[int] = None, seed: int = 0) -> dict:
    """Decode tokens/s at `batch` rows of `prompt`-token prompts (the median of `repeats` after the
    call that compiles) against the roofline; with the compiles and seconds of that first call."""
    call = decode_call(model, prompts(model, batch, prompt, seed), new_tokens, chunk)
    t0 = time.perf_counter()
    with CompileCounter() as clock:
        call()
    first = time.perf_counter() - t0
    row = roofline_row(model, batch, [call() for _ in range(repeats)], prompt + new_tokens / 2, bandwidth_Bps)
    return {**row, "compiles": clock.count, "compile_s": clock.seconds, "first_call_s": first}


def prefill_flops(model, tokens: int) -> float:
    """FLOPs of a prefill of T = `tokens` at batch 1: 2 T P_layers + 2 D V + 2 L N H T (T + 1)
    (every layer weight twice per token, the head once, causal attention)."""
    cfg, T = model.config, tokens
    layer_params = sum(int(x.size) for x in jax.tree.leaves(model.params["layers"]))
    return 2 * T * layer_params + 2 * cfg.d_model * cfg.vocab_size + 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * T * (T + 1)


def prefill_call(model, ids: list[int], chunk: Optional[int] = None) -> Callable[[], float]:
    """A call of `generate` on one prompt for one token, returning its prefill seconds (prompt
    read `chunk` tokens per program call; default `generate`'s)."""
    kw = {} if chunk is None else {"prefill_chunk_size": chunk}
    return lambda: jaxinfer.generate(model, [ids], max_new_tokens=1, stop_at_eos=False, **kw).timings.prefill_s


def measure_prefill(model, tokens: int, repeats: int, peak_flops: Optional[float] = None, seed: int = 0,
                    chunk: Optional[int] = None) -> dict:
    """Prefill tokens/s of a `tokens`-token prompt at batch 1 (median of `repeats` after the call
    that compiles; `chunk` tokens per program call, default `generate`'s), with the % of the
    matmul peak when `peak_flops` is given."""
    s = median_seconds(prefill_call(model, prompts(model, 1, tokens, seed)[0], chunk), repeats)
    flops = prefill_flops(model, tokens)
    out = {"tokens": tokens, "batch": 1, "s": s, "tok_s": tokens / s, "flops": flops, "TFLOPs": flops / s / 1e12}
    if chunk is not None:
        out["chunk"] = chunk
    if peak_flops:
        out["pct_peak"] = 100 * flops / s / peak_flops
    return out


def interleaved(calls: dict, repeats: int) -> dict:
    """Each call once (compiles), then `repeats` rounds of every call in turn, the order reversed
    every other round (A B C, C B A, ...), so a noisy neighbour or a drifting clock slows them all
    alike: {name: [results]}."""
    for call in calls.values():
        call()
    out = {name: [] for name in calls}
    for r in range(repeats):
        for name in list(calls) if r % 2 == 0 else list(calls)[::-1]:
            out[name].append(calls[name]())
    return out


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """A call of `fn` (its results waited for) that returns its wall seconds."""
    def run() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - t0

    return run
