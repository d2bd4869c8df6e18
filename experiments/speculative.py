"""How much faster is speculative decoding than plain decoding, and with which draft?

    python -m experiments.speculative [--tokens 96] [--k 4]   # SmolLM2-135M, batch 1, greedy
    python -m experiments.speculative --distill               # train the distilled draft it compares (minutes)

Greedy decode tokens/s (interleaved repeats, medians) of `generate` and of `speculative.generate`
with prompt lookup, with the target's first --draft-layers layers, and with the distilled draft at
--draft, on a code-editing prompt (lookup's case) and on open text; the same tokens every way
(checked). --distill trains that draft (KL to the target over every position; the embedding
frozen) on the Python reference manual's sections other than the held-out ones, saves it as a
checkpoint (`speculative.load_draft(path)`) and reports held-out KL and top-1 agreement. Writes
speculative.json (speculative_distill.json).
"""

from __future__ import annotations

import pydoc_data.topics
import time
from pathlib import Path
from statistics import median

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxinfer
from experiments import _common, _measure
from experiments._common import DATA, ROOT
from jaxinfer.decode import speculative as spec
from jaxinfer.model import forward as mdl
from jaxinfer.weights import checkpoint

CODE_PROMPT = (DATA / "code_edit_prompt.txt").read_text(encoding="utf-8")  # ChatML: the answer copies the code
OPEN_PROMPT = "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"


def compare(m, args) -> dict:
    """Per prompt, tokens/s of plain greedy `generate` and of each speculative way, interleaved."""
    kw = dict(max_new_tokens=args.tokens, stop_at_eos=False, allow_special=True)  # ChatML prompts
    ways = {"plain": lambda p: jaxinfer.generate(m, p, chunk_size=args.tokens, **kw),
            "lookup": lambda p: spec.generate(m, p, method="lookup", k=args.k, rounds_per_chunk=256, **kw)}
    drafts = {f"draft-first{args.draft_layers}": spec.truncated_draft(m, args.draft_layers)}
    if Path(args.draft).exists():
        d = spec.load_draft(args.draft)
        drafts[f"draft-distilled{d.config.n_layers}"] = d
    else:
        print(f"no distilled draft at {args.draft} (python -m experiments.speculative --distill); skipping it")
    for name, d in drafts.items():
        ways[name] = lambda p, d=d: spec.generate(m, p, method="draft", draft=d, k=args.k, rounds_per_chunk=256, **kw)
    res = {}
    for pname, prompt in (("code-edit", CODE_PROMPT), ("open-text", OPEN_PROMPT))[:1 if args.smoke else 2]:
        outs = {}

        def call(name, prompt=prompt, outs=outs):  # tokens/s of one generation, kept for its tokens and stats
            def run():
                outs[name] = ways[name](prompt)
                return outs[name].timings.decode_tokens_per_s
            return run

        tps = _measure.interleaved({name: call(name) for name in ways}, args.repeats)
        plain, rows = median(tps["plain"]), res.setdefault(pname, {})
        for name, ts in tps.items():
            st, tok_s = getattr(outs[name], "stats", None), median(ts)
            same = outs[name].completions[0].token_ids == outs["plain"].completions[0].token_ids
            rows[name] = {"tokens_per_s": tok_s, "speedup": tok_s / plain, "same_tokens_as_plain": same,
                          "acceptance": st.acceptance_rate if st else None,
                          "tokens_per_target_call": st.tokens_per_call if st else 1.0}
            print(f"{pname:>9} {name:>18}: {tok_s:7.1f} tok/s  x{tok_s / plain:.2f}"
                  + (f"  acceptance {st.acceptance_rate:.2f}, {st.tokens_per_call:.2f} tok/call" if st else "")
                  + ("" if same else "  OUTPUT DIFFERS"), flush=True)
    return res


