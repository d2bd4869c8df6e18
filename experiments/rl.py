"""Reinforcement learning on the engine: a GRPO-style loop, the cost of a weight update, and how the
logprobs reported while sampling compare with a teacher-forced forward.

    python -m experiments.rl [--steps 14 --prompts 8 --group 4]   # the loop: reward over steps (rl.png)
    python -m experiments.rl --updates [--rounds 7]                # update_params vs jax.device_put
    python -m experiments.rl --parity                              # logprob differences, float32 / bfloat16

The loop: a verifiable toy task, "What is a + b? Answer with the number only." for digits with
a + b <= 9, rewarded 1 when the last number in the answer is a + b, plus 0.1 when the answer is a
number alone (`reward`). Each step samples a group of --group completions
per prompt through one warm Engine (`jaxinfer.rollout`), scores them, normalises each group's
rewards into advantages, takes one clipped policy-gradient step with optax on a LoRA adapter (rank
--rank on --targets, B = 0 at the start: the base model; gradients of the teacher-forced logprobs
with the adapter kept apart, `jaxinfer.lora.train.with_adapter`), and pushes the base weights with
the adapter merged into them into the engine (`lora.merge`, `Engine.update_params`: no recompile).
The importance ratio of the loss is exp(teacher-forced logprob - the logprob reported while
sampling); docs/rollouts.md says how far apart the two are. A held-out set of problems measures
the policy before and after; beside each step a plain rollout (fresh problems, no update since the
step's own) gives the engine's plain throughput, alternating with the loop's. docs/rollouts.md
also holds the figures of --updates and --parity. Writes rl.json (rl_updates.json,
rl_parity.json) and rl.png.
"""

from __future__ import annotations

import re
import time
from statistics import median

import numpy as np

from experiments import _common
from experiments._common import plt

# --smoke: experiments.serving's engine shapes (the chat prompt is 44 tokens, 4 new ones fit), so
# the suite builds their programs once for both runners.
SMOKE_ENGINE = dict(max_slots=2, max_len=48, prefill_chunk=16)
ENGINE = dict(max_slots=16, max_len=96, prefill_chunk=64)


def engine_args(args) -> dict:
    return SMOKE_ENGINE if args.smoke else ENGINE


# ---- the task -----------------------------------------------------------------------------------
# One-digit sums: a + b <= 9 for digits a, b (55 problems). SmolLM2-135M-Instruct answers about one
# in six right at the start (it mostly talks instead of answering), so a group of samples usually
# holds both right and wrong answers to learn from. A fixed share of the problems is held out:
# the loop never trains on them, and they measure the policy before and after.
FORMAT_BONUS = 0.1  # for an answer that is a number alone, right or wrong: far below a right one


def problems() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10) for b in range(10) if a + b <= 9]


