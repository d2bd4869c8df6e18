"""KV cache: the bytes formula, and cached decoding equals the uncached forward."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model import cache as kv
from jaxinfer.model import config as C
from jaxinfer.model import forward as mdl
from jaxinfer.model.params import init_params
from tests.tolerances import assert_close, smollm2_fp32_error


def test_llama3_8b_fp16_bytes_per_token():
    cfg = C.llama3_8b()
    assert kv.bytes_per_token(cfg, "float16") == 131_072  # 2 x 32 layers x 8 kv heads x 128 x 2 bytes
    assert kv.bytes_per_token(cfg, "float16") * 8192 == 1 << 30  # 1 GiB at 8,192 tokens
    # a closed-batch cache of 8,192 positions: 512 pages of 16, plus the trash page
    assert kv.cache_bytes(cfg, 1, 8192, "float16") == (1 << 30) + 16 * 131_072


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_formula_equals_real_nbytes(dtype):
    """The seed's formula: a cache holds pages x page_size tokens of bytes_per_token each."""
    cfg = C.smollm2_135m(dtype=dtype)
    c = kv.init_cache(cfg, batch_size=3, max_len=40)
    assert kv.bytes_per_token(cfg) == 2 * 30 * 3 * 64 * jnp.dtype(dtype).itemsize
    assert c.nbytes == kv.cache_bytes(cfg, 3, 40) == c.n_pages * c.page_size * kv.bytes_per_token(cfg)
    assert c.max_len >= 40 and c.n_pages == 1 + 3 * c.page_table.shape[1]  # one run per row + the trash page
    chex.assert_shape(c.k, (30, c.n_pages, kv.PAGE_SIZE, 3, 64))
    chex.assert_shape(c.page_table, (3, c.page_table.shape[1]))
    assert len(set(np.asarray(c.page_table).ravel().tolist()) | {kv.TRASH_PAGE}) == c.n_pages  # no page shared


def test_abstract_cache_allocates_nothing():
    c = kv.abstract_cache(C.llama3_70b(dtype="bfloat16"), 8, 8192)
    assert isinstance(c.k, jax.ShapeDtypeStruct)
    assert c.k.shape == (80, 1 + 8 * 512, 16, 8, 128)


def _logits_and_cache(out: mdl.ForwardOut):
    return out.logits, out.cache


def _cached_vs_uncached(params, cfg, ids, wrap=lambda f: f):
    """Logits of decoding `ids` token by token through the cache vs one uncached pass."""
    fwd = wrap(lambda p, t, pos, c: _logits_and_cache(mdl.forward(p, t, pos, c, cfg)))
    T = len(ids)
    tokens = jnp.asarray([ids], jnp.int32)
    full, _ = fwd(params, tokens, jnp.arange(T)[None], None)
    cache = kv.init_cache(cfg, 1, 32)
    # prefill the first 3 tokens, then one token at a time
    lg, cache = fwd(params, tokens[:, :3], jnp.arange(3)[None], cache)
    step_logits = [lg[0]]
    for t in range(3, T):
        lg, cache = fwd(params, tokens[:, t:t + 1], jnp.array([[t]]), cache)
        step_logits.append(lg[0])
    assert int(cache.lengths[0]) == T
    return np.asarray(full[0]), np.concatenate([np.asarray(x) for x in step_logits])


class CachedDecodeTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_cached_equals_uncached_tiny(self):
        # Llama-style, and every family switch at once (Qwen2 biases, Gemma 3 norms and window).
        for cfg in (C.tiny(), C.tiny(qkv_bias=True, tie_embeddings=True, qk_norm=True, post_norms=True,
                                     activation="gelu_tanh", scale_embeddings=True, sliding_window=4,
                                     global_every=2, rope_local_theta=100.0)):
            params = init_params(cfg, jax.random.key(0))
            full, cached = _cached_vs_uncached(params, cfg, [5, 17, 99, 3, 42, 7, 200, 11], self.variant)
            assert_close(cached, full, what="tiny: cached vs uncached")


