"""Logit bias and penalties against NumPy implementations of their published definitions, and the
repetition penalty against transformers' RepetitionPenaltyLogitsProcessor (golden file)."""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.decode import penalties as pen
from jaxinfer.decode.penalties import PenaltySettings, TokenCounts

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "penalties_golden.npz")
_update = jax.jit(TokenCounts.update)
_repetition = jax.jit(pen.apply_repetition_penalty)


def _history(prompts, generated, V):
    """TokenCounts after `prompts` then `generated` ([B] lists of equal length)."""
    state = TokenCounts.init(prompts, V)
    for t in range(len(generated[0])):
        state = _update(state, jnp.asarray([g[t] for g in generated], jnp.int32))
    return state


# -- NumPy references, written from the definitions -------------------------------------------

def np_logit_bias(logits, biases):  # OpenAI: the bias is added to the logit of its token
    out = logits.copy()
    for b, bias in enumerate(biases):
        for t, v in dict(bias).items():
            out[b, t] += np.float32(v)
    return out


def np_frequency_presence(logits, generated, freq, pres):
    # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, c over generated tokens
    out = logits.copy()
    for b, toks in enumerate(generated):
        c = np.bincount(np.asarray(toks, np.int64), minlength=logits.shape[1]).astype(np.float32)
        out[b] = logits[b] - c * np.float32(freq[b]) - (c > 0).astype(np.float32) * np.float32(pres[b])
    return out


def np_repetition(logits, histories, penalty):  # transformers: l / p if l > 0 else l * p, prompt + generated
    out = logits.copy()
    for b, toks in enumerate(histories):
        for t in set(toks):
            l = logits[b, t]
            out[b, t] = l / np.float32(penalty[b]) if l > 0 else l * np.float32(penalty[b])
    return out


def np_min_tokens(logits, n_generated, min_tokens, ignore_eos, eos_ids, stop_ids):
    out = logits.copy()
    for b in range(logits.shape[0]):
        banned = set()
        if n_generated[b] < min_tokens[b]:
            banned |= set(eos_ids) | set(stop_ids[b])
        if ignore_eos[b]:
            banned |= set(eos_ids)
        out[b, sorted(banned)] = -np.inf
    return out


def _max_diff(a, b):
    fin = np.isfinite(a) & np.isfinite(b)
    assert (np.isfinite(a) == np.isfinite(b)).all() and (a[~fin] == b[~fin]).all()
    return float(np.max(np.abs(a[fin] - b[fin]), initial=0.0))


def _logits(B, V, seed=0):
    return (np.random.default_rng(seed).standard_normal((B, V)) * 5).astype(np.float32)


# -- tests -------------------------------------------------------------------------------------

def test_repetition_penalty_matches_transformers():
    g = np.load(GOLDEN)
    logits, ids, penalty, expected = g["logits"], g["input_ids"], g["penalty"], g["expected"]
    state = TokenCounts.init([list(r) for r in ids], logits.shape[1])  # all of it as the prompt
    got = np.asarray(_repetition(jnp.asarray(logits), state.seen, jnp.asarray(penalty)))
    d = _max_diff(got, expected)
    assert d <= 1e-6 * np.abs(expected).max(), f"max |diff| vs transformers {d} ({g['versions']})"
    np.testing.assert_array_equal(got[0], logits[0])  # penalty 1.0 is off
    # the same history split into prompt + generated gives the same result (both count)
    state2 = _history([list(r[:10]) for r in ids], [list(r[10:]) for r in ids], logits.shape[1])
    got2 = np.asarray(_repetition(jnp.asarray(logits), state2.seen, jnp.asarray(penalty)))
    np.testing.assert_array_equal(got2, got)


def test_repetition_penalty_matches_numpy_definition():
    g = np.load(GOLDEN)
    logits, ids, penalty = g["logits"], g["input_ids"], g["penalty"]
    state = TokenCounts.init([list(r) for r in ids], logits.shape[1])
    got = np.asarray(_repetition(jnp.asarray(logits), state.seen, jnp.asarray(penalty)))
    want = np_repetition(logits, [list(r) for r in ids], penalty)
    assert _max_diff(got, want) <= 1e-6 * np.abs(want).max()


