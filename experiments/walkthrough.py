"""The walkthrough: what happens to a prompt, step by step, on the real model, as figures.

    python -m experiments.walkthrough STEP [text]     # STEP: tokens, attention, sampling, kv_cache, roofline
    python -m experiments.walkthrough all --figures experiments/figures   # every step: the docs' pictures

What each step shows: docs/walkthrough.md. The logic lives in the library (`jaxinfer.attention`,
`jaxinfer.inspect.probes`, `jaxinfer.inspect.roofline`) and in `_measure`; a step runs, prints and plots.
"""

from __future__ import annotations

import time
import types

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from experiments import _common, _measure
from experiments._common import plt
from jaxinfer import SamplingParams
from jaxinfer.decode.inputs import bucket
from jaxinfer.inspect import probes
from jaxinfer.inspect import roofline as rl
from jaxinfer.model import config
from jaxinfer.model import forward as mdl
from jaxinfer.model import params as prm
from jaxinfer.text.tokenizer import openai_tokenizer

STEPS = ("tokens", "attention", "sampling", "kv_cache", "roofline")
DEFAULT_TEXT = {"tokens": "The glorptastic llama read inthe news that 2025 had 365 days.",
                "attention": "The cat sat on the mat because it was soft", "sampling": "The capital of France is"}
PROBES = ("inthe", "glorptastic")  # a typo and a word that does not exist
COLORS = ["#fde2a7", "#b9e3c6", "#c8d7f5", "#f6c6d0", "#e0cdf2", "#cfeef0"]
PRESETS = {"Greedy": SamplingParams(temperature=0.0), "Default (T=1)": SamplingParams(temperature=1.0),
           "Wild (T=2)": SamplingParams(temperature=2.0), "Top-p 0.5": SamplingParams(temperature=1.0, top_p=0.5),
           "Top-k 5": SamplingParams(temperature=1.0, top_k=5)}
# Datasheet HBM bandwidths (not measured here): NVIDIA H100 SXM 3.35 TB/s, H200 4.8 TB/s.
VENDOR_BANDWIDTH = {"H100 SXM (spec 3.35 TB/s)": 3.35e12, "H200 (spec 4.8 TB/s)": 4.8e12}


def show(piece: bytes) -> str:
    """A token's text for display: spaces as ·, newlines as ⏎, tabs as →, broken UTF-8 as �."""
    return piece.decode("utf-8", errors="replace").replace(" ", "·").replace("\n", "⏎").replace("\t", "→")


# ---- tokens ------------------------------------------------------------------------------------

def split(tokenizer, text: str) -> list[dict]:
    """[{id, piece}] for `text` (special-token text stays plain text)."""
    ids = tokenizer.encode(text, allowed_special=set(), disallowed_special=())
    return [{"id": int(i), "piece": show(p)} for i, p in zip(ids, tokenizer.pieces(ids))]


