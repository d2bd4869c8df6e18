"""jaxinfer.decode.processors: each processor against its definition in NumPy terms, and inside
`generate` on a tiny random model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.decode import core
from jaxinfer.decode import processors as lp


def _np_no_repeat_banned(ids, n):
    """transformers' NoRepeatNGramLogitsProcessor, in NumPy terms: the tokens that followed the last
    n - 1 tokens anywhere earlier in `ids` (none while len(ids) + 1 < n)."""
    if len(ids) + 1 < n:
        return set()
    grams = {}
    for g in zip(*[ids[i:] for i in range(n)]):
        grams.setdefault(tuple(g[:-1]), set()).add(g[-1])
    return grams.get(tuple(ids[len(ids) + 1 - n:]), set())


def _repeated_ngrams(ids, n, start):
    """How many n-grams ending at or after position `start` already occurred earlier in `ids`."""
    seen, count = set(), 0
    for j in range(len(ids) - n + 1):
        g = tuple(ids[j:j + n])
        count += j + n - 1 >= start and g in seen
        seen.add(g)
    return count


def test_processors_match_their_definitions():
    rng = np.random.default_rng(0)
    B, S, V = 6, 24, 7  # a small vocabulary: repeats are common
    tokens = rng.integers(0, V, (B, S)).astype(np.int32)
    lengths = np.array([1, 2, 3, 9, 17, 24], np.int32)
    logits = rng.standard_normal((B, V)).astype(np.float32)
    steps = np.array([0, 1, 2, 3, 4, 5], np.int32)
    inp = core.ProcessorInput(tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths), steps=jnp.asarray(steps))
    for n in (2, 3, 4):
        got = np.asarray(lp.no_repeat_ngram(n)(jnp.asarray(logits), inp))
        for b in range(B):
            banned = _np_no_repeat_banned(tokens[b, :lengths[b]].tolist(), n)
            want = logits[b].copy()
            want[sorted(banned)] = -np.inf
            np.testing.assert_array_equal(got[b], want, err_msg=f"n={n} row {b}")
    got = np.asarray(lp.ban_after([1, 3], 3)(jnp.asarray(logits), inp))
    np.testing.assert_array_equal(got[:3], logits[:3])
    assert np.isneginf(got[3:, [1, 3]]).all() and (got[3:, [0, 2, 4, 5, 6]] == logits[3:, [0, 2, 4, 5, 6]]).all()


def test_no_repeat_ngram_inside_generate():
    import jaxinfer
    from jaxinfer.model import config, params
    from jaxinfer.model.model import Model

    cfg = config.tiny(vocab_size=32)
    model = Model(cfg, params.init_params(cfg, jax.random.key(3)))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]  # "5 6" was followed by 7: the first new token may not be 7
    out = jaxinfer.generate(model, [prompt], max_new_tokens=24, stop_at_eos=False,
                            logits_processor=lp.no_repeat_ngram(3)).completions[0].token_ids
    assert out[0] != 7 and _repeated_ngrams(prompt + out, 3, len(prompt)) == 0


def test_bad_n_is_refused():
    with pytest.raises(ValueError, match="n must be an int >= 2"):
        lp.no_repeat_ngram(1)
    with pytest.raises(TypeError, match="n must be an int"):
        lp.no_repeat_ngram(3.0)


def test_bad_ban_ids_are_refused():
    with pytest.raises(ValueError, match=r"token_ids\[1\] must be an int >= 0, got -1"):
        lp.ban_after([2, -1], 0)  # -1 would wrap around to V - 1
    with pytest.raises(TypeError, match="token_ids must be a sequence of ints"):
        lp.ban_after(3, 0)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        lp.ban_after([2], -1)
    inp = core.ProcessorInput(tokens=jnp.zeros((1, 4), jnp.int32), lengths=jnp.ones((1,), jnp.int32),
                              steps=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"token id 7 is out of range for a vocabulary of 7 tokens"):
        lp.ban_after([1, 7], 0)(jnp.zeros((1, 7)), inp)  # an id >= V would be dropped silently


def test_equal_processors_share_programs():
    """A processor built afresh with the same settings is equal (hash and ==): no new compile."""
    import jaxinfer
    from jaxinfer.compile_cache import CompileCounter
    from jaxinfer.model import config, params
    from jaxinfer.model.model import Model

    assert lp.no_repeat_ngram(3) == lp.no_repeat_ngram(3) and hash(lp.ban_after([4, 2], 1)) == hash(
        lp.ban_after((2, 4, 2), 1))
    assert lp.no_repeat_ngram(3) != lp.no_repeat_ngram(4)
    cfg = config.tiny(vocab_size=32)
    model = Model(cfg, params.init_params(cfg, jax.random.key(3)))
    for make in (lambda: lp.no_repeat_ngram(3), lambda: lp.ban_after([1, 2], 2)):
        outs = []
        for _ in range(2):
            with CompileCounter() as compiles:
                outs.append(jaxinfer.generate(model, [[5, 6, 7]], max_new_tokens=4, stop_at_eos=False,
                                              logits_processor=make()).completions[0].token_ids)
        assert compiles.count == 0, f"the second generate with an equal processor compiled {compiles.count}"
        assert outs[0] == outs[1]
