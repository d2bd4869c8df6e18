"""Distill a few-layer draft model from the target with optax; save it as an orbax checkpoint.

    python experiments/distill_draft.py [--layers 4] [--steps 120] [--minutes 8]

The draft is the target's embedding (frozen, shared vocabulary), its first `--layers` blocks and
its final norm (trained), i.e. it starts as the truncated target `speculative.truncated_draft`
and learns to imitate the full model: loss = KL(p_target || p_draft) over every position.
Training text: sections of the Python reference manual in CPython's `pydoc_data.topics` (PSF
License) other than the held-out ones in experiments/data/pydoc_heldout.txt, so acceptance is
never measured on training text. Training is kept short (minutes on 2 CPU cores).

Saves checkpoints/<model>-draft-<layers>l (orbax, via `jaxinfer.weights.checkpoint.save`); load it with
`jaxinfer.speculative.load_draft(path)`. Prints the held-out KL and top-1 agreement with the
target before and after training, for the truncated start and the distilled draft.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pydoc_data.topics  # noqa: E402

import jaxinfer  # noqa: E402
from jaxinfer.weights import checkpoint  # noqa: E402
from jaxinfer.model import forward as mdl  # noqa: E402
from jaxinfer.decode import speculative as spec  # noqa: E402
from experiments import jsonfile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "data"))
from make_text import SECTIONS as HELDOUT_SECTIONS  # noqa: E402

HELDOUT = ROOT / "experiments" / "data" / "pydoc_heldout.txt"


def _logp(params, tokens, cfg):
    return jax.nn.log_softmax(mdl.forward(params, tokens, mdl.default_positions(*tokens.shape), None, cfg)[0], -1)


def kl_and_top1(t_logp, d_logp):
    kl = jnp.mean(jnp.sum(jnp.exp(t_logp) * (t_logp - d_logp), -1))
    top1 = jnp.mean(jnp.argmax(t_logp, -1) == jnp.argmax(d_logp, -1))
    return kl, top1


def main(argv=None, model=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--minutes", type=float, default=8.0, help="stop training after this long")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="checkpoint folder (default checkpoints/<model>-draft-<layers>l)")
    args = p.parse_args(argv)
    m = model or jaxinfer.load(args.model, layout="stacked")
    cfg = m.config
    start = spec.truncated_draft(m, args.layers)
    dcfg = start.config.replace(name=f"{cfg.name}-draft-{args.layers}l")
    trainable = {"layers": start.params["layers"], "final_norm": start.params["final_norm"]}
    frozen = {k: v for k, v in start.params.items() if k not in trainable}

    train_text = "\n\n".join(v for k, v in pydoc_data.topics.topics.items() if k not in HELDOUT_SECTIONS)
    ids = np.asarray(m.tokenizer.encode(train_text), np.int32)
    held = np.asarray(m.tokenizer.encode(HELDOUT.read_text(encoding="utf-8"))[: 4 * args.seq], np.int32)
    held = jnp.asarray(held.reshape(4, args.seq))
    print(f"training text: {len(ids)} tokens from {len(pydoc_data.topics.topics) - len(HELDOUT_SECTIONS)} "
          f"pydoc sections; draft {args.layers} of {cfg.n_layers} layers")

    teacher = jax.jit(lambda p, t: _logp(p, t, cfg))

    # The frozen weights are arguments, not closed-over constants (XLA would constant-fold them).
    def loss_fn(tr, fr, t_logp, tokens):
        return kl_and_top1(t_logp, _logp({**fr, **tr}, tokens, dcfg))[0]

    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.0))
    opt_state = opt.init(trainable)

    @jax.jit
    def train_step(tr, fr, opt_state, t_logp, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(tr, fr, t_logp, tokens)
        updates, opt_state = opt.update(grads, opt_state, tr)
        return optax.apply_updates(tr, updates), opt_state, loss

    evaluate = jax.jit(lambda tr, fr, t_logp, tokens: kl_and_top1(t_logp, _logp({**fr, **tr}, tokens, dcfg)))
    held_t = teacher(m.params, held)
    kl0, top0 = map(float, evaluate(trainable, frozen, held_t, held))
    print(f"held-out before: KL {kl0:.3f} nats, top-1 agreement {top0:.3f}", flush=True)

    rng = np.random.default_rng(args.seed)
    t0, losses = time.perf_counter(), []
    for step in range(args.steps):
        starts = rng.integers(0, len(ids) - args.seq, args.batch)
        tokens = jnp.asarray(np.stack([ids[s: s + args.seq] for s in starts]))
        trainable, opt_state, loss = train_step(trainable, frozen, opt_state, teacher(m.params, tokens), tokens)
        losses.append(float(loss))
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  KL {np.mean(losses[-10:]):.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        if time.perf_counter() - t0 > 60 * args.minutes:
            print(f"stopping at step {step}: --minutes {args.minutes} reached")
            break
    kl1, top1 = map(float, evaluate(trainable, frozen, held_t, held))
    print(f"held-out after:  KL {kl1:.3f} nats, top-1 agreement {top1:.3f}")

    out = Path(args.out or ROOT / "checkpoints" / f"{args.model}-draft-{args.layers}l")
    checkpoint.save(out, dcfg, {**frozen, **trainable}, dtype="float32", source=f"distilled from {args.model}",
                    overwrite=True)
    print(f"saved {out}")
    result = {"experiment": "distill_draft", "layers": args.layers, "steps": len(losses),
              "seconds": time.perf_counter() - t0, "heldout_before": {"kl": kl0, "top1": top0},
              "heldout_after": {"kl": kl1, "top1": top1}, "checkpoint": str(out), "losses": losses}
    jsonfile.write_json(ROOT / "experiments" / "out" / "distill_draft.json", result)
    return result


if __name__ == "__main__":
    main()
