"""The decode core's pure functions, each run traced (jit) and untraced (chex.variants):
prefill chunks and decode steps equal the uncached forward's greedy tokens; the cache write lands
on the pages the table names; the controls act per row."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.decode import core
from jaxinfer.decode import request
from jaxinfer.decode import sampling as smp
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.model import cache as kv
from jaxinfer.model import config as C
from jaxinfer.model import forward as mdl
from jaxinfer.model.params import init_params

CFG = C.tiny(name="tiny-core")
PARAMS = init_params(CFG, jax.random.key(0))
PROMPTS = [[5, 17, 99, 3, 42, 7, 8], [8, 1, 2]]


def _greedy_reference(prompt, n):
    """Greedy tokens by rerunning the uncached forward on the growing sequence."""
    seq = list(prompt)
    for _ in range(n):
        logits = mdl.forward(PARAMS, jnp.asarray([seq]), jnp.arange(len(seq))[None], None, CFG).logits
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt):]


def _rows(sampling, stops=()):
    keys = smp.row_keys(np.arange(len(PROMPTS)))
    return request.initial_rows(keys, sampling, tuple(stops), 16, eos_ids=(2,), vocab_size=CFG.vocab_size)


class CoreTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_prefill_in_chunks_then_decode_equals_the_uncached_forward(self):
        tokens, lengths = np.zeros((2, 8), np.int32), np.array([len(p) for p in PROMPTS], np.int32)
        for b, p in enumerate(PROMPTS):
            tokens[b, :len(p)] = p
        rows = _rows(smp.GREEDY)
        counts = core.host_counts(PROMPTS, CFG.vocab_size)
        cache = kv.init_cache(CFG, 2, 64)
        prefill = self.variant(lambda c, t, s, n, l: core.prefill(
            PARAMS, c, core.PrefillWork(tokens=t, starts=s, n_real=n, last=l, rows=rows, counts=counts,
                                        next_tokens=jnp.zeros_like(t)), options=core.PrefillOptions(cfg=CFG)))
        first = np.zeros((2,), np.int32)
        for lo in (0, 4):  # two chunks of 4: row 1's prompt ends in the first
            n_real = np.clip(lengths - lo, 0, 4).astype(np.int32)
            last = (lengths > lo) & (lengths <= lo + 4)
            cache, _, out = prefill(cache, tokens[:, lo:lo + 4], np.minimum(lengths, lo).astype(np.int32), n_real,
                                    last)
            first = np.where(last, np.asarray(out.first.tokens[:, 0]), first)
        chex.assert_trees_all_equal(np.asarray(cache.lengths), lengths)
        state = core.DecodeState(cache=cache, tokens=first, counts=counts,
                                 rows=rows.replace(steps=rows.steps + 1, budget=np.full((2,), 5, np.int32)))
        decode = self.variant(lambda s: core.decode(PARAMS, s, options=core.DecodeOptions(cfg=CFG), n_steps=5))
        state, em = decode(state)
        chex.assert_shape(em.tokens, (5, 2, 1))
        for b, p in enumerate(PROMPTS):
            got = [int(first[b])] + [int(t) for t in np.asarray(em.tokens[:, b, 0])]
            assert got == _greedy_reference(p, 6), (b, got)

    @chex.variants(with_jit=True, without_jit=True)
    def test_cache_write_lands_on_the_tables_pages(self):
        pool = kv.init_pool(CFG, 6, 4, batch_size=2, width=2)
        cache = pool.with_rows(jnp.asarray([[3, 1], [5, 2]], jnp.int32), jnp.asarray([2, 4], jnp.int32))
        k = jnp.ones((2, 3, CFG.n_kv_heads, CFG.head_dim))
        write = self.variant(lambda c, k: c.update_layer(k, 2 * k, 1, c.lengths))
        out = write(cache, k)
        written = {(p, o) for p in range(6) for o in range(4) if float(out.k[1, p, o].sum()) != 0}
        # row 0: positions 2, 3 on page 3, position 4 on page 1; row 1: positions 4..6 on page 2
        assert written == {(3, 2), (3, 3), (1, 0), (2, 0), (2, 1), (2, 2)}
        chex.assert_trees_all_close(out.v[1, 2, 0], 2 * k[1, 0])

    @chex.variants(with_jit=True, without_jit=True)
    def test_controls_act_per_row(self):
        """A banned token (bias -100) and a forced one (+100) in two rows of one batch; a third
        row without controls samples the plain argmax."""
        logits = jax.random.normal(jax.random.key(1), (3, CFG.vocab_size))
        plain = np.asarray(jnp.argmax(logits, -1))
        settings = [SamplingParams(temperature=0, logit_bias={int(plain[0]): -100}),
                    SamplingParams(temperature=0, logit_bias={7: 100}), SamplingParams(temperature=0)]
        keys = smp.row_keys(np.arange(3))
        rows = core.Rows(sampling=smp.row_params(settings), keys=keys, steps=np.zeros((3,), np.int32),
                         stop_ids=core.stop_array([()] * 3), budget=np.ones((3,), np.int32),
                         finished=np.zeros((3,), bool),
                         controls=core.controls_for(settings, [()] * 3, (2,), CFG.vocab_size),
                         mask=core.no_mask(3, CFG.vocab_size))
        counts = core.host_counts([[1]] * 3, CFG.vocab_size)
        tok, _, _ = self.variant(lambda l: core.select_tokens(l, rows, counts))(logits)
        tok = np.asarray(tok)
        assert tok[0] != plain[0] and tok[1] == 7 and tok[2] == plain[2]


def _alone(prompt, n, sampling, key):
    """Tokens of one prompt decoded alone in its own cache (prefill, then n - 1 decode steps)."""
    rows = request.initial_rows(key[None], sampling, (), n, eos_ids=(2,), vocab_size=CFG.vocab_size)
    counts = core.host_counts([prompt], CFG.vocab_size)
    cache = kv.init_cache(CFG, 1, 64)
    t = np.asarray([prompt], np.int32)
    cache, counts, out = core.prefill(PARAMS, cache, core.PrefillWork(
        tokens=t, starts=np.zeros((1,), np.int32), n_real=np.asarray([len(prompt)], np.int32), last=np.ones((1,), bool),
        rows=rows, counts=counts, next_tokens=jnp.zeros_like(t)), options=core.PrefillOptions(cfg=CFG))
    first = np.asarray(out.first.tokens[:, 0])
    state = core.DecodeState(cache=cache, tokens=first, counts=counts,
                             rows=rows.replace(steps=rows.steps + 1, budget=rows.budget - 1))
    _, em = core.decode(PARAMS, state, options=core.DecodeOptions(cfg=CFG), n_steps=n - 1)
    return [int(first[0])] + [int(x) for x in np.asarray(em.tokens[:, 0, 0])]


def test_forward_of_segments_equals_each_segment_alone():
    """A decode segment [2, 1] and a prompt chunk [1, 5] in one forward: the same logits and the
    same keys on the same pages as two forwards."""
    pool = kv.init_pool(CFG, 12, 4, batch_size=2, width=4)
    dec = mdl.Segment(tokens=jnp.asarray([[5], [9]]), positions=jnp.asarray([[3], [0]]),
                      page_table=jnp.asarray([[1, 2, 0, 0], [3, 0, 0, 0]]), lengths=jnp.asarray([3, 0]))
    pre = mdl.Segment(tokens=jnp.asarray([[4, 8, 15, 16, 23]]), positions=jnp.arange(5)[None],
                      page_table=jnp.asarray([[6, 7, 0, 0]]), lengths=jnp.zeros((1,), jnp.int32),
                      logit_index=jnp.asarray([4]))
    both = jax.jit(lambda p, c: mdl.forward(p, None, None, c, CFG, segments=(dec, pre)))(PARAMS, pool)
    (l_dec, c_dec), (l_pre, c_pre) = ((o.logits, o.cache) for o in both)
    alone = mdl.forward(PARAMS, dec.tokens, dec.positions, pool.with_rows(dec.page_table, dec.lengths), CFG)
    a, ca = alone.logits, alone.cache
    alone = mdl.forward(PARAMS, pre.tokens, pre.positions, ca.with_rows(pre.page_table, pre.lengths), CFG,
                        logit_index=pre.logit_index)
    b, cb = alone.logits, alone.cache
    chex.assert_trees_all_close((l_dec, l_pre), (a, b), atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close((c_pre.k, c_pre.v), (cb.k, cb.v), atol=1e-5, rtol=1e-5)
    assert c_dec.k is c_pre.k or np.array_equal(np.asarray(c_dec.k), np.asarray(c_pre.k))  # one pool
    assert np.asarray(c_dec.lengths).tolist() == [4, 1] and np.asarray(c_pre.lengths).tolist() == [5]


class MixedStepTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_a_joining_prompt_and_the_decoding_rows_sample_what_they_sample_alone(self):
        """Slot 0 decodes, slot 1 is idle, slot 2's prompt arrives as a chunk beside them: after the
        mixed step and a decode scan, both rows' sampled tokens equal each prompt decoded alone."""
        sampling = SamplingParams(temperature=0.8, top_p=0.95)
        keys = smp.row_keys(np.array([11, 0, 12]))
        n = 6
        old, new = PROMPTS
        want_old, want_new = _alone(old, n + 1, sampling, keys[0]), _alone(new, n, sampling, keys[2])
        # slot 0: `old` prefilled alone into pages 1..4 with its first token sampled (as the engine leaves it)
        rows = request.initial_rows(keys, sampling, (), n, eos_ids=(2,), vocab_size=CFG.vocab_size)
        counts = core.host_counts([old, [0], new], CFG.vocab_size)
        table = np.zeros((3, 4), np.int32)
        table[0], table[2] = [1, 2, 3, 4], [5, 6, 7, 8]
        pool = kv.init_pool(CFG, 10, 4, batch_size=3, width=4)
        t = np.zeros((3, 8), np.int32)
        t[0, :len(old)] = old
        cache, counts, out = core.prefill(PARAMS, pool.with_rows(table * np.array([[1], [0], [0]]), np.zeros(3, np.int32)),
                                          core.PrefillWork(tokens=t, starts=np.zeros(3, np.int32),
                                                           n_real=np.asarray([len(old), 0, 0], np.int32),
                                                           last=np.asarray([True, False, False]), rows=rows,
                                                           counts=counts, next_tokens=jnp.zeros_like(t)),
                                          options=core.PrefillOptions(cfg=CFG))
        assert int(out.first.tokens[0, 0]) == want_old[0]
        rows = rows.replace(steps=np.asarray([1, 0, 0], np.int32), budget=np.asarray([n, 0, n], np.int32))
        counts = counts.replace(counts=np.asarray(counts.counts) * np.array([[1], [0], [0]]),
                                generated=np.asarray([1, 0, 0], np.int32))
        state = core.DecodeState(cache=cache.with_rows(table, np.asarray([len(old), 0, 0], np.int32)),
                                 tokens=np.asarray([want_old[0], 0, 0], np.int32), rows=rows, counts=counts)
        chunk = np.zeros((1, 4), np.int32)
        chunk[0, :len(new)] = new
        chunks = core.Chunks(tokens=chunk, starts=np.zeros((1,), np.int32), n_real=np.asarray([len(new)], np.int32),
                             last=np.ones((1,), bool), slots=np.asarray([2], np.int32), page_table=table[2:])
        step = self.variant(lambda s, c: core.mixed_step(PARAMS, s, c, options=core.DecodeOptions(cfg=CFG)))
        state, em0, first = step(state, chunks)
        assert int(first.count[0]) == 1 and int(first.tokens[0, 0]) == want_new[0]
        assert np.asarray(em0.count).tolist() == [1, 0, 0]  # slot 2 did not decode in its chunk's step
        assert np.asarray(state.rows.steps).tolist() == [2, 0, 1]
        assert np.asarray(state.cache.lengths).tolist() == [len(old) + 1, 0, len(new)]
        decode = self.variant(lambda s: core.decode(PARAMS, s, options=core.DecodeOptions(cfg=CFG), n_steps=n))
        state, em = decode(state)
        got_old = [want_old[0], int(em0.tokens[0, 0])] + [int(x) for x in np.asarray(em.tokens[:, 0, 0])]
        got_new = [want_new[0]] + [int(x) for x in np.asarray(em.tokens[:, 2, 0])[np.asarray(em.count[:, 2]) == 1]]
        assert got_old[:n + 1] == want_old and got_new == want_new, (got_old, want_old, got_new, want_new)
        assert np.asarray(em.count[:, 1]).sum() == 0  # the idle slot never decodes