@pytest.mark.usefixtures("optimized")
def test_cached_equals_uncached_real_model(smollm2):
    ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    full, cached = _cached_vs_uncached(smollm2.params, smollm2.config, ids, jax.jit)
    assert_close(cached, full, fp32_error=smollm2_fp32_error(), what="SmolLM2: cached vs uncached")
    np.testing.assert_array_equal(cached.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("layout", ["this backend's", "queries-major"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_paged_attention_equals_dense_attention(kv_dtype, layout, monkeypatch):
    """Attention read block by block from pages (any page size, any block size, rows of different
    lengths in scattered pages) equals one dense softmax over the same keys, in the score layout
    this backend runs for chunks (keys-major on a CPU) and in the queries-major one of decode
    steps and other backends."""
    from jaxinfer.model import attention

    if layout == "queries-major":
        monkeypatch.setitem(attention.LAYOUT, (jax.default_backend(), "chunk"), attention.QUERIES_MAJOR)
    cfg = C.tiny(sliding_window=4, global_every=2, kv_dtype=kv_dtype)
    params = init_params(cfg, jax.random.key(0))
    ids = jnp.asarray([[5, 17, 99, 3, 42, 7, 8, 1, 9, 11, 13, 12], [8, 1, 2, 250, 9, 31, 4, 4, 6, 2, 1, 0]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    ref = None
    for page_size, block_pages in ((16, 1), (4, 1), (2, 3), (1, 8)):
        cache = kv.init_cache(cfg, 2, 24, page_size=page_size).replace(block_pages=block_pages)
        # scatter each row's pages over the pool in reverse order: the table, not adjacency, decides
        cache = cache.replace(page_table=cache.page_table[:, ::-1].at[:, :].get())
        lg1, cache = _logits_and_cache(mdl.forward(params, ids[:, :5], pos[:, :5], cache, cfg, n_new=jnp.asarray([5, 3])))
        lg2, cache = _logits_and_cache(mdl.forward(params, ids[:, 5:], mdl.default_positions(2, 7, cache.lengths), cache, cfg))
        got = np.concatenate([np.asarray(lg1[0]), np.asarray(lg2[0])])  # row 0 is contiguous: 12 tokens
        if ref is None:
            full = mdl.forward(params, ids[:1], pos[:1], None, cfg).logits
            if kv_dtype == "float32":
                assert_close(got, np.asarray(full[0]), what="paged vs dense attention")
            elif kv_dtype == "float16":  # keys and values stored in float16: one float16 rounding each
                assert_close(got, np.asarray(full[0]), dtype="float16", what="float16 pages vs dense attention")
            else:  # int8 keys and values: quantization error, not float error
                np.testing.assert_allclose(got, np.asarray(full[0]), atol=0.05)
            ref = got
        assert_close(got, ref, what=f"page size {page_size}, {block_pages} pages per block")  # summation order only


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("table", ["blocks", "one_block"])
def test_decode_steps_over_big_and_small_blocks(window, table, monkeypatch):
    """A decode step reads whole attention blocks up to the longest row's context and small blocks
    past it, masked per row ("blocks": 8-position blocks of 2-position small ones; "one_block": a
    table of one 32-position block, read in 8-position small blocks up to the context): two rows
    of different lengths (prompts of 4 and 17 tokens, 12 steps each), each step's logits equal the
    dense forward over the same tokens."""
    from jaxinfer.model import attention

    one = table == "one_block"
    monkeypatch.setattr(attention, "DECODE_BLOCK_TOKENS", 8 if one else 2)
    cfg = C.tiny(sliding_window=window, global_every=2 if window else 0)
    params = init_params(cfg, jax.random.key(0))
    ids = np.asarray(jax.random.randint(jax.random.key(1), (2, 30), 1, cfg.vocab_size), np.int32)
    prompt = np.asarray([4, 17])  # row 1 starts in the third 8-position block
    cache = kv.init_cache(cfg, 2, 32, page_size=2)
    cache = (cache.with_rows(cache.page_table[:, :16], cache.lengths).replace(block_pages=16) if one
             else cache.replace(block_pages=4))
    tokens = np.zeros((2, 17), np.int32)
    for b, n in enumerate(prompt):
        tokens[b, :n] = ids[b, :n]
    step = jax.jit(lambda t, pos, c, n: _logits_and_cache(mdl.forward(params, t, pos, c, cfg, n_new=n)))
    _, cache = step(jnp.asarray(tokens), mdl.default_positions(2, 17), cache, jnp.asarray(prompt))
    got = [[], []]
    for i in range(12):
        t = ids[np.arange(2), prompt + i][:, None]
        lg, cache = step(jnp.asarray(t), mdl.default_positions(2, 1, cache.lengths), cache, jnp.ones(2, jnp.int32))
        for b in range(2):
            got[b].append(np.asarray(lg[b, 0]))
    for b in range(2):
        n = prompt[b] + 12
        full = mdl.forward(params, jnp.asarray(ids[b:b + 1, :n]), jnp.arange(n)[None], None, cfg).logits
        assert_close(np.stack(got[b]), np.asarray(full[0, prompt[b]:n]), what=f"row {b}, window {window}")


def test_forward_is_the_one_writer_of_lengths():
    """forward appends at cache.lengths and grows it by n_new; rewind is the only other change."""
    cfg = C.tiny()
    params = init_params(cfg, jax.random.key(0))
    ids = jnp.asarray([[5, 17, 99, 3], [8, 1, 2, 250]], jnp.int32)
    cache = kv.init_cache(cfg, 2, 16)
    cache = mdl.forward(params, ids, mdl.default_positions(2, 4), cache, cfg, n_new=jnp.asarray([4, 2])).cache
    np.testing.assert_array_equal(cache.lengths, [4, 2])
    # The next token of each row lands at its own length (row 1 overwrites its padding slot 2).
    nxt = jnp.asarray([[7], [7]], jnp.int32)
    after = mdl.forward(params, nxt, mdl.default_positions(2, 1, cache.lengths), cache, cfg).cache
    np.testing.assert_array_equal(after.lengths, [5, 3])
    page = int(cache.page_table[1, 0])  # row 1's first page holds its positions 0..page_size-1
    np.testing.assert_array_equal(after.k[:, page, 3], cache.k[:, page, 3])  # row 1's slot 3 untouched
    assert not np.array_equal(np.asarray(after.k[:, page, 2]), np.asarray(cache.k[:, page, 2]))
    np.testing.assert_array_equal(kv.rewind(after, jnp.asarray([2, 9])).lengths, [2, 3])  # never grows


def test_writes_off_the_table_land_on_the_trash_page():
    """An idle row (all trash-page table) or positions past a row's pages never touch real pages."""
    cfg = C.tiny()
    params = init_params(cfg, jax.random.key(0))
    pool = kv.init_pool(cfg, 5, 4, batch_size=2, width=2)
    table = jnp.asarray([[1, 2], [0, 0]], jnp.int32)  # row 0 owns pages 1, 2; row 1 is idle
    cache = pool.with_rows(table, jnp.asarray([6, 0], jnp.int32))
    after = mdl.forward(params, jnp.asarray([[3, 4, 5], [3, 4, 5]]), mdl.default_positions(2, 3, cache.lengths),
                        cache, cfg).cache  # row 0 writes positions 6, 7 (page 2) and 8 (off the table)
    changed = [p for p in range(5) if not np.array_equal(np.asarray(after.k[:, p]), np.asarray(pool.k[:, p]))]
    assert changed == [0, 2]


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("T", [1, 5, 40])  # decode; a chunk the slices unroll; one they loop over
def test_scatter_writes_equal_slice_writes(kv_dtype, T):
    """The GPU's one scatter and the CPU's dynamic_update_slices write the same values to the same
    slots, off-table positions (row 1 runs past its pages) to the trash page included."""
    cfg = C.tiny(kv_dtype=kv_dtype)
    rng = np.random.default_rng(T)
    k, v = (jnp.asarray(rng.standard_normal((2, T, cfg.n_kv_heads, cfg.head_dim)), jnp.float32) for _ in range(2))
    table = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]],
                        jnp.int32)
    starts = jnp.asarray([3, 6], jnp.int32)
    pools = {}
    for writes in ("slices", "scatter"):
        pool = kv.init_pool(cfg.replace(kv_writes=writes), 15, 4, batch_size=2, width=12)
        assert pool.writes == writes
        cache = pool.with_rows(table, starts)
        pools[writes] = jax.jit(lambda c, k, v: c.update_layer(k, v, 1, c.lengths))(cache, k, v)
    real = slice(1, None)  # the trash page (0) may take padding writes in either order
    for name in ("k", "v") + (("k_scale", "v_scale") if kv_dtype == "int8" else ()):
        a, b = (np.asarray(getattr(pools[w], name)) for w in ("slices", "scatter"))
        np.testing.assert_array_equal(a[:, real], b[:, real], err_msg=name)
        assert np.any(a[1, real] != 0)  # something was written


def test_write_mode_follows_backend_unless_configured():
    cfg = C.tiny()
    assert kv.write_mode(cfg, "cpu") == "slices" and kv.write_mode(cfg, "gpu") == "scatter"
    assert kv.write_mode(cfg.replace(kv_writes="scatter"), "cpu") == "scatter"
    assert kv.init_pool(cfg, 3, 4).writes == kv.write_mode(cfg)
    with pytest.raises(ValueError, match="kv_writes must be None or one of"):
        cfg.replace(kv_writes="loop")