def tokens(m, args):
    text = args.text or DEFAULT_TEXT["tokens"]
    result = {"text": text, "tokenizers": {}, "probes": {}}
    for name, enc in {"cl100k_base": openai_tokenizer("cl100k_base"), m.config.name: m.tokenizer}.items():
        toks = split(enc, text)
        result["tokenizers"][name] = {"n_tokens": len(toks), "n_chars": len(text), "tokens": toks}
        result["probes"][name] = {w: [t["piece"] for t in split(enc, w)] for w in PROBES}
        print(f"{name}: {len(toks)} tokens: " + " | ".join(t["piece"] for t in toks))
        for w, pieces in result["probes"][name].items():
            print(f"  {w!r} -> {len(pieces)} tokens: {' + '.join(pieces)}")
    width = 44  # characters per line of boxes
    lines = [max(1, -(-sum(max(len(t["piece"]), 1) for t in r["tokens"]) // width))
             for r in result["tokenizers"].values()]
    fig, axes = plt().subplots(len(lines), 1, figsize=(8, 0.9 + 0.55 * sum(lines) + 0.5 * len(lines)),
                               gridspec_kw={"height_ratios": [n + 0.6 for n in lines]})
    for ax, (name, r) in zip(axes, result["tokenizers"].items()):
        x = y = 0
        for j, t in enumerate(r["tokens"]):  # boxes of alternating colour, wrapped at `width` characters
            w = max(len(t["piece"]), 1)
            if x + w > width and x > 0:
                x, y = 0, y + 1
            ax.add_patch(plt().Rectangle((x, -y - 0.8), w, 0.7, facecolor=COLORS[j % len(COLORS)], edgecolor="#555",
                                         lw=0.6))
            ax.text(x + w / 2, -y - 0.45, t["piece"], ha="center", va="center", family="monospace", fontsize=11)
            x += w
        ax.set(xlim=(-0.5, width + 0.5), ylim=(-y - 1.0, 0.1))
        ax.set_title(f"{name}: {r['n_tokens']} tokens", loc="left", fontsize=11)
        ax.axis("off")
    fig.tight_layout()
    return result, fig


# ---- attention ---------------------------------------------------------------------------------

def _find(pieces: list[str], word: str, before=None) -> int:
    for i, p in enumerate(pieces[:before]):
        if p.strip() == word:
            return i
    raise SystemExit(f"no token {word!r} in {pieces[:before]} (tokens are matched whole)")


def attention(m, args):
    sentence = args.text or DEFAULT_TEXT["attention"]
    ids = m.tokenizer.encode(sentence)
    pieces = [b.decode("utf-8", errors="replace") for b in m.tokenizer.pieces(ids)]
    probs = jaxinfer.attention(m, ids)  # [L, N, T, T]
    L, N, T, _ = probs.shape
    future = float(np.triu(probs, k=1).max())  # weight any token gives to a later one
    w = _find(pieces, args.word)
    cands = [_find(pieces, c, before=w) for c in args.candidates.split(",") if c]
    names = [pieces[c].strip() for c in cands]
    from_w = probs[:, :, w, :]  # [L, N, T]
    heads = []
    for o in np.argsort(from_w[:, :, cands].sum(-1).ravel())[::-1][: args.top]:
        layer, head = divmod(int(o), N)
        weights = from_w[layer, head, cands]
        heads.append({"layer": layer, "head": head, "picks": names[int(np.argmax(weights))],
                      "weights": dict(zip(names, weights.tolist())), "first_token_weight": float(from_w[layer, head, 0])})
    votes = {c: sum(h["weights"][c] for h in heads) for c in names}
    winner = max(votes, key=votes.get)
    print(f"{T} tokens: {' | '.join(x.replace(' ', '·') for x in pieces)}; probabilities {list(probs.shape)}")
    print(f"a token only looks back: largest weight on a later token = {future:.1e}")
    for h in heads:
        print(f"  layer {h['layer']:2d} head {h['head']}: " + ", ".join(f"{k} {v:.2f}" for k, v in h["weights"].items()))
    print(f"summed over those {len(heads)} heads, {args.word!r} attends most to {winner!r}")
    best = heads[0]
    fig, (a0, a1) = plt().subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [1.1, 1]})
    im = a0.imshow(probs[best["layer"], best["head"]], cmap="Blues", vmin=0, vmax=1)
    labels = [x.replace(" ", "·") for x in pieces]
    a0.set_xticks(range(T), labels, rotation=60, ha="right", fontsize=8)
    a0.set_yticks(range(T), labels, fontsize=8)
    a0.set(xlabel="attends to (key)", ylabel="token (query)")
    a0.set_title(f"layer {best['layer']}, head {best['head']}: upper triangle is 0 (no look-ahead)", fontsize=9)
    fig.colorbar(im, ax=a0, fraction=0.046)
    for c, name in zip(cands, names):
        a1.plot(range(L), from_w[:, :, c].max(-1), marker="o", ms=3, label=f"{name!r} (max over heads)")
    a1.plot(range(L), from_w[:, :, 0].mean(-1), color="gray", ls=":", label=f"{pieces[0].strip()!r} (first token, mean)")
    a1.set(xlabel="layer", ylabel=f"attention from {args.word!r}", ylim=(0, 1))
    a1.set_title(f"{m.config.name}: where {args.word!r} looks, per layer", fontsize=9)
    a1.legend(fontsize=8)
    fig.tight_layout()
    return {"sentence": sentence, "tokens": pieces, "token_ids": ids, "shape": list(probs.shape),
            "max_weight_on_later_token": future, "max_row_sum_error": float(np.abs(probs.sum(-1) - 1).max()),
            "word": args.word, "candidates": names, "referent_heads": heads, "votes": votes,
            "attends_most_to": winner}, fig


