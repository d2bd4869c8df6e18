"""Per-row sampling settings (the engine's sampler) draw exactly what `sample` draws per setting."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.decode import sampling as smp
from jaxinfer.decode.sampling import SamplingParams

SETTINGS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
            SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9, min_p=0.1),
            SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05), SamplingParams(temperature=1.0, top_k=1),
            SamplingParams(temperature=1.0, top_k=64), SamplingParams(temperature=0.5, top_p=0.3)]


def test_a_mixed_batch_samples_each_row_as_its_own_settings_alone():
    """A batch mixing every setting: row b's token and logprob equal `sample` with row b's params,
    over many keys and logit rows (some with ties and a very peaked distribution)."""
    V, n_draws = 64, 12
    rng = np.random.default_rng(0)
    rows = len(SETTINGS)
    batch = jax.jit(smp.sample)
    alone = jax.jit(smp.sample, static_argnums=2)  # one row's own settings, static: one program each
    differ = 0
    for d in range(n_draws):
        logits = rng.normal(size=(rows, V)).astype(np.float32) * (1 + 3 * (d % 3))
        logits[:, :3] = logits[:, :1]  # ties
        keys = smp.step_keys(smp.row_keys(np.arange(rows) + 100 * d), d)
        tok, lp = batch(jnp.asarray(logits), keys, smp.row_params(SETTINGS))
        for b, sp in enumerate(SETTINGS):
            ref_tok, ref_lp = alone(jnp.asarray(logits[b:b + 1]), keys[b:b + 1], sp)
            differ += int(ref_tok[0] != tok[b])
            np.testing.assert_allclose(float(ref_lp[0]), float(lp[b]), atol=1e-6)
    assert differ == 0, f"{differ} of {n_draws * rows} draws differ"


def test_filters_off_leave_rows_untouched():
    """top_p = 1 and min_p = 0 must not drop tail tokens (the static sampler skips those filters)."""
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 32)).astype(np.float32) * 20)
    rp = smp.row_params([SamplingParams(temperature=1.0), SamplingParams(temperature=2.0)])
    out = smp.filter_logits(logits, rp)
    np.testing.assert_array_equal(out[0], logits[0])
    np.testing.assert_array_equal(out[1], logits[1] / 2.0)


def test_batch_rows_reuses_device_counts_only_while_nobody_is_penalized():
    """The engine keeps the last call's TokenCounts on the device and passes them again while no
    row uses penalties (nothing reads them then); a penalized row gets its own counts from the host."""
    from jaxinfer.decode import penalties as pen
    from jaxinfer.serve.live import batch_rows

    class Row:  # the fields batch_rows reads from a Live
        def __init__(self, sampling, counts=None, in_prompt=None):
            self.sampling, self.counts, self.in_prompt, self.matcher = sampling, counts, in_prompt, None
            self.key_data, self.stop_ids, self.extra_stops = np.zeros(2, np.uint32), (), ()
            self.seq = type("Seq", (), {"generated": [1, 2]})()

    V = 16
    spare = pen.TokenCounts(counts=jnp.full((3, V), 7, jnp.int32), in_prompt=jnp.ones((3, V), bool),
                            generated=jnp.full((3,), 9, jnp.int32))
    plain = [Row(SamplingParams(temperature=0.7)), None, Row(SamplingParams(temperature=0.0))]
    _, counts = batch_rows(plain, np.ones(3, np.int32), (0,), V, 2, spare=spare)
    assert counts is spare
    _, fresh = batch_rows(plain, np.ones(3, np.int32), (0,), V, 2)  # no spare: zeros from the host
    assert not np.asarray(fresh.counts).any() and list(np.asarray(fresh.generated)) == [2, 0, 2]
    mine = np.arange(V, dtype=np.int32)
    penalized = plain[:2] + [Row(SamplingParams(temperature=0.0, frequency_penalty=1.0), mine, mine % 2 == 0)]
    _, counts = batch_rows(penalized, np.ones(3, np.int32), (0,), V, 2, spare=spare)
    assert counts is not spare
    np.testing.assert_array_equal(np.asarray(counts.counts), np.stack([np.zeros(V, np.int32)] * 2 + [mine]))
    np.testing.assert_array_equal(np.asarray(counts.in_prompt)[2], mine % 2 == 0)
