"""Attribution patching against exact activation patching, every layer and position of a prompt pair.

    python -m experiments.attribution [--sites resid_pre,attn_out,mlp_out] [--speed-tokens 64] [--rounds 3]

An indirect-object pair: clean "When Mary and John went to the store, John gave a drink to"
(-> " Mary") and corrupt, the second name swapped (-> " John"); the metric is
logit(" Mary") - logit(" John") at the last position. For each site, `jaxinfer.attribution_patch`
estimates every (position, layer) cell's effect from one gradient and `jaxinfer.patching_sweep`
measures it exactly (one row of a batch per cell); the figure plots one against the other, with
their correlation. The speed rows (alternating rounds, medians) run a pair of --speed-tokens
tokens (held-out text before the same sentence): attribution over every layer and position
against one plain forward of the pair, and the sweep of every layer x position against the same
number of rows of a plain batched forward (both plain arms compute the same metric of each row).
"""

from __future__ import annotations

import time
from statistics import median

import numpy as np

from experiments import _common as common

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Mary and John went to the store, Mary gave a drink to"
GOOD, BAD = " Mary", " John"


def prompt_pair(tok, tokens: int | None = None) -> tuple[list[int], list[int], int, int]:
    """(clean ids, corrupt ids, good id, bad id); with `tokens`, held-out text before both so each
    has exactly that many tokens."""
    clean, corrupt = tok.encode_prompt(CLEAN), tok.encode_prompt(CORRUPT)
    good, bad = tok.encode(GOOD), tok.encode(BAD)
    assert len(clean) == len(corrupt) and len(good) == len(bad) == 1, "the names must be one token each"
    if tokens and tokens > len(clean):
        pad = common.text_ids(tok)[:tokens - len(clean)]
        clean, corrupt = pad + clean, pad + corrupt
    return clean, corrupt, good[0], bad[0]


def agreement(args, m) -> dict:
    """Attribution and the exact sweep of every site in --sites, on the natural-length pair."""
    import jaxinfer
    from jaxinfer import functional
    from jaxinfer.compile_cache import CompileCounter

    clean, corrupt, good, bad = prompt_pair(m.tokenizer)
    metric = functional.logit_diff(good, bad)
    sites = args.sites.split(",")
    t0 = time.perf_counter()
    at = jaxinfer.attribution_patch(m, clean, corrupt, metric, sites=sites)
    attribution_s = time.perf_counter() - t0
    rows = {}
    for s in sites:
        t0 = time.perf_counter()
        sweep = jaxinfer.patching_sweep(m, clean, corrupt, metric, site=s, batch_size=args.batch_size)
        est, exact = at[s], sweep.effects
        rows[s] = {"pearson_r": float(np.corrcoef(est.ravel(), exact.ravel())[0, 1]), "estimates": est,
                   "effects": exact, "sweep_forwards": sweep.forwards, "sweep_s": time.perf_counter() - t0}
    with CompileCounter() as again:  # new patched values: the pair the other way round
        jaxinfer.patching_sweep(m, corrupt, clean, metric, site=sites[0], batch_size=args.batch_size)
    all_est = np.concatenate([r["estimates"].ravel() for r in rows.values()])
    all_exact = np.concatenate([r["effects"].ravel() for r in rows.values()])
    return {"tokens": [m.tokenizer.decode([i]) for i in clean], "differs_at": [i for i, (a, b) in
                                                                               enumerate(zip(clean, corrupt)) if a != b],
            "clean_metric": at.clean, "corrupt_metric": at.corrupt, "attribution_s": attribution_s,
            "pearson_r": float(np.corrcoef(all_est, all_exact)[0, 1]), "sites": rows,
            "programs_compiled_new_values": again.count}