# ---- sampling ----------------------------------------------------------------------------------

def sampling(m, args):
    prompt = args.text or DEFAULT_TEXT["sampling"]
    logits = jaxinfer.logits(m, m.tokenizer.encode(prompt))[-1]  # [V]: what comes after the prompt
    seeds = list(range(args.darts))
    shown = np.argsort(probes.distribution(logits, PRESETS["Default (T=1)"]))[::-1][:6]  # the figure's bars

    def share(t, probs, freq) -> dict:
        return {"id": int(t), "token": show(m.tokenizer.pieces([int(t)])[0]), "p": float(probs[t]),
                "dart_share": float(freq[t])}

    result = {"prompt": prompt, "n_darts": args.darts, "presets": {},
              "shown_tokens": [show(p) for p in m.tokenizer.pieces([int(t) for t in shown])]}
    for label, sp in PRESETS.items():
        probs = probes.distribution(logits, sp)
        darts = probes.throw_darts(logits, sp, seeds)
        counts = np.bincount(darts, minlength=probs.shape[0])
        freq = counts / len(darts)
        r = result["presets"][label] = {
            "tokens_allowed": int((probs > 0).sum()),
            "top": [share(t, probs, freq) for t in np.argsort(probs)[::-1][:args.show] if probs[t] > 0],
            "shown": [share(t, probs, freq) for t in shown],
            "darts_outside_allowed": int(counts[probs == 0].sum()), "distinct_tokens_hit": int((counts > 0).sum()),
            "max_abs_share_minus_p": float(np.abs(freq - probs).max()),
            "same_seeds_same_darts": bool(np.array_equal(darts, probes.throw_darts(logits, sp, seeds))),
            "other_seeds_differ_at": int((darts != probes.throw_darts(logits, sp, [s + args.darts for s in seeds])).sum())}
        print(f"{label}: {r['tokens_allowed']} allowed; " + ", ".join(
            f"{t['token']} {t['p']:.3f}/{t['dart_share']:.3f}" for t in r["top"][:5]) + "  (p / share of darts)")
    fig, axes = plt().subplots(1, len(PRESETS), figsize=(3.0 * len(PRESETS), 3.6), sharey=True)
    for ax, (label, r) in zip(axes, result["presets"].items()):
        x = np.arange(len(shown) + 1)
        ps, fs = [t["p"] for t in r["shown"]], [t["dart_share"] for t in r["shown"]]  # and a last bar, the rest:
        ax.bar(x - 0.2, ps + [max(0.0, 1 - sum(ps))], 0.4, label="probability", color="#4c78a8")
        ax.bar(x + 0.2, fs + [max(0.0, 1 - sum(fs))], 0.4, label=f"{args.darts} darts", color="#f58518")
        ax.set_xticks(x, [t["token"] for t in r["shown"]] + ["other"], rotation=60, ha="right", fontsize=8)
        ax.set_title(f"{label}\n{r['tokens_allowed']} token{'s' if r['tokens_allowed'] > 1 else ''} allowed", fontsize=9)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("probability / share of darts")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{m.config.name}: next token after {prompt!r}", fontsize=10)
    fig.tight_layout()
    return result, fig