def test_decode_loop_skips_whole_groups_once_nothing_is_live():
    """A fake step function counts its trips: with `every`, a group that starts live runs whole
    (its steps emit), a group that starts with nothing live is skipped (zeros), and a group is
    gcd(n_steps, every) steps."""
    def step(s):
        return s + 1, s + 1  # the state counts the steps that ran; each step emits its number

    def live(s):
        return s < 3  # live before the third step

    for n_steps, every, ran, emitted in ((8, 1, 3, [1, 2, 3, 0, 0, 0, 0, 0]),
                                         (8, 4, 4, [1, 2, 3, 4, 0, 0, 0, 0]),
                                         (6, 4, 4, [1, 2, 3, 4, 0, 0]),  # groups of gcd(6, 4) = 2
                                         (8, 8, 8, list(range(1, 9))),
                                         (5, 8, 3, [1, 2, 3, 0, 0])):  # gcd 1: every step checked
        state, out = jax.jit(lambda s: core.decode_loop(step, s, n_steps, live=live, every=every))(jnp.int32(0))
        assert int(state) == ran and out.tolist() == emitted, (n_steps, every)
    state, out = core.decode_loop(step, jnp.int32(0), 4)  # no `live`: every step runs
    assert int(state) == 4 and out.tolist() == [1, 2, 3, 4]
