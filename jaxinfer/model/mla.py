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
value's Hr RoPE columns ride along and are dropped here, `heads`). Same function as
transformers, different order of float operations (parity: tests/test_moe.py).

Why absorption and not decompression: decompressing keys and values per block (W_uk c and W_uv c
for every cached position, then ordinary attention over N heads) is just as exact, but a decode
step would redo N (Hn + Hv) values of work per cached position per layer (DeepSeek-V3: 32,768
against the R + Hr = 576 positions' values absorption reads), and a paged kernel would need the
layer's W_uk and W_uv inside its loop. Decompression is cheaper for long prefill chunks (T queries
x S keys x N heads x (R + Hr) score work against x (Hn + Hr), R = 4 Hn in DeepSeek), which is where
a production engine switches to it; here one form serves every call.

wk_b is contracted over its output axis (Hn) here, so int8 quantization leaves it in float
(`jaxinfer.model.quantize`): per-output-channel scales would not factor out of that product.

Shape letters as in `jaxinfer.model.config` (R, Rq, Hn, Hr, Hv: the latent widths).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.model import forward as F  # rms_norm, rope, linear (resolved at call time)
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params


def queries_and_latent(h: jax.Array, positions: jax.Array, inv_freq: jax.Array, lp: Params, cfg: ModelConfig
                       ) -> tuple[jax.Array, jax.Array]:
    """Absorbed queries and the latent row to cache, from one layer's normed inputs.

    Args:
      h: [B, T, D] normed hidden states.
      positions: [B, T] RoPE positions.
      inv_freq: [Hr/2] the layer's RoPE inverse frequencies.
      lp: the layer's params (wq or wq_a/q_a_norm/wq_b; wkv_a, kv_a_norm, wk_b).
      cfg: model config with `cfg.mla`.
    Returns:
      (q [B, T, N, R + Hr]: [W_uk^T q_n, RoPE(q_r)]; latent [B, T, 1, R + Hr]: [RMSNorm(c), RoPE(k_r)]).
    """
    a = cfg.mla
    if a.q_lora_rank:
        q_lat = F.rms_norm(F.linear("BTD,DR->BTR", h, lp["wq_a"]), lp["q_a_norm"], cfg.norm_eps)
        q = F.linear("BTR,RNH->BTNH", q_lat, lp["wq_b"])
    else:
        q = F.linear("BTD,DNH->BTNH", h, lp["wq"])
    q_n, q_r = q[..., :a.qk_nope_head_dim], q[..., a.qk_nope_head_dim:]
    kv = F.linear("BTD,DR->BTR", h, lp["wkv_a"])  # [B, T, R + Hr]
    c = F.rms_norm(kv[..., :a.kv_lora_rank], lp["kv_a_norm"], cfg.norm_eps)
    k_r = F.rope(kv[..., None, a.kv_lora_rank:], positions, inv_freq, cfg.rope_attention_factor)  # [B, T, 1, Hr]
    q_r = F.rope(q_r, positions, inv_freq, cfg.rope_attention_factor)
    q_abs = jnp.einsum("BTNH,RNH->BTNR", q_n, lp["wk_b"].astype(q_n.dtype))  # W_uk^T q_n
    return jnp.concatenate([q_abs, q_r], axis=-1), jnp.concatenate([c[:, :, None, :], k_r], axis=-1)


def heads(out: jax.Array, lp: Params, cfg: ModelConfig) -> jax.Array:
    """Each head's attention output from its latent-weighted sum: out [B, T, N, R + Hr] (the
    latent row's weighted sum; its RoPE columns are dropped) -> W_uv applied, [B, T, N, Hv]."""
    return F.linear("BTNR,RNV->BTNV", out[..., :cfg.mla.kv_lora_rank], lp["wv_b"])