# ---- kv_cache ----------------------------------------------------------------------------------

def _count(m, prompt: str, new: int) -> dict:
    """Generate `new` tokens greedily with and without the cache; count the tokens each reads."""
    ids = m.tokenizer.encode(prompt)
    uncached, read_uncached = probes.greedy_uncached(m, ids, new)
    # chunk_size = new - 1: exactly new - 1 decode steps run, each reading one token per row
    out = jaxinfer.generate(m, [ids], max_new_tokens=new, stop_at_eos=False, chunk_size=max(1, new - 1))
    return {"prompt": prompt, "prompt_tokens": len(ids), "new_tokens": new, "total_tokens": len(ids) + new,
            "tokens_read_uncached": read_uncached, "tokens_read_cached": out.timings.prompt_tokens + new - 1,
            "formula_uncached": probes.tokens_processed(len(ids), new, cached=False),
            "formula_cached": probes.tokens_processed(len(ids), new, cached=True),
            "same_tokens": uncached == out.completions[0].token_ids}


def _time(m, prompt: str, new: int, chunk: int) -> dict:
    """Cumulative wall time to each token, uncached vs cached, after a warm-up of both."""
    ids = m.tokenizer.encode(prompt)
    kw = {"max_new_tokens": new, "stop_at_eos": False, "chunk_size": chunk}
    for b in sorted({bucket(n) for n in range(len(ids), len(ids) + new)}):  # compile each bucket
        jaxinfer.logits(m, (ids * b)[:b]).block_until_ready()
    jaxinfer.generate(m, [ids], **kw)
    t_unc, t_cac, n_cac = [], [], []
    t0 = time.perf_counter()
    unc, _ = probes.greedy_uncached(m, ids, new, on_step=lambda s, t: t_unc.append(time.perf_counter() - t0))

    def seen(rows):
        n_cac.append((n_cac[-1] if n_cac else 0) + len(rows[0]))
        t_cac.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    out = jaxinfer.generate(m, [ids], on_tokens=seen, **kw)
    points = [{"tokens": min(n, new), "uncached_s": t_unc[min(n, new) - 1], "cached_s": t,
               "ratio": t_unc[min(n, new) - 1] / t} for n, t in zip(n_cac, t_cac)]
    return {"prompt": prompt, "prompt_tokens": len(ids), "new_tokens": new, "chunk_size": chunk,
            "same_tokens": unc == out.completions[0].token_ids, "uncached_cumulative_s": t_unc, "points": points,
            "cached_decode_tokens_per_s": out.timings.decode_tokens_per_s}


def _memory(m) -> dict:
    """Bytes per token by the formula for several models, and a cache our own prefill filled."""
    rows = []
    for cfg, dt in [(config.smollm2_135m(), "float16"), (config.llama3_8b(), "float16"), (config.llama3_70b(), "float16"),
                    (config.llama31_405b(), "float16"), (m.config, m.config.dtype)]:
        bpt = jaxinfer.bytes_per_token(cfg, dt)
        rows.append({"model": cfg.name, "dtype": dt, "L": cfg.n_layers, "K": cfg.n_kv_heads, "H": cfg.head_dim,
                     "bytes_per_token": bpt, "bytes_at_8192": bpt * 8192})
    ids = m.tokenizer.encode(DEFAULT_TEXT["sampling"])
    fwd = jax.jit(mdl.forward, static_argnames=("cfg",))
    cache = fwd(m.params, jnp.asarray([ids], jnp.int32), jnp.arange(len(ids), dtype=jnp.int32)[None],
                jaxinfer.init_cache(m.config, 1, 256), cfg=m.config).cache
    measured = int(cache.k.nbytes) + int(cache.v.nbytes)
    _, n_pages, page = cache.k.shape[:3]  # 256 positions in pages, plus page 0 (the trash page)
    formula = jaxinfer.bytes_per_token(m.config, cache.k.dtype) * n_pages * page
    return {"rows": rows, "our_cache": {"shape": list(cache.k.shape), "dtype": str(cache.k.dtype), "slots": 256,
                                        "measured_nbytes": measured, "formula_bytes": formula,
                                        "equal": measured == formula}}