def split(seed: int, n_held_out: int = 15) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, held_out): the problems shuffled by `seed`, the last n_held_out held out."""
    p = problems()
    order = np.random.default_rng(seed).permutation(len(p))
    return [p[i] for i in order[:-n_held_out]], [p[i] for i in order[-n_held_out:]]


def tasks(rng: np.random.Generator, pool: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """n problems drawn from pool without replacement (n <= len(pool))."""
    return [pool[i] for i in rng.choice(len(pool), n, replace=False)]


def prompt_ids(tokenizer, a: int, b: int) -> list[int]:
    from jaxinfer.decode import inputs

    return inputs.chat_ids(tokenizer, [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}])


def correct(text: str, a: int, b: int) -> float:
    """1 when the last number in the answer is a + b (its final answer: "4" and "3 + 1 = 4" both
    count, "3 + 1 = 5" and a cut-off "3 + 1 =" do not), else 0."""
    found = re.findall(r"-?\d+", text)
    return float(bool(found) and int(found[-1]) == a + b)


def number_only(text: str) -> float:
    """1 when the answer is a number alone (as the prompt asks), else 0."""
    return float(re.fullmatch(r"\s*-?\d+\.?\s*", text) is not None)


def reward(text: str, a: int, b: int) -> float:
    """`correct` plus FORMAT_BONUS when the answer is a number alone: format without the right
    number earns a tenth of what a right answer does."""
    return correct(text, a, b) + FORMAT_BONUS * number_only(text)


def advantages(rewards: np.ndarray, n: int) -> np.ndarray:
    """Each group's rewards [B] (n consecutive rows a group) less the group's mean, over its std
    (0 for a group whose rewards are all equal: nothing to prefer)."""
    g = rewards.reshape(-1, n)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-4)).reshape(-1).astype(np.float32)


# ---- the trainable part: a LoRA adapter ----------------------------------------------------------
def grpo_loss(train, params, cfg, tokens, mask, old_logprobs, adv, scale: float, clip: float = 0.2):
    """The clipped policy-gradient loss of one batch: mean over completion tokens of
    -min(ratio * A, clip(ratio) * A), ratio = exp(teacher-forced - sampled logprobs) [B, T], the
    teacher-forced pass with the adapter `train` kept apart (every row on it). Also returns the
    largest |log ratio| on the mask: the engine sampled with the adapter merged into the base
    weights, so before the step this is float error (a wrong merge would show here)."""
    import jax.numpy as jnp

    from jaxinfer.eval.rollouts import teacher_forced_logprobs
    from jaxinfer.lora.train import with_adapter
    from jaxinfer.model import sites

    hooks = sites.Hooks(adapter_ids=jnp.zeros((tokens.shape[0],), jnp.int32))
    lp = teacher_forced_logprobs(with_adapter(params, train, scale, cfg.n_layers), cfg, tokens, mask, hooks=hooks)
    log_ratio = jnp.where(mask, lp - old_logprobs, 0.0)
    ratio = jnp.exp(log_ratio)
    a = adv[:, None]
    per_token = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip, 1 + clip) * a)
    loss = jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
    return loss, jnp.max(jnp.abs(log_ratio))


def pad_to(x: np.ndarray, width: int, value=0) -> np.ndarray:
    """[B, T] -> [B, width] (one shape every step: the loss compiles once)."""
    return np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=value)


def loop(args, m) -> dict:
    """The GRPO loop (see the module docstring), and beside each step a plain rollout: fresh
    problems on the same weights with no update since the step's own rollout, the engine's plain
    throughput measured alternating with the loop's."""
    import jax
    import optax

    import jaxinfer
    from jaxinfer.decode.sampling import SamplingParams
    from jaxinfer.lora.train import as_adapter, init_adapter
    from jaxinfer.model import lora
    from jaxinfer.serve import Engine

    train_pool, held_out = split(args.seed)
    if args.smoke:
        held_out = held_out[:2]
    rng, plain_rng = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)
    engine = Engine(m, **engine_args(args))
    t0 = time.perf_counter()
    n_programs = engine.warmup(logprobs=True)  # every program the loop can need, before the first step
    print(f"engine warm: {n_programs} programs in {time.perf_counter() - t0:.1f} s", flush=True)
    params, cfg = m.params, m.config
    targets, scale = tuple(args.targets.split(",")), 2.0  # lora_alpha = 2 r
    train = init_adapter(cfg, targets, args.rank, jax.random.key(args.seed))
    opt = optax.adam(args.lr)
    opt_state = opt.init(train)
    grad_fn = jax.jit(jax.value_and_grad(grpo_loss, has_aux=True), static_argnames=("cfg", "scale"))
    sampling, key, width = SamplingParams(temperature=1.0), jax.random.key(args.seed), 0
    train_key, plain_key, eval_key = (jax.random.fold_in(key, i) for i in range(3))

    def sample(problems, key):
        """(rollout, seconds, prompt tokens the engine computed: the prefix cache's hits excluded)."""
        prompts = [prompt_ids(m.tokenizer, a, b) for a, b in problems]
        hits, t0 = engine.stats().prefix_hit_tokens, time.perf_counter()
        batch = jaxinfer.rollout(engine, prompts, n=args.group, sampling=sampling, key=key,
                                 max_new_tokens=args.new_tokens)
        seconds = time.perf_counter() - t0
        computed = sum(map(len, prompts)) * args.group - (engine.stats().prefix_hit_tokens - hits)
        return batch, seconds, computed

    def score(problems, batch):
        """(reward, correct, number_only) [B] of each completion, row r answering problems[r // group]."""
        got = np.array([(reward(c.text, *problems[r // args.group]), correct(c.text, *problems[r // args.group]),
                         number_only(c.text)) for r, c in enumerate(batch.completions)], np.float32)
        return got[:, 0], got[:, 1], got[:, 2]

    def held_out_accuracy():
        """The share of right answers to the held-out problems, group samples each, the same keys every time."""
        batch, _, _ = sample(held_out, eval_key)
        return float(score(held_out, batch)[1].mean())

    before = held_out_accuracy()
    print(f"held-out accuracy before: {before:.3f} ({len(held_out)} problems x {args.group})", flush=True)
    steps = []
    for step in range(args.steps):
        problems = tasks(rng, train_pool, args.prompts)
        batch, t_gen, computed = sample(problems, jax.random.fold_in(train_key, step))
        width = max(width, batch.tokens.shape[1])
        rewards, right, formed = score(problems, batch)
        adv = advantages(rewards, args.group)
        t0 = time.perf_counter()
        (loss, log_ratio), grads = grad_fn(train, params, cfg, pad_to(batch.tokens, width),
                                           pad_to(batch.completion_mask, width), pad_to(batch.logprobs, width),
                                           adv, scale)
        updates, opt_state = opt.update(grads, opt_state, train)
        train = jax.block_until_ready(optax.apply_updates(train, updates))
        t_train = time.perf_counter() - t0
        plain, t_plain, plain_computed = sample(tasks(plain_rng, train_pool, args.prompts),
                                                jax.random.fold_in(plain_key, step))
        t0 = time.perf_counter()
        merged = jax.block_until_ready(lora.merge(params, as_adapter(train, cfg, args.rank, 2.0 * args.rank, scale,
                                                                     False), cfg))
        engine.update_params(merged)
        t_update = time.perf_counter() - t0
        n_tokens, n_plain = int(batch.completion_mask.sum()), int(plain.completion_mask.sum())
        steps.append({"step": step, "reward": float(rewards.mean()), "correct": float(right.mean()),
                      "number_only": float(formed.mean()), "loss": float(loss), "max_log_ratio": float(log_ratio),
                      "generate_s": t_gen, "generated_tokens": n_tokens, "prompt_tokens_computed": computed,
                      "plain_s": t_plain, "plain_tokens": n_plain, "plain_prompt_tokens_computed": plain_computed,
                      "train_s": t_train, "update_s": t_update, "sample": batch.completions[0].text})
        print(f"step {step:3d}  reward {rewards.mean():.3f}  correct {right.mean():.3f}  number alone "
              f"{formed.mean():.3f}  loss {float(loss):+.4f}  |log ratio| <= {float(log_ratio):.1e}  generate "
              f"{t_gen:.1f} s ({n_tokens / t_gen:.1f} tok/s, {computed} prompt tokens) plain {n_plain / t_plain:.1f} "
              f"tok/s ({plain_computed})  train {t_train:.1f} s  update {t_update * 1e3:.0f} ms  "
              f"{batch.completions[0].text!r}", flush=True)
    after = held_out_accuracy()
    print(f"held-out accuracy after: {after:.3f}", flush=True)
    # the loop's rollouts right after an update against plain ones, step by step: step 0's rollout
    # ran on an engine that had served only the held-out problems, so it is left out
    in_loop = [s["generated_tokens"] / s["generate_s"] for s in steps[1:]]
    plain_rate = [s["plain_tokens"] / s["plain_s"] for s in steps[1:]]
    throughput = {"loop_tokens_per_s": median(in_loop) if in_loop else None,
                  "plain_tokens_per_s": median(plain_rate) if plain_rate else None}
    if in_loop:
        throughput["loop_over_plain"] = throughput["loop_tokens_per_s"] / throughput["plain_tokens_per_s"]
        throughput["loop_over_plain_paired"] = median(a / b for a, b in zip(in_loop, plain_rate))
        print(f"generate phase {throughput['loop_tokens_per_s']:.1f} tok/s in the loop, "
              f"{throughput['plain_tokens_per_s']:.1f} tok/s plain (medians of steps 1-{args.steps - 1}): "
              f"{throughput['loop_over_plain']:.2f}x (step by step: {throughput['loop_over_plain_paired']:.2f}x)")
    fig, (ax, ax2) = plt().subplots(1, 2, figsize=(10, 3.5), gridspec_kw={"width_ratios": [3, 2]})
    x = np.arange(len(steps))
    ax.plot(x, [s["reward"] for s in steps], marker=".", label=f"mean reward (1 right, + {FORMAT_BONUS} number alone)")
    ax.plot(x, [s["correct"] for s in steps], marker=".", label="right answers (a + b)")
    ax.plot(x, [s["number_only"] for s in steps], lw=0.8, alpha=0.6, label="answer is a number alone")
    ax.plot([-0.5, len(steps) - 0.5], [before, after], "k*", ms=9, label="held-out problems: right, before / after")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{args.prompts} problems x {args.group} samples")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"GRPO, {cfg.name}: one-digit sums, LoRA rank {args.rank} on {args.targets}", fontsize=9)
    ax.legend(fontsize=7)
    ax2.plot(x[1:], in_loop, marker=".", label="loop: right after an update")
    ax2.plot(x[1:], plain_rate, marker=".", label="plain: same weights, no update")
    ax2.set_xlabel("step")
    ax2.set_ylabel("generate phase, tokens/s")
    ax2.set_title("engine throughput, alternating", fontsize=9)
    ax2.legend(fontsize=7)
    return {"steps": steps, "held_out": {"problems": held_out, "before": before, "after": after},
            "throughput": throughput, "compiles_while_serving": engine.compiles_while_serving,
            "params_version": engine.params_version, "fig": fig}


# ---- update_params against a copy of the weights --------------------------------------------------
def updates(args, m) -> dict:
    """Seconds of `Engine.update_params` on an engine that has served (host arrays: placed on the
    device by it; device arrays: nothing to copy) against `jax.device_put` of the same host arrays,
    alternating, medians of --rounds; and the programs built meanwhile (none)."""
    import jax

    from experiments._measure import interleaved
    from jaxinfer.compile_cache import CompileCounter
    from jaxinfer.serve import Engine

    engine = Engine(m, **engine_args(args))
    engine.submit([1, 2, 3], max_new_tokens=2).result()  # warm: the programs a request uses are built
    host = jax.tree.map(lambda x: np.asarray(x) + 0, m.params)  # fresh host arrays
    shardings = jax.tree.map(lambda x: x.sharding, m.params)
    device = jax.device_put(host, shardings)

    def timed(fn):
        def run():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            return time.perf_counter() - t0
        return run

    with CompileCounter() as compiles:
        got = interleaved({"device_put": timed(lambda: jax.device_put(host, shardings)),
                           "update_host": timed(lambda: (engine.update_params(host), engine.model.params)[1]),
                           "update_device": timed(lambda: (engine.update_params(device), engine.model.params)[1])},
                          args.rounds)
    med = {k: median(v) for k, v in got.items()}
    out = {"seconds": got, "median_s": med, "update_over_device_put": med["update_host"] / med["device_put"],
           "weights_mb": sum(x.nbytes for x in jax.tree.leaves(host)) / 1e6, "compiles": compiles.count}
    print(f"weights {out['weights_mb']:.1f} MB: device_put {med['device_put'] * 1e3:.1f} ms, update_params "
          f"(host arrays) {med['update_host'] * 1e3:.1f} ms = {out['update_over_device_put']:.2f}x, (device arrays) "
          f"{med['update_device'] * 1e3:.2f} ms; {compiles.count} compiles")
    return out


# ---- logprob parity -------------------------------------------------------------------------------
def parity(args, m) -> dict:
    """|reported - teacher-forced| over every sampled token, float32 and bfloat16, for the engine
    (`rollout`) and `generate`: quantiles and the logits' scale."""
    import jax
    import jax.numpy as jnp

    import jaxinfer
    from jaxinfer.decode.sampling import SamplingParams
    from jaxinfer.eval.rollouts import as_arrays, teacher_forced_logprobs
    from jaxinfer.model import forward
    from jaxinfer.serve import Engine

    prompts = [prompt_ids(m.tokenizer, a, b) for a, b in tasks(np.random.default_rng(args.seed), problems(), args.prompts)]
    tf = jax.jit(teacher_forced_logprobs, static_argnames=("cfg",))
    out = {}
    for dtype in ("float32", "bfloat16"):
        mm = m if m.config.dtype == dtype else jaxinfer.Model(
            config=m.config.replace(dtype=dtype), params=jax.tree.map(lambda x: x.astype(dtype), m.params),
            tokenizer=m.tokenizer)
        sampling = SamplingParams(temperature=1.0)
        batch = jaxinfer.rollout(Engine(mm, **{**engine_args(args), "max_slots": 4}), prompts, n=args.group, sampling=sampling,
                                 key=jax.random.key(args.seed), max_new_tokens=args.new_tokens)
        gen = jaxinfer.generate(mm, [p for p in prompts for _ in range(args.group)], sampling=sampling,
                                seed=list(range(len(prompts) * args.group)), max_new_tokens=args.new_tokens)
        gen_batch = as_arrays(gen.completions, n=args.group, n_top=0)
        for name, b in (("engine", batch), ("generate", gen_batch)):
            want = np.asarray(tf(mm.params, mm.config, jnp.asarray(b.tokens), jnp.asarray(b.completion_mask)))
            d = np.abs(b.logprobs - want)[b.completion_mask]
            B, T = b.tokens.shape
            logits = forward.forward(mm.params, jnp.asarray(b.tokens), forward.default_positions(B, T), None,
                                     mm.config).logits
            out[f"{dtype}/{name}"] = {"tokens": int(d.size), "exact": float(np.mean(d == 0)),
                                      "median": float(np.median(d)), "p99": float(np.quantile(d, 0.99)),
                                      "max": float(d.max()),
                                      "logits_scale": float(jnp.max(jnp.abs(logits.astype(jnp.float32))))}
            print(f"{dtype:9s} {name:9s} {d.size} tokens: exact {out[f'{dtype}/{name}']['exact']:.2f}, median "
                  f"{np.median(d):.2e}, p99 {np.quantile(d, 0.99):.2e}, max {d.max():.2e}")
    return out


def main(argv=None, model=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--updates", action="store_true", help="time update_params against jax.device_put")
    p.add_argument("--parity", action="store_true", help="measure reported vs teacher-forced logprobs")
    p.add_argument("--steps", type=int, default=14, help="loop steps (default %(default)s)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default %(default)s)")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens per sample (default %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="adam's learning rate (default %(default)s)")
    p.add_argument("--rank", type=int, default=8, help="the LoRA adapter's rank (default %(default)s)")
    p.add_argument("--targets", default="q_proj,v_proj,o_proj",
                   help="the projections the adapter changes, comma-separated (default %(default)s)")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds of --updates (default %(default)s)")
    p.add_argument("--layout", default="stacked", choices=("stacked", "per_layer"),
                   help="params layout (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.prompts, args.group, args.new_tokens, args.rounds = 2, 2, 2, 4, 1
    # The stacked layout: its programs compile several times faster on a CPU (one layer traced).
    m = _common.load_model(args, model, layout=args.layout)
    if args.updates:
        r = updates(args, m)
        _common.save("rl_updates", r, args)
        return r
    if args.parity:
        r = parity(args, m)
        _common.save("rl_parity", r, args)
        return r
    r = loop(args, m)
    fig = r.pop("fig")
    _common.save("rl", r, args, fig)
    return r


if __name__ == "__main__":
    main()
