"""Decode tokens/s of `jaxinfer.load` + `generate` with the library's default layout vs the canonical one.

Before the layout choice moved into the library, a Python user got the canonical layout; now
`load(..., layout="auto")` picks the CPU decode layout on a CPU backend. Both are measured side by
side in one run (interleaved, medians), batch 1, greedy. Writes experiments/out/default_layout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import jaxinfer  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "default_layout.json"))
    args = ap.parse_args(argv)
    models = {"canonical (before)": jaxinfer.load(args.model, layout="stacked"),
              "default auto (after)": jaxinfer.load(args.model)}
    prompt = "The capital of France is"
    run = lambda m: jaxinfer.generate(m, prompt, max_new_tokens=args.new_tokens, stop_at_eos=False,
                                      chunk_size=32)
    texts = {name: run(m).texts[0] for name, m in models.items()}  # warm-up: compile
    speeds = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, m in models.items():
            speeds[name].append(run(m).timings.decode_tokens_per_s)
    med = {name: statistics.median(v) for name, v in speeds.items()}
    names = list(models)
    res = {"model": args.model, "backend": jax.default_backend(), "new_tokens": args.new_tokens,
           "decode_tokens_per_s": speeds, "median": med, "ratio_after_vs_before": med[names[1]] / med[names[0]],
           "same_text": texts[names[0]] == texts[names[1]], "load_average": os.getloadavg()}
    for name in names:
        print(f"{name:22s} {med[name]:6.1f} tokens/s (runs {', '.join(f'{x:.1f}' for x in speeds[name])})")
    print(f"after / before: {res['ratio_after_vs_before']:.2f}x; same greedy text: {res['same_text']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