def kv_cache(m, args):
    count = _count(m, "The cat sat", 4)
    print(f"counting: {count['tokens_read_cached']} tokens read with the cache, {count['tokens_read_uncached']} "
          f"without (formula {count['formula_cached']} / {count['formula_uncached']}); same: {count['same_tokens']}")
    timing = _time(m, DEFAULT_TEXT["sampling"], args.max_new_tokens, args.chunk)
    pts = timing["points"]
    print(f"timing {args.max_new_tokens} tokens: uncached {pts[-1]['uncached_s']:.2f} s, cached "
          f"{pts[-1]['cached_s']:.2f} s ({pts[-1]['ratio']:.1f}x); same tokens: {timing['same_tokens']}")
    mem = _memory(m)
    for r in mem["rows"]:
        print(f"  {r['model']:16s} {r['dtype']:8s} {r['bytes_per_token']:10,d} bytes/token, "
              f"{r['bytes_at_8192'] / 2**30:,.2f} GiB at 8,192 tokens")
    print(f"  our prefill's cache: measured {mem['our_cache']['measured_nbytes']:,} bytes = formula: "
          f"{mem['our_cache']['equal']}")
    fig, (a0, a1, a2) = plt().subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1, 1.2, 1.1]})
    n = np.arange(1, args.max_new_tokens + 1)
    for cached, name in ((False, "without cache"), (True, "with cache")):
        a0.plot(n, [probes.tokens_processed(timing["prompt_tokens"], int(k), cached=cached) for k in n], label=name)
    a0.set_title(f"tokens read, formula (counted in the run for 4 new: {count['tokens_read_uncached']} vs "
                 f"{count['tokens_read_cached']})", fontsize=9)
    a0.set(xlabel="new tokens", ylabel="tokens read by the model")
    a0.legend(fontsize=8)
    a1.plot(np.arange(1, len(timing["uncached_cumulative_s"]) + 1), timing["uncached_cumulative_s"],
            label="without cache (jaxinfer.logits)")
    a1.plot([q["tokens"] for q in pts], [q["cached_s"] for q in pts], marker=".", label="with cache (jaxinfer.generate)")
    a1.set(xlabel="new tokens", ylabel="cumulative seconds")
    a1.set_title(f"{m.config.name}: measured, same tokens: {timing['same_tokens']}", fontsize=9)
    a1.legend(fontsize=8, loc="upper left")
    r = a1.twinx()
    r.plot([q["tokens"] for q in pts], [q["ratio"] for q in pts], color="gray", ls=":")
    r.set_ylabel("time ratio without / with", color="gray")
    rows = mem["rows"][::-1]
    gib = [x["bytes_at_8192"] / 2 ** 30 for x in rows]
    a2.barh(range(len(rows)), gib, color="#72b7b2")
    a2.set_yticks(range(len(rows)), [f"{x['model']}\n{x['dtype']}" for x in rows], fontsize=8)
    for i, x in enumerate(rows):
        a2.text(gib[i], i, f" {gib[i]:,.2f} GiB ({x['bytes_per_token'] / 1024:,.1f} KiB/token)", va="center", fontsize=8)
    a2.set_xlim(0, max(gib) * 1.9)
    a2.set(xlabel="KV cache at 8,192 tokens, GiB", title="memory: 2 x L x K x H x bytes per token")
    fig.tight_layout()
    return {"counting": count, "timing": timing, "memory": mem}, fig