class PenaltiesTest(chex.TestCase):
    @chex.variants(with_jit=True)
    def test_frequency_presence_counts_generated_only(self):
        B, V = 4, 50
        rng = np.random.default_rng(1)
        logits = _logits(B, V)
        prompts = [list(rng.integers(0, V, 12)) for _ in range(B)]
        generated = [list(rng.integers(0, 10, 15)) for _ in range(B)]  # few distinct: counts > 1
        freq, pres = np.float32([0.0, 0.5, -1.2, 2.0]), np.float32([0.0, 1.0, 0.3, -2.0])
        state = _history(prompts, generated, V)
        f = self.variant(pen.apply_frequency_presence)
        got = np.asarray(f(jnp.asarray(logits), state.counts, jnp.asarray(freq), jnp.asarray(pres)))
        want = np_frequency_presence(logits, generated, freq, pres)
        assert _max_diff(got, want) <= 1e-6 * np.abs(want).max()
        np.testing.assert_array_equal(got[0], logits[0])  # zeros are off
        np.testing.assert_array_equal(np.asarray(state.generated), [15] * B)

    @chex.variants(with_jit=True)
    def test_logit_bias_bans_and_forces(self):
        B, V = 3, 40
        logits = _logits(B, V)
        biases = [{}, {5: -100, 7: 2.5, 39: 100}, {0: 1.0, 1: -1.0}]
        rows = pen.stack([PenaltySettings(logit_bias=b) for b in biases], eos_ids=[0], vocab_size=V)
        self.assertEqual(rows.bias_ids.shape, (3, 4))  # 3 entries -> 4 slots
        got = np.asarray(self.variant(pen.apply_logit_bias)(jnp.asarray(logits), rows.bias_ids, rows.bias_values))
        want = np_logit_bias(logits, biases)
        assert _max_diff(got, want) <= 1e-6 * np.abs(want).max()
        np.testing.assert_array_equal(got[0], logits[0])  # padding entries are no-ops
        assert got[1].argmax() == 39 and got[1].argmin() == 5

    @chex.variants(with_jit=True)
    def test_min_tokens_and_ignore_eos(self):
        B, V = 4, 30
        logits = _logits(B, V)
        eos = [0, 2]
        settings = [PenaltySettings(min_tokens=3), PenaltySettings(min_tokens=3, stop_token_ids=(7, 9)),
                    PenaltySettings(ignore_eos=True, stop_token_ids=(7,)), PenaltySettings()]
        rows = pen.stack(settings, eos_ids=eos, vocab_size=V)
        f = self.variant(pen.apply_penalties)
        state = TokenCounts.init([[1]] * B, V)
        for step in range(5):
            got = np.asarray(f(jnp.asarray(logits), state, rows))
            want = np_min_tokens(logits, [step] * B, [3, 3, 0, 0], [False, False, True, False], eos,
                                 [[], [7, 9], [7], []])
            np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
            state = _update(state, jnp.asarray([5] * B), jnp.asarray([True] * B))

    @chex.variants(with_jit=True)
    def test_all_together_and_defaults_are_identity(self):
        B, V = 3, 64
        rng = np.random.default_rng(2)
        logits = _logits(B, V, seed=3)
        prompts = [list(rng.integers(0, V, 8)) for _ in range(B)]
        gen = [list(rng.integers(0, 16, 6)) for _ in range(B)]
        settings = [PenaltySettings(),
                    PenaltySettings(frequency_penalty=0.4, presence_penalty=0.6, repetition_penalty=1.3,
                                    logit_bias={3: 4.0, "12": -7.5}, min_tokens=10),
                    PenaltySettings(repetition_penalty=0.8, ignore_eos=True)]
        rows = pen.stack(settings, eos_ids=[1], vocab_size=V)
        state = _history(prompts, gen, V)
        got = np.asarray(self.variant(pen.apply_penalties)(jnp.asarray(logits), state, rows))
        want = np_logit_bias(logits, [dict(s.logit_bias) for s in settings])
        want = np_repetition(want, [p + g for p, g in zip(prompts, gen)], [1.0, 1.3, 0.8])
        want = np_frequency_presence(want, gen, [0.0, 0.4, 0.0], [0.0, 0.6, 0.0])
        want = np_min_tokens(want, [6] * B, [0, 10, 0], [False, False, True], [1], [[], [], []])
        assert _max_diff(got, want) <= 1e-5 * np.abs(want[np.isfinite(want)]).max()
        np.testing.assert_array_equal(got[0], logits[0])


def test_update_respects_active_and_insert_resets_a_row():
    V = 10
    state = TokenCounts.init([[1, 2], [3]], V)
    state = state.update(jnp.asarray([4, 4]), active=jnp.asarray([True, False]))
    np.testing.assert_array_equal(np.asarray(state.counts[:, 4]), [1, 0])
    np.testing.assert_array_equal(np.asarray(state.generated), [1, 0])
    state = jax.jit(TokenCounts.insert)(state, 0, jnp.asarray([7, 8, 0, 0], jnp.int32), jnp.int32(2))
    np.testing.assert_array_equal(np.nonzero(np.asarray(state.seen[0]))[0], [7, 8])
    np.testing.assert_array_equal(np.nonzero(np.asarray(state.seen[1]))[0], [3])
    assert int(state.generated[0]) == 0 and int(state.counts[0].sum()) == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(frequency_penalty=2.5), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(presence_penalty=-3), r"presence_penalty must be in \[-2, 2\]"),
    (dict(presence_penalty=float("nan")), "presence_penalty must be a finite number"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be > 0"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
    (dict(min_tokens=1.5), "min_tokens must be an integer >= 0"),
    (dict(ignore_eos="yes"), "ignore_eos must be true or false"),
    (dict(logit_bias={5: 101}), r"logit_bias\[5\] must be in \[-100, 100\]"),
    (dict(logit_bias={"abc": 1}), "logit_bias keys must be token ids"),
    (dict(logit_bias={-1: 1}), "logit_bias key -1 is not a token id"),
    (dict(logit_bias={"5": 1, 5: 2}), "names token 5 twice"),
    (dict(logit_bias={5: True}), "must be a finite number"),
])
def test_settings_refused_with_the_parameter_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PenaltySettings(**kwargs)


def test_stack_checks_ids_against_the_vocabulary():
    with pytest.raises(ValueError, match=r"logit_bias key 50 is not a token id in \[0, 50\)"):
        pen.stack([PenaltySettings(logit_bias={"50": 1.0})], eos_ids=[0], vocab_size=50)
    with pytest.raises(ValueError, match=r"stop_token_ids \[60\] are outside \[0, 50\)"):
        pen.stack([PenaltySettings(stop_token_ids=(60,))], eos_ids=[0], vocab_size=50)
    with pytest.raises(ValueError, match="more than bias_slots=1"):
        pen.stack([PenaltySettings(logit_bias={1: 1.0, 2: 1.0})], eos_ids=[0], vocab_size=50, bias_slots=1)
    with pytest.raises(ValueError, match=r"prompt 0 has token ids \[50\]"):
        TokenCounts.init([[50]], 50)
    assert hash(PenaltySettings(logit_bias={"3": 1})) == hash(PenaltySettings(logit_bias={3: 1.0}))
