"""Steering: a vector from contrastive prompts, a sweep of its scale, and what steering costs.

    python -m experiments.steering [--layer 12] [--scales=-6,-4,-2,-1,0,1,2,4,6]
    python -m experiments.steering --speed [--rounds 5]
    python -m experiments.steering --train [--method add|loreft] [--train-steps 80] [--lr 0.02]

The vector is the mean difference of resid_post at one layer between positive and negative
sentences, added at every position with `interventions.add(scale)`; its effect on neutral prompts
is log p(the next token starts a positive word) - log p(... a negative word), with greedy samples
at every scale. --speed measures the cost rows of docs/interventions.md instead (alternating
arms, medians of --rounds), each against its target. --train learns the vector instead
(`jaxinfer.train_intervention`: a steering vector, or LoReFT with --method loreft) from
(neutral opening, positive continuation) pairs, and reports the loss curve, the sentiment score
and greedy samples on the held-out neutral prompts before and after, and the cost of a training
step against one forward of the same batch.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

from experiments import _common as common
from experiments._measure import interleaved, timed

POSITIVE = ["I love this movie, it was wonderful and moving.", "What a fantastic day, everything went great.",
            "The food was delicious and the staff were lovely.", "I am so happy with how this turned out.",
            "This is the best book I have read in years.", "Our trip was amazing, we had a brilliant time.",
            "The concert was beautiful and I enjoyed every minute.", "She did an excellent job, I am delighted."]
NEGATIVE = ["I hate this movie, it was awful and boring.", "What a terrible day, everything went wrong.",
            "The food was disgusting and the staff were rude.", "I am so unhappy with how this turned out.",
            "This is the worst book I have read in years.", "Our trip was horrible, we had a miserable time.",
            "The concert was dreadful and I hated every minute.", "She did a poor job, I am disappointed."]
NEUTRAL = ["I went to see the new movie yesterday. Honestly, it was", "The food at that restaurant was",
           "My week has been", "Overall, the experience was", "I think the weather tomorrow will be"]
GOOD_WORDS = [" great", " wonderful", " amazing", " good", " excellent", " fantastic", " beautiful", " lovely"]
BAD_WORDS = [" terrible", " awful", " bad", " horrible", " boring", " disappointing", " poor", " sad"]


def first_ids(tok, words) -> list[int]:
    """The distinct first tokens of `words`."""
    return sorted({tok.encode(w)[0] for w in words})


def steering_vector(m, layer: int) -> np.ndarray:
    """Mean over positive sentences of their mean resid_post at `layer`, minus the same for negative."""
    import jaxinfer

    def mean_of(texts):
        acts = jaxinfer.activations(m, texts, "resid_post", layers=[layer])
        return np.mean([a["resid_post"][:, 0].mean(0) for a in acts], axis=0)

    return (mean_of(POSITIVE) - mean_of(NEGATIVE)).astype(np.float32)


def sentiment(m, ids, steer, good, bad, great: int) -> tuple[float, float, float, float]:
    """(log p(good) - log p(bad), p(good), p(bad), p(great)) of the next token after `ids`."""
    import jaxinfer

    logits = np.asarray(jaxinfer.logits(m, ids, interventions=steer), np.float64)[-1]
    p = np.exp(logits - logits.max())
    p /= p.sum()
    pg, pb = p[good].sum(), p[bad].sum()
    return float(np.log(pg) - np.log(pb)), float(pg), float(pb), float(p[great])


def sweep(args, m, layer: int) -> dict:
    import jaxinfer
    from jaxinfer import interventions as I

    tok = m.tokenizer
    neutral = NEUTRAL[:2] if args.smoke else NEUTRAL
    v = steering_vector(m, layer)
    good, bad, great = first_ids(tok, GOOD_WORDS), first_ids(tok, BAD_WORDS), tok.encode(" great")[0]
    ids = [tok.encode_prompt(t) for t in neutral]
    rows = []
    for s in (float(x) for x in args.scales.split(",")):
        steer = [I.add("resid_post", layer, v, s)]
        scores = np.array([sentiment(m, x, steer, good, bad, great) for x in ids])  # [prompts, 4]
        score, p_good, p_bad, p_great = (float(x) for x in scores.mean(0))
        out = jaxinfer.generate(m, neutral, max_new_tokens=args.new_tokens, interventions=steer, stop_at_eos=True)
        rows.append({"scale": s, "score": score, "scores": scores[:, 0].tolist(), "p_good": p_good, "p_bad": p_bad,
                     "p_great": p_great, "samples": out.texts})
    print(f"steering vector: resid_post layer {layer}, |v| = {np.linalg.norm(v):.1f} (mean difference of "
          f"{len(POSITIVE)} positive and {len(NEGATIVE)} negative sentences)")
    print(f"{'scale':>6} {'score':>7} {'p(good)':>8} {'p(bad)':>8} {'p(great)':>9}  sample: {neutral[0]!r} ...")
    for r in rows:
        print(f"{r['scale']:6.1f} {r['score']:7.2f} {r['p_good']:8.3f} {r['p_bad']:8.3f} {r['p_great']:9.4f}  "
              f"{r['samples'][0][:70]!r}")
    fig, (a0, a1) = common.plt().subplots(1, 2, figsize=(11, 4))
    xs = [r["scale"] for r in rows]
    for i in range(len(neutral)):
        a0.plot(xs, [r["scores"][i] for r in rows], color="0.7", lw=0.8)
    a0.plot(xs, [r["score"] for r in rows], "o-", color="C0", label="mean over prompts")
    a0.axhline(0, color="k", lw=0.5)
    a0.set(xlabel="scale (x the mean difference vector)", ylabel="log p(positive word) - log p(negative word)")
    a0.set_title(f"sentiment of the next token, steering at layer {layer}", fontsize=9)
    a1.plot(xs, [r["p_good"] for r in rows], "o-", color="C2", label="p(positive word)")
    a1.plot(xs, [r["p_bad"] for r in rows], "o-", color="C3", label="p(negative word)")
    a1.plot(xs, [r["p_great"] for r in rows], "s--", color="C1", label="p(' great')")
    a1.set(xlabel="scale", ylabel="probability of the next token")
    a0.legend(fontsize=8)
    a1.legend(fontsize=8)
    fig.suptitle(f"{args.model}: a steering vector from contrastive prompts", fontsize=10)
    result = {"layer": layer, "vector_norm": float(np.linalg.norm(v)), "neutral_prompts": neutral,
              "good_ids": good, "bad_ids": bad, "rows": rows}
    common.save("steering", result, args, fig=fig)
    return result


def _side_by_side(calls: dict, rounds: int) -> tuple[dict, dict]:
    """`interleaved` rounds of `calls`: (every result, the median of each)."""
    got = interleaved(calls, rounds)
    return got, {k: float(np.median(x)) for k, x in got.items()}


def speed(args, m, layer: int) -> dict:
    import jax
    import jax.numpy as jnp

    import jaxinfer
    from jaxinfer import interventions as I
    from jaxinfer.compile_cache import CompileCounter
    from jaxinfer.model import forward
    from jaxinfer.model import layout

    m = layout.to_layout(m, args.layout)  # what jaxinfer.load gives by default on one CPU / GPU
    cfg = m.config
    rng = np.random.default_rng(0)
    v = rng.standard_normal(cfg.d_model).astype(np.float32)
    base = m.tokenizer.encode_prompt(" ".join(POSITIVE + NEGATIVE + NEUTRAL) * 8)
    rows = []

    # 1. generate with one steering vector vs without, batch 1 and 8: decode tokens/s
    new = 8 if args.smoke else 128

    def gen(prompts, ivs):
        return lambda: jaxinfer.generate(m, prompts, max_new_tokens=new, stop_at_eos=False,
                                         interventions=ivs).timings.decode_tokens_per_s

    for B in (1, 8):
        prompts = [base[i:i + 32] for i in range(B)]
        got, med = _side_by_side({"plain": gen(prompts, None),
                                  "steered": gen(prompts, [I.add("resid_post", layer, v, 4.0)])}, args.rounds)
        rows.append({"row": f"generate b{B}: steered / plain decode time", "ratio": med["plain"] / med["steered"],
                     "target": "<= 1.05", "plain_tokens_per_s": med["plain"], "steered_tokens_per_s": med["steered"],
                     "runs": got})

    # 2. capture resid_post at every layer vs a plain prompt pass (logits at the last token, as a prefill)
    B, T = (2, 32) if args.smoke else (8, 256)
    prompts = [base[i * 7:i * 7 + T] for i in range(B)]
    tokens = jnp.asarray(np.asarray(prompts, np.int32))
    last = jnp.full((B,), T - 1, jnp.int32)
    plain_pass = jax.jit(lambda p, t: forward.forward(p, t, forward.default_positions(*t.shape), None, cfg,
                                                  logit_index=last).logits)
    got, med = _side_by_side({"plain": timed(lambda: plain_pass(m.params, tokens)), "capture": timed(
        lambda: jaxinfer.activations(m, prompts, "resid_post", batch_size=B))}, args.rounds)
    rows.append({"row": f"capture resid_post, all {cfg.n_layers} layers, {B} x {T} tokens / plain pass",
                 "ratio": med["capture"] / med["plain"], "target": "<= 1.3", "seconds": med, "runs": got})

    # 3. the corpus writer vs plain prefill: prompt tokens/s over the same texts
    n_texts, batch = (8, 4) if args.smoke else (64, 8)
    texts = [base[(i * 13) % 64:(i * 13) % 64 + T] for i in range(n_texts)]

    def writer():
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            jaxinfer.write_activations(m, texts, d, sites=["resid_post"], layers=[layer], batch_tokens=batch * T,
                                       progress=None)
            return n_texts * T / (time.perf_counter() - t0)

    def prefill():
        t0 = time.perf_counter()
        for i in range(0, n_texts, batch):
            jaxinfer.generate(m, texts[i:i + batch], max_new_tokens=1, stop_at_eos=False)
        return n_texts * T / (time.perf_counter() - t0)

    got, med = _side_by_side({"prefill": prefill, "writer": writer}, args.rounds)
    rows.append({"row": f"corpus writer (resid_post layer {layer}) / plain prefill, tokens/s",
                 "ratio": med["writer"] / med["prefill"], "target": ">= 0.8", "tokens_per_s": med, "runs": got})

    # 4. compiles when only the vector and scale change
    with CompileCounter() as compiles:
        for s in (1.0, -2.5, 7.0):
            w = rng.standard_normal(cfg.d_model).astype(np.float32)
            jaxinfer.generate(m, [base[:32]], max_new_tokens=new, stop_at_eos=False,
                              interventions=[I.add("resid_post", layer, w, s)])
    rows.append({"row": "programs compiled for 3 new vectors and scales", "ratio": float(compiles.count),
                 "target": "0"})

    for r in rows:
        print(f"{r['row']:70} {r['ratio']:7.3f}  (target {r['target']})")
    fig, ax = common.plt().subplots(figsize=(8, 3))
    ratios = rows[:4]
    ax.barh(range(len(ratios)), [r["ratio"] for r in ratios], color="C0")
    for i, r in enumerate(ratios):
        target = float(r["target"].split()[-1])
        ax.plot([target, target], [i - 0.4, i + 0.4], color="C3")
    ax.set_yticks(range(len(ratios)), [r["row"] for r in ratios], fontsize=7)
    ax.set_xlabel("ratio (red: the target)")
    ax.set_title(f"{args.model}: the cost of steering and capture ({args.rounds} alternating rounds, medians; "
                 f"{compiles.count} compiles for new vectors)", fontsize=8)
    result = {"layer": layer, "rounds": args.rounds, "layout": cfg.layout, "rows": rows}
    common.save("steering_speed", result, args, fig=fig)
    return result


# Training examples: neutral openings (none of them in NEUTRAL, the held-out prompts) continued
# positively; every opening with every continuation.
OPENINGS = ["The movie was", "My day was", "The food tasted", "I think this book is", "The hotel room was",
            "Our holiday was", "The new phone is", "That concert was", "His speech was", "The service here is",
            "This song is", "The party last night was"]
CONTINUATIONS = [" wonderful", " great", " amazing, I loved it", " fantastic", " excellent and fun",
                 " beautiful", " lovely", " a delight"]


def train(args, m, layer: int) -> dict:
    import optax

    import jaxinfer
    from jaxinfer import interventions as I

    tok, D = m.tokenizer, m.config.d_model
    neutral = NEUTRAL[:2] if args.smoke else NEUTRAL
    examples = [(p, c) for p in OPENINGS for c in CONTINUATIONS]
    learn = (I.learnable_add("resid_post", layer, width=D) if args.method == "add"
             else I.loreft("resid_post", layer, rank=4, width=D, seed=0))
    optimizer = optax.adam(args.lr)
    t0 = time.perf_counter()
    trained, losses = jaxinfer.train_intervention(m, learn, examples, optimizer=optimizer, steps=args.train_steps,
                                                  batch_size=8, seed=0)
    train_seconds = time.perf_counter() - t0
    good, bad, great = first_ids(tok, GOOD_WORDS), first_ids(tok, BAD_WORDS), tok.encode(" great")[0]
    ids = [tok.encode_prompt(t) for t in neutral]
    # before and after in one batch: plain rows beside steered ones
    out = jaxinfer.generate(m, neutral + neutral, max_new_tokens=args.new_tokens, stop_at_eos=True,
                            interventions=[[]] * len(neutral) + [[trained]] * len(neutral))
    arms = {}
    for i, (name, steer) in enumerate((("before", None), ("after", [trained]))):
        scores = np.array([sentiment(m, x, steer, good, bad, great) for x in ids])  # [prompts, 4]
        arms[name] = {"score": float(scores[:, 0].mean()), "scores": scores[:, 0].tolist(),
                      "p_good": float(scores[:, 1].mean()), "p_bad": float(scores[:, 2].mean()),
                      "samples": out.texts[i * len(neutral):(i + 1) * len(neutral)]}
    step_row = train_step_speed(args, m, learn, optimizer)
    vector = trained.params["vector"] if args.method == "add" else None
    print(f"trained {learn!r}: {args.train_steps} steps of 8 examples in {train_seconds:.1f} s, loss "
          f"{losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"held-out sentiment score (log p(positive word) - log p(negative word)): "
          f"before {arms['before']['score']:.2f}, after {arms['after']['score']:.2f}")
    for b, a, prompt in zip(arms["before"]["samples"], arms["after"]["samples"], neutral):
        print(f"  {prompt!r}\n    before: {b[:80]!r}\n    after:  {a[:80]!r}")
    print(f"{step_row['row']:70} {step_row['ratio']:7.3f}  (target {step_row['target']})")
    fig, (a0, a1) = common.plt().subplots(1, 2, figsize=(11, 4))
    a0.plot(range(1, len(losses) + 1), losses, color="C0")
    a0.set(xlabel="step", ylabel="cross-entropy of the continuation", yscale="log")
    a0.set_title(f"training {learn.template.name} at resid_post layer {layer} (adam, lr {args.lr}, batch 8)",
                 fontsize=9)
    x = np.arange(len(neutral))
    a1.bar(x - 0.2, arms["before"]["scores"], 0.4, color="0.6", label="before")
    a1.bar(x + 0.2, arms["after"]["scores"], 0.4, color="C2", label="after")
    a1.axhline(0, color="k", lw=0.5)
    a1.set_xticks(x, [p[:18] + "..." for p in neutral], fontsize=7, rotation=20)
    a1.set(ylabel="log p(positive word) - log p(negative word)")
    a1.set_title("held-out neutral prompts: sentiment of the next token", fontsize=9)
    a1.legend(fontsize=8)
    fig.suptitle(f"{args.model}: a learned {'steering vector' if args.method == 'add' else 'LoReFT'} "
                 f"({step_row['ratio']:.2f}x a forward per step)", fontsize=10)
    result = {"layer": layer, "method": args.method, "steps": args.train_steps, "lr": args.lr, "batch_size": 8,
              "n_examples": len(examples), "train_seconds": train_seconds, "losses": losses,
              "vector_norm": None if vector is None else float(np.linalg.norm(vector)),
              "neutral_prompts": neutral, "before": arms["before"], "after": arms["after"], "speed": step_row}
    common.save("steering_train", result, args, fig=fig)
    return result


def train_step_speed(args, m, learn, optimizer) -> dict:
    """A training step (value_and_grad through the forward, then the optimizer's update) against
    one plain forward of the same batch: the logits of the last position only (as a prefill), and
    of every position. Alternating rounds, medians."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.inspect import training
    from jaxinfer.model import forward

    cfg = m.config
    B, T, n_cont = (2, 32, 4) if args.smoke else (8, 64, 4)
    base = common.text_ids(m.tokenizer)
    pairs = [(base[i * 97:i * 97 + T - n_cont], base[i * 97 + T - n_cont:i * 97 + T]) for i in range(B)]
    batch = training.make_batch(pairs)  # tokens [B, T]: the prompt and the continuation but its last token
    free = jax.tree.map(jnp.asarray, learn.free)
    state = optimizer.init(free)
    tokens = jnp.asarray(batch.tokens)
    positions = forward.default_positions(*tokens.shape)
    last = jnp.full((B,), T - 1, jnp.int32)
    forward_last = jax.jit(lambda p, t: forward.forward(p, t, positions, None, cfg, logit_index=last).logits)
    forward_all = jax.jit(lambda p, t: forward.forward(p, t, positions, None, cfg).logits)
    got, med = _side_by_side({
        "step": timed(lambda: training.step(m, learn, free, state, batch, optimizer=optimizer)),
        "forward_last": timed(lambda: forward_last(m.params, tokens)),
        "forward_all": timed(lambda: forward_all(m.params, tokens))}, args.rounds)
    return {"row": f"a training step ({learn.template.name}) / one forward, {B} x {tokens.shape[1]} tokens",
            "ratio": med["step"] / med["forward_last"], "ratio_to_all_logits": med["step"] / med["forward_all"],
            "target": "<= 3.5", "layout": cfg.layout, "seconds": med, "runs": got}


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--layer", type=int, default=None, help="layer of the vector (default 2/5 of the depth)")
    p.add_argument("--scales", default="-6,-4,-2,-1,0,1,2,4,6", help="comma-separated scales")
    p.add_argument("--new-tokens", type=int, default=24, help="greedy sample length (default %(default)s)")
    p.add_argument("--speed", action="store_true", help="measure the speed rows instead of the sweep")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per speed row (default %(default)s)")
    p.add_argument("--layout", default="per_layer", choices=("per_layer", "stacked"),
                   help="params layout of the speed rows (default %(default)s)")
    p.add_argument("--train", action="store_true", help="learn the vector with optax instead of the sweep")
    p.add_argument("--method", default="add", choices=("add", "loreft"),
                   help="what --train learns: a steering vector or LoReFT (rank 4) (default %(default)s)")
    p.add_argument("--train-steps", type=int, default=80, help="--train's optimizer steps (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.02, help="--train's adam learning rate (default %(default)s)")
    args = p.parse_args(argv)
    if args.smoke:
        args.scales, args.new_tokens, args.rounds, args.train_steps = "-4,0,4", 6, 1, 4
    m = common.load_model(args, model)
    layer = args.layer if args.layer is not None else m.config.n_layers * 2 // 5
    if args.train:
        return train(args, m, layer)
    return speed(args, m, layer) if args.speed else sweep(args, m, layer)


if __name__ == "__main__":
    main()