# ---- roofline ----------------------------------------------------------------------------------

def roofline(m, args):
    batches = sorted({int(b) for b in args.batches.split(",") if b})
    bw = _measure.bandwidth(args.copy_mib * 2 ** 20, repeats=max(3, args.repeats))
    flops = _measure.matmul_peak(256 if args.smoke else 2048, repeats=max(3, args.repeats))
    here = bw["roofline_Bps"]
    big_bytes = rl.weight_bytes(config.llama3_8b(), "float16")
    ceilings = [{"where": k, "bandwidth_Bps": v, "source": "vendor spec" if k in VENDOR_BANDWIDTH else "measured",
                 "weight_bytes": big_bytes, "tokens_per_s": rl.decode_ceiling(v, big_bytes)}
                for k, v in {**VENDOR_BANDWIDTH, "this machine (measured)": here}.items()]
    cfg, wb = m.config, prm.nbytes(m.params)
    prompt = 8
    kv_row = jaxinfer.bytes_per_token(cfg) * (prompt + args.new_tokens / 2)  # at the mean context while decoding
    comp = rl.compute_ceiling(flops, cfg.n_params)
    print(f"this machine: {here / 1e9:.1f} GB/s (read {bw['read_Bps'] / 1e9:.1f}, copy {bw['copy_Bps'] / 1e9:.1f}), "
          f"matmul {flops / 1e9:.0f} GFLOP/s; Llama 3 8B fp16 at batch 1: "
          + ", ".join(f"{c['where']} {c['tokens_per_s']:.1f}" for c in ceilings) + " tokens/s")
    points = []
    for b in batches:
        r = _measure.measure_decode(m, b, prompt=prompt, new_tokens=args.new_tokens, repeats=args.repeats,
                                    bandwidth_Bps=here, chunk=args.new_tokens - 1)
        r["roofline"] = min(r["roofline_tok_s"], comp)
        r["percent_of_roofline"] = 100 * r["tok_s"] / r["roofline"]
        points.append(r)
        print(f"  batch {b:3d}: {r['tok_s']:8.1f} tokens/s, roofline {r['roofline']:8.1f} ({r['percent_of_roofline']:.0f}%)")

    def ceiling(weight_bytes, batch=1) -> float:
        return min(rl.decode_ceiling(here, weight_bytes, batch=batch, cache_bytes_per_row=kv_row), comp)

    own = rl.decode_ceiling(here, wb, cache_bytes_per_row=kv_row)
    result = {"bandwidth": bw, "matmul_flops_per_s": flops, "ceilings_llama3_8b_fp16": ceilings, "measured": points,
              "model": {"name": cfg.name, "dtype": cfg.dtype, "n_params": cfg.n_params, "weight_nbytes": wb,
                        "weight_bytes_formula": rl.weight_bytes(cfg), "kv_bytes_per_token": jaxinfer.bytes_per_token(cfg),
                        "mean_context": prompt + args.new_tokens / 2, "batch1_memory_ceiling": own,
                        "compute_ceiling": comp}}
    fig, (a0, a1) = plt().subplots(1, 2, figsize=(12, 4.4))
    labels = [c["where"].replace(" (", "\n(") for c in ceilings] + [f"this machine\n{cfg.name} {cfg.dtype}"]
    vals = [c["tokens_per_s"] for c in ceilings] + [own]
    a0.bar(range(len(vals)), vals, color=["#9ecae9"] * len(VENDOR_BANDWIDTH) + ["#4c78a8", "#f58518"])
    for i, v in enumerate(vals):
        a0.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    a0.scatter([len(vals) - 1], [points[0]["tok_s"]], marker="D", color="black", zorder=3,
               label=f"measured batch {points[0]['batch']}: {points[0]['tok_s']:.1f}")
    a0.set_xticks(range(len(vals)), labels, fontsize=7)
    a0.set(yscale="log", ylabel="batch-1 decode ceiling, tokens/s (log)")
    a0.set_title("bandwidth / weight bytes (first three: Llama 3 8B fp16)", fontsize=9)
    a0.legend(fontsize=8)
    bs = np.unique(np.geomspace(1, max(64, batches[-1] * 4), 60).round().astype(int))
    for wbytes, ls, name in ((wb, "-", f"roofline {cfg.dtype} (measured bandwidth, FLOP/s)"),
                             (cfg.n_params, "--", "int8 weights (formula)"), (cfg.n_params / 2, ":", "int4 weights (formula)")):
        a1.plot(bs, [ceiling(wbytes, int(b)) for b in bs], color="#4c78a8", ls=ls, lw=2 if ls == "-" else 1, label=name)
    a1.scatter([q["batch"] for q in points], [q["tok_s"] for q in points], color="#f58518", zorder=3,
               label="measured jaxinfer decode")
    for q in points:
        a1.annotate(f"{q['percent_of_roofline']:.0f}%", (q["batch"], q["tok_s"]), textcoords="offset points",
                    xytext=(4, -10), fontsize=8)
    a1.set(xscale="log", yscale="log", xlabel="batch size (rows decoded together)", ylabel="decode tokens/s, all rows (log)")
    a1.set_title(f"{cfg.name} on this machine: batching climbs the memory line", fontsize=9)
    a1.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    return result, fig


