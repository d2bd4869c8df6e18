"""Logits processors for research code: pure JAX functions that `jaxinfer.generate` traces into its
prefill and decode programs.

    python experiments/logits_processor.py ["The cat sat on the mat. The cat sat on the mat."] [--n 3]

A processor is `(logits [B, V], core.ProcessorInput) -> logits [B, V]`, the functional counterpart
of transformers' `LogitsProcessor`: it sees each row's tokens by position (`tokens [B, S]`, prompt
then generated, `lengths [B]` of them filled) and how many it has generated (`steps [B]`), and it
runs after the sampling controls (bias, penalties, the constraint's mask) and before the sampler.
Two examples:

  no_repeat_ngram(n)        transformers' NoRepeatNGramLogitsProcessor: a token that would
                            complete an n-gram already in the sequence gets -inf
  ban_after(token_ids, k)   these tokens get -inf once k tokens were generated

Define a processor once and reuse the function object: a new object means new programs.
Greedy SmolLM2 continues the repetitive prompt by repeating it; with no_repeat_ngram(3) it cannot.
Writes <out>/logits_processor.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `experiments` and `jaxinfer` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments import common, jsonfile  # noqa: E402
from jaxinfer.decode import core  # noqa: E402

DEFAULT_PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat."


def no_repeat_ngram(n: int) -> core.LogitsProcessor:
    """Ban every token that would complete an n-gram already in the row (prompt included).

    Args:
      n: the n-gram size (>= 2).
    Returns:
      A logits processor for `jaxinfer.generate(..., logits_processor=...)`.
    """
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an int >= 2, got {n!r}")

    def processor(logits: jax.Array, inp: core.ProcessorInput) -> jax.Array:
        B, S = inp.tokens.shape
        L = inp.lengths  # [B] tokens so far; the next one goes to position L
        W = S - n + 1  # windows: tokens[j : j + n - 1] followed by tokens[j + n - 1]
        prefix = jnp.take_along_axis(inp.tokens, jnp.clip(L[:, None] - (n - 1) + jnp.arange(n - 1), 0, S - 1),
                                     axis=1)  # [B, n-1] the last n - 1 tokens
        match = (jnp.arange(W)[None, :] + n - 1 < L[:, None]) & (L >= n - 1)[:, None]  # [B, W] follower written
        for k in range(n - 1):
            match &= inp.tokens[:, k:k + W] == prefix[:, k:k + 1]
        follower = inp.tokens[:, n - 1:]  # [B, W]
        # scatter-min: -inf where a window matches, +inf (no change) elsewhere; duplicates combine
        return logits.at[jnp.arange(B)[:, None], follower].min(jnp.where(match, -jnp.inf, jnp.inf))

    return processor


def ban_after(token_ids, step: int) -> core.LogitsProcessor:
    """Ban `token_ids` once a row has generated `step` tokens.

    Args:
      token_ids: the ids to ban.
      step: generated tokens after which the ban starts (0: from the first token).
    Returns:
      A logits processor.
    """
    ids = jnp.asarray(sorted({int(t) for t in token_ids}), jnp.int32)

    def processor(logits: jax.Array, inp: core.ProcessorInput) -> jax.Array:
        banned = logits.at[:, ids].set(-jnp.inf)
        return jnp.where((inp.steps >= step)[:, None], banned, logits)

    return processor


def repeated_ngrams(ids: list[int], n: int, start: int) -> int:
    """How many n-grams ending at or after position `start` already occurred earlier in `ids`."""
    seen, count = set(), 0
    for j in range(len(ids) - n + 1):
        g = tuple(ids[j:j + n])
        if j + n - 1 >= start and g in seen:
            count += 1
        seen.add(g)
    return count


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--n", type=int, default=3, help="n-gram size (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    if args.smoke:
        args.max_new_tokens = min(args.max_new_tokens, 16)
    import jaxinfer

    m = common.load_model(args, model)
    ids = m.tokenizer.encode(args.prompt)
    runs = {"greedy": None, f"no_repeat_ngram({args.n})": no_repeat_ngram(args.n)}
    result = {"experiment": "logits_processor", "prompt": args.prompt, "n": args.n, "runs": {}}
    for name, proc in runs.items():
        out = jaxinfer.generate(m, [ids], max_new_tokens=args.max_new_tokens, logits_processor=proc).completions[0]
        rep = repeated_ngrams(ids + out.token_ids, args.n, len(ids))
        result["runs"][name] = {"text": out.text, "token_ids": out.token_ids, "repeated_ngrams": rep}
        print(f"{name:22} repeated {args.n}-grams: {rep:3d}  {out.text[:100]!r}")
    result["environment"] = common.environment()
    jsonfile.write_json(Path(args.out) / "logits_processor.json", result, indent=2)
    return result


if __name__ == "__main__":
    main()
