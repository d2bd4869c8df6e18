"""Sampling: the next-token distribution, reshaped by each preset, and darts thrown at it.

    python experiments/sampling.py ["The capital of France is"] [--darts 400]

The logits are the real model's (`jaxinfer.logits`); each preset's distribution is what
`jaxinfer.sample` draws from; dart i is the sample with seed i -- the token
`generate(prompt, seed=i, max_new_tokens=1)` would produce. Same seeds, same darts.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `experiments` and `jaxinfer` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from experiments.common import plt  # noqa: E402

DEFAULT_PROMPT = "The capital of France is"


def presets():
    from jaxinfer import SamplingParams

    return {
        "Greedy": SamplingParams(temperature=0.0),
        "Default (T=1)": SamplingParams(temperature=1.0),
        "Wild (T=2)": SamplingParams(temperature=2.0),
        "Top-p 0.5": SamplingParams(temperature=1.0, top_p=0.5),
        "Top-k 5": SamplingParams(temperature=1.0, top_k=5),
    }


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--darts", type=int, default=400, help="darts per preset (seeds 0..N-1; default %(default)s)")
    p.add_argument("--show", type=int, default=8, help="tokens shown per distribution (default %(default)s)")
    args = p.parse_args(argv)
    if args.smoke:
        args.darts = min(args.darts, 64)
    if args.darts < 1:
        p.error(f"--darts must be >= 1, got {args.darts}")
    import jaxinfer
    from jaxinfer.inspect import probes

    m = common.load_model(args, model)
    ids = m.tokenizer.encode(args.prompt)
    logits = jaxinfer.logits(m, ids)[-1]  # [V]: what comes after the prompt
    name = lambda t: m.tokenizer.decode([int(t)]).replace(" ", "·").replace("\n", "⏎")  # noqa: E731
    seeds = list(range(args.darts))

    raw = probes.distribution(logits, presets()["Default (T=1)"])
    shown = [int(t) for t in np.argsort(raw)[::-1][:6]]  # the same tokens in every panel
    result = {"prompt": args.prompt, "n_darts": args.darts, "shown_tokens": [name(t) for t in shown], "presets": {}}
    print(f"prompt: {args.prompt!r} ({len(ids)} tokens); {args.darts} darts per preset, seeds 0..{args.darts - 1}")
    for label, sp in presets().items():
        probs = probes.distribution(logits, sp)
        darts = probes.throw_darts(logits, sp, seeds)
        again = probes.throw_darts(logits, sp, seeds)
        shifted = probes.throw_darts(logits, sp, [s + args.darts for s in seeds])
        counts = np.bincount(darts, minlength=probs.shape[0])
        freq = counts / len(darts)
        top = [t for t in np.argsort(probs)[::-1][: args.show] if probs[t] > 0]
        r = {"sampling": {"temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p},
             "tokens_allowed": int((probs > 0).sum()),
             "top": [{"id": int(t), "token": name(t), "p": float(probs[t]), "dart_share": float(freq[t])} for t in top],
             "shown": [{"token": name(t), "p": float(probs[t]), "dart_share": float(freq[t])} for t in shown],
             "darts_outside_allowed": int(counts[probs == 0].sum()),
             "distinct_tokens_hit": int((counts > 0).sum()),
             "max_abs_share_minus_p": float(np.abs(freq - probs).max()),
             "same_seeds_same_darts": bool(np.array_equal(darts, again)),
             "other_seeds_differ_at": int((darts != shifted).sum()),
             "first_darts": [name(t) for t in darts[:10]]}
        result["presets"][label] = r
        best = r["top"][0]
        print(f"\n{label}: {r['tokens_allowed']} token{'s' if r['tokens_allowed'] > 1 else ''} allowed; top {best['token']!r} p={best['p']:.3f}; "
              f"{r['distinct_tokens_hit']} distinct tokens hit")
        print("  " + ", ".join(f"{t['token']} {t['p']:.3f}/{t['dart_share']:.3f}" for t in r["top"][:5])
              + "   (p / share of darts)")
        print(f"  darts outside the allowed set: {r['darts_outside_allowed']}; max |share - p| = "
              f"{r['max_abs_share_minus_p']:.3f}; same seeds same darts: {r['same_seeds_same_darts']}; "
              f"seeds +{args.darts} land elsewhere {r['other_seeds_differ_at']} times")

    labels = list(result["presets"])
    fig, axes = plt.subplots(1, len(labels), figsize=(3.0 * len(labels), 3.6), sharey=True)
    for ax, label in zip(axes, labels):
        r = result["presets"][label]
        toks = r["shown"]
        x = np.arange(len(toks) + 1)
        ps = [t["p"] for t in toks] + [max(0.0, 1 - sum(t["p"] for t in toks))]
        fs = [t["dart_share"] for t in toks] + [max(0.0, 1 - sum(t["dart_share"] for t in toks))]
        ax.bar(x - 0.2, ps, 0.4, label="probability", color="#4c78a8")
        ax.bar(x + 0.2, fs, 0.4, label=f"{args.darts} darts", color="#f58518")
        ax.set_xticks(x, [t["token"] for t in toks] + ["other"], rotation=60, ha="right", fontsize=8)
        ax.set_title(f"{label}\n{r['tokens_allowed']} token{'s' if r['tokens_allowed'] > 1 else ''} allowed", fontsize=9)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("probability / share of darts")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{m.config.name}: next token after {args.prompt!r}", fontsize=10)
    fig.tight_layout()
    common.save("sampling", fig, result, args)
    return result


if __name__ == "__main__":
    main()