def main(argv=None, model=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("step", choices=STEPS + ("all",))
    p.add_argument("text", nargs="?", help="tokens: text; attention: sentence; sampling: prompt")
    p.add_argument("--word", default="it", help="attention: the token whose attention is reported")
    p.add_argument("--candidates", default="cat,mat", help="attention: earlier words it may refer to")
    p.add_argument("--top", type=int, default=5, help="attention: referent heads reported")
    p.add_argument("--darts", type=int, default=400, help="sampling: darts per preset (seeds 0..N-1)")
    p.add_argument("--show", type=int, default=8, help="sampling: tokens listed per distribution")
    p.add_argument("--max-new-tokens", type=int, default=200, help="kv_cache: length of the timed generation")
    p.add_argument("--chunk", type=int, default=8, help="kv_cache: decode steps per streamed chunk")
    p.add_argument("--batches", default="1,4,16", help="roofline: batch sizes measured")
    p.add_argument("--new-tokens", type=int, default=64, help="roofline: tokens per decode measurement")
    p.add_argument("--repeats", type=int, default=3, help="roofline: timed repeats per measurement")
    p.add_argument("--copy-mib", type=int, default=256, help="roofline: array size of the bandwidth probe")
    args = p.parse_intermixed_args(argv)
    if args.smoke:
        args.darts, args.max_new_tokens, args.chunk = min(args.darts, 64), 7, 3
        args.batches, args.new_tokens, args.repeats, args.copy_mib = "1", 4, 1, 16
    if args.darts < 1 or args.max_new_tokens < 2 or args.chunk < 1 or args.new_tokens < 2 or args.repeats < 1:
        p.error("need --darts >= 1, --max-new-tokens >= 2, --chunk >= 1, --new-tokens >= 2, --repeats >= 1")
    if model is None and args.step == "tokens":  # the tokenizer alone: no weights to load
        model = types.SimpleNamespace(config=types.SimpleNamespace(name=args.model),
                                      tokenizer=jaxinfer.load_tokenizer(args.model))
    m = _common.load_model(args, model, layout="stacked")
    results = {}
    for step in STEPS if args.step == "all" else (args.step,):
        print(f"[{step}]")
        result, fig = {"tokens": tokens, "attention": attention, "sampling": sampling, "kv_cache": kv_cache,
                       "roofline": roofline}[step](m, args)
        _common.save(step, result, args, fig)
        results[step] = result
    return results if args.step == "all" else results[args.step]


if __name__ == "__main__":
    main()
