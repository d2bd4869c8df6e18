"""Sparse autoencoders: train one on SmolLM2's layer-12 residual stream on this CPU, read features, steer by one.

    python -m experiments.sae [--layer 12] [--tokens 12000] [--d-sae 1024] [--steps 800] [--arch topk]

1. A corpus: the held-out text (experiments/data) cut into 128-token texts, resid_post at one
   layer written to shards with `jaxinfer.write_activations`.
2. Training: `jaxinfer.sae.train` (optax Adam) on those shards; L0, explained variance and dead
   features over steps (the figure's left panels), and the step's speed against its FLOP and byte
   floors on this machine (`sae.step_floors`, a matmul's FLOP/s and a copy's bandwidth).
3. Features: the top features of a few prompts (`jaxinfer.sae.features`: the site captured and
   encoded in one compiled pass), each feature's top contexts in the corpus.
4. Steering: one feature's decoder direction added at its layer (`sae_add`) over a sweep of
   strengths, greedy samples; and the cost rows: feature capture / a plain pass (target <= 1.25),
   `sae_add` steering / plain decode (target <= 1.05), alternating rounds, medians.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments import _common as common
from experiments._measure import bandwidth, interleaved, matmul_peak, timed

PROMPTS = ["def parse(line):\n    return line.split(", "The exception is raised when the", "for i in range(10):\n   ",
           "The Eiffel Tower is in the city of"]
NEUTRAL = ["My favourite thing to do on weekends is", "The weather today is"]


def corpus_texts(tok, n_tokens: int, length: int = 128) -> list[list[int]]:
    ids = common.text_ids(tok)
    n = max(1, min(len(ids), n_tokens) // length)
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def top_contexts(tok, texts, store: Path, layer_rows: np.ndarray, sae, feature: int, n: int = 4) -> list[str]:
    """The n corpus tokens where `feature` is most active, each with 6 tokens before it (the token in [])."""
    import jaxinfer
    from jaxinfer.inspect import corpus

    vals = np.asarray(jaxinfer.sae.encode(sae, layer_rows))[:, feature]
    meta = np.concatenate([np.stack([s["text_index"], s["position"]], 1) for s in corpus.iter_shards(store)])
    out = []
    for r in np.argsort(-vals)[:n]:
        t, p = meta[r]
        before = tok.decode(texts[t][max(0, p - 6):p])
        out.append(f"{before}[{tok.decode([texts[t][p]])}] ({vals[r]:.1f})")
    return out


def run(args, m) -> dict:
    import jax

    import jaxinfer
    from jaxinfer import sae as S
    from jaxinfer.inspect import corpus

    tok, cfg = m.tokenizer, m.config
    layer = min(args.layer, cfg.n_layers - 1)
    texts = corpus_texts(tok, args.tokens, 16 if args.smoke else 128)
    work = Path(tempfile.mkdtemp(prefix="sae_"))
    store = work / "acts"
    t0 = time.perf_counter()
    manifest = jaxinfer.write_activations(m, texts, store, sites=["resid_post"], layers=[layer])
    write_s = time.perf_counter() - t0
    print(f"corpus: {len(texts)} texts, {manifest['rows']} tokens of resid_post layer {layer} in {write_s:.1f} s")

    config = S.TrainConfig(d_sae=args.d_sae, architecture=args.arch, k=args.k, l1_coefficient=args.l1,
                           lr=args.lr, batch_size=args.batch, steps=args.steps, seed=0,
                           log_every=max(1, args.steps // 30), dead_window=max(args.batch, manifest["rows"]))
    result = S.train(store, config=config,
                     progress=lambda s, n, e: e and print(f"step {e['step']:5d}  L0 {e['l0']:6.1f}  explained var "
                                                          f"{e['explained_variance']:.3f}  dead {e['dead_features']}"))
    sae = result.sae
    S.save(sae, work / "sae")
    last = result.log[-1]

    # speed of the training step against its floors on this machine
    floors = S.step_floors(sae.d_in, sae.d_sae, config.batch_size)
    peak = matmul_peak(256 if args.smoke else 1024, repeats=3)
    bw = bandwidth(8 << 20 if args.smoke else 256 << 20, repeats=3)["roofline_Bps"]
    floor_s = {"flops": floors["flops"] / peak, "bytes": floors["bytes"] / bw}
    training = {"tokens_per_s": result.tokens_per_s, "step_flops": floors["flops"], "step_bytes": floors["bytes"],
                "matmul_flops_per_s": peak, "bandwidth_Bps": bw,
                "flop_floor_tokens_per_s": config.batch_size / floor_s["flops"],
                "byte_floor_tokens_per_s": config.batch_size / floor_s["bytes"],
                "fraction_of_floor": result.tokens_per_s / (config.batch_size / max(floor_s.values()))}
    print(f"training: {result.tokens_per_s:,.0f} tokens/s; floors {training['flop_floor_tokens_per_s']:,.0f} "
          f"(FLOPs at {peak / 1e9:.0f} GFLOP/s), {training['byte_floor_tokens_per_s']:,.0f} (bytes at "
          f"{bw / 1e9:.1f} GB/s): {training['fraction_of_floor']:.0%} of the tighter one")

    # features of a few prompts, and each top feature's contexts in the corpus
    rows = np.concatenate([s["resid_post"][:, 0] for s in corpus.iter_shards(store)])
    feats = S.features(m, sae, PROMPTS, top_k=3)
    prompt_rows = []
    for p, fe in zip(PROMPTS, feats):
        ids, vals = fe.ids[-1].tolist(), fe.values[-1].tolist()
        prompt_rows.append({"prompt": p, "last_token": fe.tokens[-1], "features": ids, "values": vals,
                            "contexts": top_contexts(tok, texts, store, rows, sae, ids[0])})
        print(f"{p!r:45} -> {', '.join(f'#{i} ({v:.1f})' for i, v in zip(ids, vals))}")
        print(f"    #{ids[0]} fires most on: {' | '.join(prompt_rows[-1]['contexts'])!r}")

    # steering by the first prompt's top feature
    feature = prompt_rows[0]["features"][0]
    resid_norm = float(np.median(np.linalg.norm(rows, axis=-1)))
    unit = resid_norm / float(np.linalg.norm(np.asarray(sae.w_dec)[feature]))
    steering = []
    for frac in (0.0, 0.5, 1.0, 2.0):
        steer = [S.sae_add(sae, feature, frac * unit)] if frac else None
        out = jaxinfer.generate(m, NEUTRAL, max_new_tokens=args.new_tokens, interventions=steer, stop_at_eos=False)
        steering.append({"strength_x_resid_norm": frac, "strength": frac * unit, "samples": out.texts})
        print(f"strength {frac:.1f} x |resid|: {out.texts[0][:80]!r}")

    speed = cost_rows(args, m, sae, layer)
    fig = figure(args, result.log, training, speed, layer)
    res = {"layer": layer, "corpus_tokens": manifest["rows"], "corpus_write_s": write_s,
           "config": {k: getattr(config, k) for k in ("d_sae", "architecture", "k", "l1_coefficient", "lr",
                                                     "batch_size", "steps")},
           "log": result.log, "final": last, "training": training, "prompts": prompt_rows,
           "steer_feature": feature, "steering": steering, "speed": speed, "backend": jax.default_backend()}
    shutil.rmtree(work, ignore_errors=True)
    common.save("sae", res, args, fig=fig)
    return res


def cost_rows(args, m, sae, layer: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    import jaxinfer
    from jaxinfer import sae as S
    from jaxinfer.model import forward

    cfg = m.config
    B, T = (2, 32) if args.smoke else (8, 128)
    base = common.text_ids(m.tokenizer)
    prompts = [base[i * T:(i + 1) * T] for i in range(B)]
    tokens = jnp.asarray(np.asarray(prompts, np.int32))
    last = jnp.full((B,), T - 1, jnp.int32)
    plain = jax.jit(lambda p, t: forward.forward(p, t, forward.default_positions(*t.shape), None, cfg,
                                                 logit_index=last).logits)
    got = interleaved({"plain": timed(lambda: plain(m.params, tokens).block_until_ready()),
                       "capture": timed(lambda: jaxinfer.activations(m, prompts, "resid_post", layers=[layer],
                                                                     batch_size=B)),
                       "features": timed(lambda: S.features(m, sae, prompts, top_k=8, batch_size=B))}, args.rounds)
    med = {k: float(np.median(v)) for k, v in got.items()}
    rows = [{"row": f"features (top-8 per token, layer {layer}), {B} x {T} tokens / plain pass",
             "ratio": med["features"] / med["plain"], "target": "<= 1.25", "seconds": med, "runs": got},
            {"row": "features / capturing the site alone (jaxinfer.activations)",
             "ratio": med["features"] / med["capture"], "target": "-", "seconds": med}]
    new = 8 if args.smoke else 64
    steer = [S.sae_add(sae, 0, 1.0)]

    def gen(ivs):
        return lambda: jaxinfer.generate(m, prompts[:1], max_new_tokens=new, stop_at_eos=False,
                                         interventions=ivs).timings.decode_tokens_per_s

    got = interleaved({"plain": gen(None), "steered": gen(steer)}, args.rounds)
    med = {k: float(np.median(v)) for k, v in got.items()}
    rows.append({"row": "generate b1: sae_add steered / plain decode time", "ratio": med["plain"] / med["steered"],
                 "target": "<= 1.05", "tokens_per_s": med, "runs": got})
    for r in rows:
        print(f"{r['row']:72} {r['ratio']:6.3f}  (target {r['target']})")
    return rows


def figure(args, log, training, speed, layer):
    fig, axes = common.plt().subplots(1, 4, figsize=(15, 3.4))
    steps = [e["step"] for e in log]
    for ax, key, label in zip(axes[:3], ("l0", "explained_variance", "dead_features"),
                              ("L0 (features per token)", "explained variance", "dead features")):
        ax.plot(steps, [e[key] for e in log], "o-", ms=3)
        ax.set(xlabel="step", title=label)
    ax = axes[3]
    names = ["measured", "byte floor", "FLOP floor"]
    vals = [training["tokens_per_s"], training["byte_floor_tokens_per_s"], training["flop_floor_tokens_per_s"]]
    ax.barh(range(3), vals, color=["C0", "C7", "C7"])
    ax.set_yticks(range(3), names, fontsize=8)
    ax.set_xscale("log")
    ax.set(xlabel="training tokens/s", title=f"step speed ({training['fraction_of_floor']:.0%} of its floor)")
    fig.suptitle(f"{args.model}: an SAE on resid_post layer {layer} (features / plain pass "
                 f"{speed[0]['ratio']:.2f}x, steered / plain decode {speed[2]['ratio']:.2f}x)", fontsize=10)
    fig.tight_layout()
    return fig


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--layer", type=int, default=12, help="the layer of resid_post (default %(default)s)")
    p.add_argument("--tokens", type=int, default=12000, help="corpus tokens (default %(default)s: the whole text)")
    p.add_argument("--d-sae", type=int, default=1024, help="features (default %(default)s)")
    p.add_argument("--arch", default="topk", choices=("topk", "standard"), help="topk or standard (L1)")
    p.add_argument("--k", type=int, default=32, help="topk: features per token (default %(default)s)")
    p.add_argument("--l1", type=float, default=5.0, help="standard: L1 coefficient (default %(default)s)")
    p.add_argument("--lr", type=float, default=5e-4, help="Adam's learning rate (default %(default)s)")
    p.add_argument("--batch", type=int, default=256, help="tokens per step (default %(default)s)")
    p.add_argument("--steps", type=int, default=800, help="training steps (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=20, help="steered sample length (default %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per speed row (default %(default)s)")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.d_sae, args.k, args.batch, args.steps = 256, 64, 4, 64, 10
        args.new_tokens, args.rounds, args.lr = 4, 1, 3e-3
    return run(args, common.load_model(args, model))


if __name__ == "__main__":
    main()