def distill(m, args) -> dict:
    from experiments.data.make_text import SECTIONS as HELDOUT_SECTIONS

    cfg = m.config
    start = spec.truncated_draft(m, args.draft_layers)
    dcfg = start.config.replace(name=f"{cfg.name}-draft-{args.draft_layers}l")
    trainable = {"layers": start.params["layers"], "final_norm": start.params["final_norm"]}
    frozen = {k: v for k, v in start.params.items() if k not in trainable}
    sections = [v for k, v in pydoc_data.topics.topics.items() if k not in HELDOUT_SECTIONS]
    train_text = "\n\n".join(sections[:3] if args.smoke else sections)
    ids = np.asarray(m.tokenizer.encode(train_text), np.int32)
    held = jnp.asarray(np.asarray(_common.text_ids(m.tokenizer)[:4 * args.seq], np.int32).reshape(4, args.seq))

    def logp(params, tokens, c):
        return jax.nn.log_softmax(mdl.forward(params, tokens, mdl.default_positions(*tokens.shape), None, c).logits, -1)

    def kl_top1(t_logp, d_logp):
        return (jnp.mean(jnp.sum(jnp.exp(t_logp) * (t_logp - d_logp), -1)),
                jnp.mean(jnp.argmax(t_logp, -1) == jnp.argmax(d_logp, -1)))

    teacher = jax.jit(lambda p, t: logp(p, t, cfg))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.0))
    opt_state = opt.init(trainable)

    @jax.jit
    def train_step(tr, fr, opt_state, t_logp, tokens):  # the frozen weights are arguments: XLA would fold constants
        loss, grads = jax.value_and_grad(lambda tr: kl_top1(t_logp, logp({**fr, **tr}, tokens, dcfg))[0])(tr)
        updates, opt_state = opt.update(grads, opt_state, tr)
        return optax.apply_updates(tr, updates), opt_state, loss

    evaluate = jax.jit(lambda tr, fr, t_logp, tokens: kl_top1(t_logp, logp({**fr, **tr}, tokens, dcfg)))
    held_t = teacher(m.params, held)
    kl0, top0 = map(float, evaluate(trainable, frozen, held_t, held))
    print(f"held-out before: KL {kl0:.3f} nats, top-1 agreement {top0:.3f}", flush=True)
    rng, t0, losses = np.random.default_rng(args.seed), time.perf_counter(), []
    for step in range(args.steps):
        tokens = jnp.asarray(np.stack([ids[s:s + args.seq] for s in rng.integers(0, len(ids) - args.seq, args.batch)]))
        trainable, opt_state, loss = train_step(trainable, frozen, opt_state, teacher(m.params, tokens), tokens)
        losses.append(float(loss))
        if step % 10 == 0:
            print(f"step {step:4d}  KL {np.mean(losses[-10:]):.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        if time.perf_counter() - t0 > 60 * args.minutes:
            break
    kl1, top1 = map(float, evaluate(trainable, frozen, held_t, held))
    print(f"held-out after:  KL {kl1:.3f} nats, top-1 agreement {top1:.3f}")
    checkpoint.save(args.draft, dcfg, {**frozen, **trainable}, dtype="float32", source=f"distilled from {args.model}",
                    overwrite=True)
    print(f"saved {args.draft}")
    return {"layers": args.draft_layers, "steps": len(losses), "seconds": time.perf_counter() - t0,
            "heldout_before": {"kl": kl0, "top1": top0}, "heldout_after": {"kl": kl1, "top1": top1},
            "checkpoint": str(args.draft), "losses": losses}


def main(argv=None, model=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--tokens", type=int, default=96, help="new tokens per generation")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=4, help="tokens proposed per round")
    p.add_argument("--draft-layers", type=int, default=4, help="layers of the truncated and the distilled draft")
    p.add_argument("--draft", default=str(ROOT / "checkpoints" / "smollm2-135m-draft-4l"), help="distilled draft folder")
    p.add_argument("--distill", action="store_true", help="train and save the distilled draft")
    p.add_argument("--steps", type=int, default=120, help="distill: training steps")
    p.add_argument("--minutes", type=float, default=8.0, help="distill: stop training after this long")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.repeats, args.draft_layers, args.steps, args.seq, args.batch = 8, 1, 1, 1, 32, 2
        if args.distill:
            args.draft = str(Path(args.out) / "draft")
    m = _common.load_model(args, model, layout="stacked")
    if args.distill:
        result = distill(m, args)
        _common.save("speculative_distill", result, args)
    else:
        result = {"model": args.model, "tokens": args.tokens, "k": args.k, "results": compare(m, args)}
        _common.save("speculative", result, args)
    return result


if __name__ == "__main__":
    main()
