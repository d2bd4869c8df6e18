"""The KV cache: tokens processed and time with and without it, and the memory it costs.

    python experiments/kv_cache.py [--max-new-tokens 200]

1. Counting: a 3-token prompt and 4 new tokens, generated both ways on the real model (without a
   cache every step rereads the whole growing sequence; with one, each token is read once).
2. Timing: greedy generation of --max-new-tokens tokens both ways -- uncached = `jaxinfer.logits`
   over the growing sequence each step, cached = `jaxinfer.generate` -- same output tokens,
   cumulative time and the ratio as the sequence grows.
3. Memory: 2 x L x K x H x bytes per token for several models, and the bytes of a cache our own
   prefill allocated and filled (measured arrays vs the formula).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `experiments` and `jaxinfer` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from experiments.common import fmt_bytes, plt  # noqa: E402

COUNT_PROMPT = "The cat sat"  # 3 tokens under SmolLM2's tokenizer
TIME_PROMPT = "The capital of France is"


def count_both_ways(m, prompt: str, new_tokens: int) -> dict:
    """Generate `new_tokens` greedily with and without the cache; count the tokens each reads."""
    import jaxinfer
    from jaxinfer.inspect import probes

    ids = m.tokenizer.encode(prompt)
    uncached, read_uncached = probes.greedy_uncached(m, ids, new_tokens)
    # chunk_size = n - 1: exactly n - 1 decode steps run, each reading one token per row.
    out = jaxinfer.generate(m, [ids], max_new_tokens=new_tokens, stop_at_eos=False,
                            chunk_size=max(1, new_tokens - 1))
    cached = out.completions[0].token_ids
    decode_steps = max(1, new_tokens - 1) * (1 if new_tokens > 1 else 0)
    read_cached = out.timings.prompt_tokens + decode_steps
    return {"prompt": prompt, "prompt_tokens": len(ids), "new_tokens": new_tokens,
            "total_tokens": len(ids) + new_tokens,
            "tokens_read_uncached": read_uncached, "tokens_read_cached": read_cached,
            "formula_uncached": probes.tokens_processed(len(ids), new_tokens, cached=False),
            "formula_cached": probes.tokens_processed(len(ids), new_tokens, cached=True),
            "same_tokens": uncached == cached, "text": m.tokenizer.decode(cached)}


def time_both_ways(m, prompt: str, new_tokens: int, chunk: int) -> dict:
    """Cumulative wall time to produce each token, uncached vs cached, after a warm-up of both."""
    import jaxinfer
    from jaxinfer.inspect import probes
    from jaxinfer.decode.generate import bucket

    ids = m.tokenizer.encode(prompt)
    kw = dict(max_new_tokens=new_tokens, stop_at_eos=False, chunk_size=chunk)
    for b in sorted({bucket(n) for n in range(len(ids), len(ids) + new_tokens)}):  # compile each bucket
        jaxinfer.logits(m, ids * (b // len(ids)) + ids[: b % len(ids)]).block_until_ready()
    jaxinfer.generate(m, [ids], **kw)  # compile prefill and the decode chunk for these shapes

    t_unc = []
    t0 = time.perf_counter()
    unc, _ = probes.greedy_uncached(m, ids, new_tokens, on_step=lambda s, t: t_unc.append(time.perf_counter() - t0))
    t_cac, n_cac = [], []

    def seen(rows):
        n_cac.append((n_cac[-1] if n_cac else 0) + len(rows[0]))
        t_cac.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    out = jaxinfer.generate(m, [ids], on_tokens=seen, **kw)
    cac = out.completions[0].token_ids
    points = [{"tokens": min(n, new_tokens), "uncached_s": t_unc[min(n, new_tokens) - 1], "cached_s": t}
              for n, t in zip(n_cac, t_cac)]
    for p in points:
        p["ratio"] = p["uncached_s"] / p["cached_s"]
    return {"prompt": prompt, "prompt_tokens": len(ids), "new_tokens": new_tokens, "chunk_size": chunk,
            "same_tokens": unc == cac, "first_difference": next((i for i, (a, b) in enumerate(zip(unc, cac)) if a != b), None),
            "uncached_cumulative_s": t_unc, "points": points,
            "uncached_total_s": t_unc[-1], "cached_total_s": t_cac[-1],
            "cached_decode_tokens_per_s": out.timings.decode_tokens_per_s,
            "text": m.tokenizer.decode(cac)}


def memory_table(m) -> dict:
    """Bytes per token by the formula for several models, and a cache our own prefill filled."""
    import jax
    import jax.numpy as jnp

    import jaxinfer
    from jaxinfer.model import config as C
    from jaxinfer.model import forward as mdl

    rows = []
    for cfg, dt in [(C.smollm2_135m(), "float16"), (C.llama3_8b(), "float16"), (C.llama3_70b(), "float16"),
                    (C.llama31_405b(), "float16"), (m.config, m.config.dtype)]:
        bpt = jaxinfer.bytes_per_token(cfg, dt)
        rows.append({"model": cfg.name, "dtype": dt, "L": cfg.n_layers, "K": cfg.n_kv_heads, "H": cfg.head_dim,
                     "bytes_per_token": bpt, "bytes_at_8192": bpt * 8192,
                     "max_context": cfg.max_seq_len, "bytes_at_max_context": bpt * cfg.max_seq_len})
    # A real cache: allocate, fill it with a prefill through the model's own forward, measure.
    ids = m.tokenizer.encode(TIME_PROMPT)
    S = 256
    cache = jaxinfer.init_cache(m.config, 1, S)
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    fwd = jax.jit(mdl.forward, static_argnames=("cfg",))
    _, cache = fwd(m.params, tokens, positions, cache, cfg=m.config)
    measured = int(cache.k.nbytes) + int(cache.v.nbytes)
    _, n_pages, page_size = cache.k.shape[:3]  # the pool: S positions in pages, plus page 0 (the trash page)
    formula = jaxinfer.bytes_per_token(m.config, cache.k.dtype) * n_pages * page_size
    filled = int(np.asarray(cache.lengths)[0])
    layer0 = np.asarray(cache.k[0]).reshape(n_pages * page_size, -1)
    written = int(np.count_nonzero(np.abs(layer0).sum(axis=-1)))
    return {"rows": rows, "our_cache": {"model": m.config.name, "dtype": str(cache.k.dtype), "shape": list(cache.k.shape),
                                        "slots": S, "positions_in_pool": n_pages * page_size, "trash_pages": 1,
                                        "filled": filled, "slots_written_layer0": written,
                                        "measured_nbytes": measured, "formula_bytes": formula,
                                        "equal": measured == formula}}


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, default=200, help="length of the timed generation (default %(default)s)")
    p.add_argument("--chunk", type=int, default=8, help="decode steps per streamed chunk = timing resolution (default %(default)s)")
    args = p.parse_args(argv)
    if args.smoke:
        args.max_new_tokens, args.chunk = min(args.max_new_tokens, 7), min(args.chunk, 3)  # shapes of the counting run
    if args.max_new_tokens < 2 or args.chunk < 1:
        p.error("--max-new-tokens must be >= 2 and --chunk >= 1")
    m = common.load_model(args, model)

    count = count_both_ways(m, COUNT_PROMPT, 4)
    print(f"1. counting: {count['prompt_tokens']}-token prompt {count['prompt']!r} + {count['new_tokens']} new tokens "
          f"= {count['total_tokens']} tokens; continuation {count['text']!r}")
    print(f"   tokens read by the model: {count['tokens_read_cached']} with the cache vs "
          f"{count['tokens_read_uncached']} without (formula {count['formula_cached']} vs {count['formula_uncached']}); "
          f"same tokens: {count['same_tokens']}")

    print(f"2. timing {args.max_new_tokens} new tokens both ways (uncached rereads the sequence every step) ...", flush=True)
    timing = time_both_ways(m, TIME_PROMPT, args.max_new_tokens, args.chunk)
    pts = timing["points"]
    marks = [pts[0], pts[len(pts) // 2], pts[-1]] if len(pts) > 2 else pts
    print(f"   same output tokens: {timing['same_tokens']}; text {timing['text'][:60]!r}")
    for q in marks:
        print(f"   after {q['tokens']:4d} tokens: uncached {q['uncached_s']:7.2f} s, cached {q['cached_s']:6.2f} s, "
              f"ratio {q['ratio']:.2f}x")

    mem = memory_table(m)
    print("3. KV-cache memory, 2 x L x K x H x bytes per token:")
    print(f"   {'model':16s} {'dtype':8s} {'L':>4s} {'K':>3s} {'H':>4s} {'bytes/token':>12s} {'at 8,192 tokens':>16s} {'at max context':>22s}")
    for r in mem["rows"]:
        print(f"   {r['model']:16s} {r['dtype']:8s} {r['L']:4d} {r['K']:3d} {r['H']:4d} {r['bytes_per_token']:12,d} "
              f"{fmt_bytes(r['bytes_at_8192']):>16s} {fmt_bytes(r['bytes_at_max_context']):>12s} @ {r['max_context']:,}")
    oc = mem["our_cache"]
    print(f"   our prefill's cache {oc['shape']} {oc['dtype']}: measured {oc['measured_nbytes']:,} bytes, "
          f"formula {oc['formula_bytes']:,} ({oc['positions_in_pool']} positions: {oc['slots']} + one trash page) -> "
          f"equal: {oc['equal']} ({oc['filled']} slots filled)")

    fig, (a0, a1, a2) = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1, 1.2, 1.1]})
    n = np.arange(1, args.max_new_tokens + 1)
    P = timing["prompt_tokens"]
    a0.plot(n, [P * k + k * (k - 1) // 2 for k in n], label="without cache")
    a0.plot(n, [P + k - 1 for k in n], label="with cache")
    a0.set_title(f"tokens read, formula (counted in the run for 4 new: {count['tokens_read_uncached']} vs {count['tokens_read_cached']})", fontsize=9)
    a0.set_xlabel("new tokens")
    a0.set_ylabel("tokens read by the model")
    a0.legend(fontsize=8)
    a1.plot(np.arange(1, len(timing["uncached_cumulative_s"]) + 1), timing["uncached_cumulative_s"], label="without cache (jaxinfer.logits)")
    a1.plot([q["tokens"] for q in pts], [q["cached_s"] for q in pts], marker=".", label="with cache (jaxinfer.generate)")
    a1.set_xlabel("new tokens")
    a1.set_ylabel("cumulative seconds")
    a1.set_title(f"{m.config.name} on {common.environment()['backend']}: measured, same tokens: {timing['same_tokens']}", fontsize=9)
    a1.legend(fontsize=8, loc="upper left")
    r = a1.twinx()
    r.plot([q["tokens"] for q in pts], [q["ratio"] for q in pts], color="gray", ls=":", label="ratio")
    r.set_ylabel("time ratio without / with", color="gray")
    rows = mem["rows"][::-1]
    gib = [x["bytes_at_8192"] / 2 ** 30 for x in rows]
    a2.barh(range(len(rows)), gib, color="#72b7b2")
    a2.set_yticks(range(len(rows)), [f"{x['model']}\n{x['dtype']}" for x in rows], fontsize=8)
    for i, x in enumerate(rows):
        a2.text(gib[i], i, f" {fmt_bytes(x['bytes_at_8192'])} ({x['bytes_per_token'] / 1024:,.1f} KiB/token)",
                va="center", fontsize=8)
    a2.set_xlim(0, max(gib) * 1.9)
    a2.set_xlabel("KV cache at 8,192 tokens, GiB")
    a2.set_title("memory: 2 x L x K x H x bytes per token", fontsize=9)
    fig.tight_layout()
    result = {"counting": count, "timing": timing, "memory": mem}
    common.save("kv_cache", fig, result, args)
    return result


if __name__ == "__main__":
    main()
