"""Multi-head latent attention (DeepSeek V2/V3): every head reads one compressed latent per token.

    h [B, T, D] ──wkv_a──▶ [latent c (R), RoPE key k_r (Hr)]      (cached: R + Hr per token and layer)
      │                      c = RMSNorm(c)
      └──(wq, or wq_a ─ RMSNorm ─ wq_b)──▶ q [B, T, N, Hn + Hr] = [q_n (Hn), q_r (Hr)]

What transformers computes (`DeepseekV3Attention`), head by head: keys [W_uk c, k_r], values
W_uv c, with W_uk = wk_b [R, N, Hn] and W_uv = wv_b [R, N, Hv] (kv_b_proj's two halves):

    score = q_n . (W_uk c) + q_r . k_r          out = sum_s p_s W_uv c_s = W_uv (sum_s p_s c_s)

Both products are linear in c, so W_uk moves onto the query and W_uv after the weighted sum
("absorption", as DeepSeek's own inference code does): with q_lat = W_uk^T q_n [N, R],

    score = [q_lat, q_r] . [c, k_r]             out = W_uv (sum_s p_s c_s)

which is multi-query attention with one kv head: the key is the cached row [c, k_r] (R + Hr),
the value its first R entries. So the cache holds exactly the latent row (`jaxinfer.model.cache`,
latent pool) and `paged_attention` runs unchanged: it reads the row as key and as value (the
value's Hr RoPE columns ride along and are dropped, `latent_values`). Same function as
transformers, different order of float operations (parity: tests/test_moe.py).

Why absorption and not decompression: decompressing keys and values per block (W_uk c and W_uv c
for every cached position, then ordinary attention over N heads) is just as exact, but a decode
step would redo N (Hn + Hv) values of work per cached position per layer (DeepSeek-V3: 32,768,
against the R + Hr = 576 values absorption reads there), and a paged kernel would need the
layer's W_uk and W_uv inside its loop. Decompression is cheaper for long prefill chunks (T queries
x S keys x N heads x (R + Hr) score work against x (Hn + Hr), R = 4 Hn in DeepSeek), which is where
a production engine switches to it; here one form serves every call.

wk_b is contracted over its output axis (Hn) here, so int8 quantization leaves it in float
(`jaxinfer.model.quantize`): per-output-channel scales would not factor out of that product.
int8 covers wq (or wq_a and wq_b), wkv_a and wo; wv_b stays float too (`quantize._N_INPUT_AXES`).

The projections themselves (wq or wq_a/wq_b, wkv_a, the norms, RoPE, wv_b) run in
`forward._latent_attention_inputs` and `forward._latent_heads` with the forward's own matmul
(`forward.linear`, float or quantized); this module holds the absorption.

Shape letters as in `jaxinfer.model.config` (R, Rq, Hn, Hr, Hv: the latent widths).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig


def split_query(q: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """q [B, T, N, Hn + Hr] -> (q_n [B, T, N, Hn], q_r [B, T, N, Hr]): the part without RoPE, the RoPE part."""
    Hn = cfg.mla.qk_nope_head_dim
    return q[..., :Hn], q[..., Hn:]


def absorbed_query(q_n: jax.Array, q_r: jax.Array, wk_b: jax.Array) -> jax.Array:
    """The query that scores the cached latent row directly: [W_uk^T q_n, q_r].

    Args:
      q_n: [B, T, N, Hn] each head's query without RoPE.
      q_r: [B, T, N, Hr] its RoPE part (rotated).
      wk_b: [R, N, Hn] the key up-projection W_uk (kv_b_proj's key half).
    Returns:
      [B, T, N, R + Hr].
    """
    q_abs = jnp.einsum("BTNH,RNH->BTNR", q_n, wk_b.astype(q_n.dtype))
    return jnp.concatenate([q_abs, q_r.astype(q_abs.dtype)], axis=-1)


def latent_row(c: jax.Array, k_r: jax.Array) -> jax.Array:
    """What the cache holds for each token: c [B, T, R] (normed latent) and k_r [B, T, 1, Hr]
    (rotated RoPE key) -> [B, T, 1, R + Hr]."""
    return jnp.concatenate([c[:, :, None, :], k_r.astype(c.dtype)], axis=-1)


def latent_values(out: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Attention's output over latent rows [B, T, N, R + Hr] -> its latent part [B, T, N, R] (the
    RoPE key's columns rode along as values and are dropped); W_uv is applied next."""
    return out[..., :cfg.mla.kv_lora_rank]
