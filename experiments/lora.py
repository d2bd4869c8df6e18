"""LoRA: what an adapter per row costs in decode, against the base model and a merged adapter.

    python -m experiments.lora [--rank 16] [--rounds 5] [--new-tokens 64] [--layout per_layer]

Decode batch 8 (greedy, no stop) four ways, side by side in alternating rounds (medians):
the base model; the same rows with 8 different random rank-`--rank` adapters on all seven
projections (one per row, kept apart), their A and B stored float32 and, again, bfloat16
(`lora_dtype`); and the model with one such adapter merged into its weights. Reported as decode
time relative to the base (targets: <= 1.15 for 8 adapters, 1.0 merged), with the compiles a
reassignment of adapters to rows costs (0).
"""

from __future__ import annotations

import os

import numpy as np

from experiments import _common as common
from experiments._measure import interleaved


def random_adapter(cfg, rank: int, seed: int):
    """A rank-`rank` adapter on all seven projections of every layer, A and B random (alpha 2r)."""
    from jaxinfer.model import lora

    rng = np.random.default_rng(seed)
    L, weights = cfg.n_layers, {}
    for t in lora.TARGETS:
        O, I = lora.shape_of(t, cfg)
        weights[t] = {"a": (rng.standard_normal((L, rank, I)) / np.sqrt(I)).astype(np.float32),
                      "b": (0.02 * rng.standard_normal((L, O, rank))).astype(np.float32),
                      "scale": np.full((L,), 2.0, np.float32)}
    return lora.Adapter(weights=weights, ranks={t: (rank,) * L for t in lora.TARGETS},
                        alphas={t: (2.0 * rank,) * L for t in lora.TARGETS})


def speed(args, m) -> dict:
    import jaxinfer
    from jaxinfer.compile_cache import CompileCounter
    from jaxinfer.model import layout

    m = layout.to_layout(m, args.layout)
    cfg = m.config
    B = 8
    adapters = {f"a{i}": random_adapter(cfg, args.rank, i) for i in range(B)}
    with_lora = jaxinfer.lora.attach(m, adapters)
    with_bf16 = jaxinfer.lora.attach(m, adapters, lora_dtype="bfloat16")
    merged = jaxinfer.lora.attach(m, {"a0": adapters["a0"]}, merge=True)
    ids = common.text_ids(m.tokenizer)
    prompts = [ids[i * 40:i * 40 + 32] for i in range(B)]
    names = list(adapters)

    def decode_s(model, row_adapters):
        def run():
            out = jaxinfer.generate(model, prompts, max_new_tokens=args.new_tokens, stop_at_eos=False,
                                    adapters=row_adapters)
            return out.timings.decode_s
        return run

    runs = interleaved({"base": decode_s(m, None), "adapters": decode_s(with_lora, names),
                        "adapters_bf16": decode_s(with_bf16, names), "merged": decode_s(merged, None)}, args.rounds)
    med = {k: float(np.median(v)) for k, v in runs.items()}
    with CompileCounter() as compiles:
        jaxinfer.generate(with_lora, prompts, max_new_tokens=args.new_tokens, stop_at_eos=False,
                          adapters=names[::-1][:4] + [None] * 4)
    each = f"decode b{B}, {B} different rank-{args.rank} adapters (all seven projections)"
    table = [{"row": f"{each}, float32 stacks / base", "ratio": med["adapters"] / med["base"], "target": "<= 1.15"},
            {"row": f"{each}, bfloat16 stacks / base", "ratio": med["adapters_bf16"] / med["base"],
             "target": "<= 1.15"},
            {"row": f"decode b{B}, one adapter merged / base", "ratio": med["merged"] / med["base"], "target": "1.0"},
            {"row": "programs compiled when rows switch adapters", "ratio": float(compiles.count), "target": "0"}]
    for r in table:
        print(f"{r['row']:100} {r['ratio']:7.3f}  (target {r['target']})")
    fig, ax = common.plt().subplots(figsize=(7, 2.2))
    ax.barh(range(3), [r["ratio"] for r in table[:3]], color="C0")
    ax.axvline(1.0, color="k", lw=0.5)
    ax.plot([1.15, 1.15], [-0.4, 0.4], color="C3")
    ax.set_yticks(range(3), ["8 adapters, one per row, float32", "the same, bfloat16 stacks", "one adapter merged"],
                  fontsize=8)
    ax.set_xlabel("decode time / base model's (red: the target)")
    ax.set_title(f"{args.model}: LoRA in decode, batch {B}, {args.new_tokens} tokens, rank {args.rank} "
                 f"({args.rounds} alternating rounds, medians)", fontsize=8)
    result = {"layout": cfg.layout, "rank": args.rank, "batch": B, "new_tokens": args.new_tokens,
              "rounds": args.rounds, "load_average": os.getloadavg(), "decode_s": med, "runs": runs, "rows": table}
    common.save("lora_speed", result, args, fig=fig)
    return result


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--rank", type=int, default=16, help="adapter rank (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="decode steps (default %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default %(default)s)")
    p.add_argument("--layout", default="per_layer", choices=("per_layer", "stacked"),
                   help="params layout (default %(default)s)")
    args = p.parse_args(argv)
    if args.smoke:
        args.rank, args.new_tokens, args.rounds = 4, 4, 1
    return speed(args, common.load_model(args, model))


if __name__ == "__main__":
    main()