def speed(args, m) -> list[dict]:
    """The speed rows: attribution / one plain forward of the pair; sweep / plain rows."""
    import jax
    import jax.numpy as jnp

    import jaxinfer
    from jaxinfer import functional
    from jaxinfer.compile_cache import CompileCounter
    from jaxinfer.inspect import attribution
    from jaxinfer.model import forward

    cfg = m.config
    clean, corrupt, good, bad = prompt_pair(m.tokenizer, args.speed_tokens)
    T, L, B = len(clean), cfg.n_layers, args.batch_size
    metric = functional.logit_diff(good, bad)
    pair = jnp.asarray([clean, corrupt], jnp.int32)  # the plain arms' batch: both prompts
    # the plain arms compute the same metric of every row (so XLA may skip the same unread logits)
    plain = jax.jit(lambda p, t: jax.vmap(metric)(forward.forward(p, t, forward.default_positions(*t.shape), None,
                                                                  cfg).logits))
    forwards = -(-(L * T + 1) // B)
    rows_tokens = jnp.broadcast_to(pair[1:], (B, T))

    def plain_rows():
        return [plain(m.params, rows_tokens) for _ in range(forwards)]

    sites = tuple(args.speed_sites.split(","))
    calls = {"plain pair": lambda: plain(m.params, pair),
             "attribution": lambda: jaxinfer.attribution_patch(m, clean, corrupt, metric, sites=sites),
             "plain rows": plain_rows,
             "sweep": lambda: jaxinfer.patching_sweep(m, clean, corrupt, metric, site="resid_pre", batch_size=B)}
    # warm: compile each program once, the sweep's two (its reference pass and its batch) counted
    # by running their first batch alone, so no full sweep is spent on compiling
    layers = tuple(range(L))
    with CompileCounter() as first:
        acts, _ = attribution._reference_jit(m.params, pair, cfg, "resid_pre", layers, metric)
        zeros = jnp.zeros((B,), jnp.int32)
        attribution.sweep_rows_jit(m.params, pair[1:], acts, zeros, zeros, jnp.zeros((B,), bool), cfg=cfg,
                                   site="resid_pre", layers=layers, metric=metric).block_until_ready()
    jax.block_until_ready([plain(m.params, pair), plain(m.params, rows_tokens)])
    calls["attribution"]()
    seconds = {k: [] for k in calls}
    for r in range(args.rounds):  # alternating order, so a drifting machine slows every arm alike
        for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
            t0 = time.perf_counter()
            jax.block_until_ready(calls[name]())
            seconds[name].append(time.perf_counter() - t0)
    med = {k: median(v) for k, v in seconds.items()}
    return [{"row": f"attribution patching, {L} layers x {T} positions ({', '.join(sites)}) / one plain forward "
                    "of the pair",
             "ratio": med["attribution"] / med["plain pair"], "target": "<= 4", "seconds": med, "runs": seconds},
            {"row": f"patching sweep, {L} x {T} cells in {forwards} forwards of {B} rows / the same plain rows",
             "ratio": med["sweep"] / med["plain rows"], "target": "<= 1.2", "cells": L * T, "forwards": forwards,
             "programs_compiled": first.count,
             "seconds": med, "runs": seconds}]


def figure(args, result):
    plt = common.plt()
    sites = result["sites"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    for i, (s, r) in enumerate(sites.items()):
        ax.scatter(r["effects"].ravel(), r["estimates"].ravel(), s=8, alpha=0.6, color=f"C{i}",
                   label=f"{s} (r = {r['pearson_r']:.2f})")
    lim = max(max(np.abs(r["effects"]).max(), np.abs(r["estimates"]).max()) for r in sites.values())
    ax.plot([-lim, lim], [-lim, lim], color="k", lw=0.5)
    ax.set(xlabel="exact patching effect (sweep)", ylabel="attribution estimate (one gradient)")
    ax.set_title(f"every (position, layer) cell: r = {result['pearson_r']:.2f}", fontsize=9)
    ax.legend(fontsize=7)
    first = next(iter(sites))
    for ax, key, title in ((axes[1], "effects", "exact"), (axes[2], "estimates", "attribution")):
        data = sites[first][key]
        im = ax.imshow(data.T, aspect="auto", cmap="RdBu", vmin=-lim, vmax=lim, origin="lower")
        ax.set_xticks(range(len(result["tokens"])), result["tokens"], rotation=90, fontsize=6)
        ax.set_ylabel("layer")
        ax.set_title(f"{first}: {title} effect", fontsize=9)
        ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
        fig.colorbar(im, ax=ax, fraction=0.04)
    fig.suptitle(f"{args.model}: attribution patching against exact patching, metric logit({GOOD!r}) - "
                 f"logit({BAD!r}): {result['clean_metric']:.2f} clean, {result['corrupt_metric']:.2f} corrupt",
                 fontsize=10)
    return fig


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--sites", default="resid_pre,attn_out,mlp_out", help="comma-separated sites (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sweep rows per forward (default %(default)s)")
    p.add_argument("--speed-tokens", type=int, default=64,
                   help="tokens of the speed rows' pair (default %(default)s; 0: the sentence alone)")
    p.add_argument("--speed-sites", default="resid_pre", help="sites of the attribution speed row (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per speed row (default %(default)s)")
    p.add_argument("--no-speed", action="store_true", help="skip the speed rows")
    args = p.parse_args(argv)
    if args.smoke:  # the speed rows on the agreement's shapes: their programs are compiled once
        args.sites = "resid_pre,mlp_out"
        args.batch_size, args.speed_tokens, args.speed_sites, args.rounds = 8, 0, args.sites, 1
    m = common.load_model(args, model)
    result = agreement(args, m)
    result["speed"] = [] if args.no_speed else speed(args, m)
    for s, r in result["sites"].items():
        print(f"{s:12} r = {r['pearson_r']:.3f} over {r['effects'].size} cells ({r['sweep_forwards']} forwards)")
    for r in result["speed"]:
        print(f"{r['row']:100} {r['ratio']:6.2f}  (target {r['target']})")
    common.save("attribution", result, args, fig=figure(args, result))
    return result


if __name__ == "__main__":
    main()
