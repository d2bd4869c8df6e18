"""The decode core's pure functions, each run traced (jit) and untraced (chex.variants):
prefill chunks and decode steps equal the uncached forward's greedy tokens; the cache write lands
on the pages the table names; the controls act per row."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.decode import core
from jaxinfer.decode import generate as gen
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
        logits, _ = mdl.forward(PARAMS, jnp.asarray([seq]), jnp.arange(len(seq))[None], None, CFG)
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt):]


def _rows(sampling, stops=()):
    keys = smp.row_keys(np.arange(len(PROMPTS)))
    return gen.initial_rows(keys, sampling, tuple(stops), 16, eos_ids=(2,), vocab_size=CFG.vocab_size)


class CoreTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_prefill_in_chunks_then_decode_equals_the_uncached_forward(self):
        tokens, lengths = np.zeros((2, 8), np.int32), np.array([len(p) for p in PROMPTS], np.int32)
        for b, p in enumerate(PROMPTS):
            tokens[b, :len(p)] = p
        rows = _rows(smp.GREEDY)
        counts = core.host_counts(PROMPTS, CFG.vocab_size)
        cache = kv.init_cache(CFG, 2, 64)
        prefill = self.variant(lambda c, t, s, n, l: core.prefill(PARAMS, c, t, s, n, l, rows, counts,
                                                                    jnp.zeros_like(t), CFG))
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
        decode = self.variant(lambda s: core.decode(PARAMS, s, CFG, 5))
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
