"""A sparse autoencoder (SAE) as a pytree, and its encoder and decoder as pure jnp functions.

Shape letters: d_in the SAE's input width (D at a [D] site; N*H at attn_heads, the heads
flattened), d_sae its features; `...` any leading axes (tokens, rows).

    f = encode(sae, x)              # x [..., d_in] -> feature activations f [..., d_sae]
    x_hat = decode(sae, f, x=x)     # f -> the reconstruction [..., d_in]

The arithmetic is SAELens's (`sae_lens.saes`, v6), architecture by architecture:

  input       x' = norm_in(x) - b_dec * apply_b_dec_to_input
  pre         h = x' @ W_enc + b_enc   (topk with rescale_acts_by_decoder_norm: h * norm(W_dec[i]))
  standard    f = relu(h)
  jumprelu    f = relu(h) * (h > threshold)
  topk        f = relu(h) at the k largest h of each token, 0 elsewhere
  decode      norm_out(f @ W_dec + b_dec)   (topk with rescaling: f / norm(W_dec[i]) first)

`normalize_activations` (SAELens's names): "none" and "expected_average_only_in" (a scale
SAELens folds into the weights when it loads one; at inference it is the identity) leave x as
it is; "constant_norm_rescale" scales each token to norm sqrt(d_in) and the output back;
"layer_norm" centres each token and divides by its (unbiased) standard deviation + 1e-5, and the
output is multiplied back and re-centred. The last two read the input's own statistics, so
`decode` of those takes the input `x` as well.

The error term: `error(sae, x) = x - reconstruct(sae, x)`, what the SAE misses. An intervention
that edits features and keeps the error term computes x + (decode(f') - decode(f)), which is x
bit for bit where no feature changed (`jaxinfer.sae.steer`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

ARCHITECTURES = ("standard", "topk", "jumprelu")
NORMALIZATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")
LAYER_NORM_EPS = 1e-5  # SAELens's run-time layer norm


@dataclasses.dataclass(frozen=True, kw_only=True)
class SAESpec:
    """What an SAE computes and where it reads: static (hashable, part of a compiled program).

    hook_name is the checkpoint's own name of its input (a TransformerLens hook such as
    blocks.12.hook_resid_post, or a transformers module path for Gemma Scope 2); site and layer
    are jaxinfer's (`jaxinfer.model.sites`). A transcoder reads at its site and writes at
    out_site (its decoder's space); an SAE's out_site is its site.
    """

    architecture: str = "standard"  # one of ARCHITECTURES
    k: int = 0  # topk: features kept per token
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"  # one of NORMALIZATIONS
    rescale_acts_by_decoder_norm: bool = False  # topk only
    hook_name: str = ""
    site: str = "resid_post"
    layer: int = 0
    out_hook_name: Optional[str] = None  # transcoders: where the decoder writes
    out_site: Optional[str] = None  # None: the SAE's own site
    model_name: Optional[str] = None  # the model it was trained on, as its files name it
    source: str = ""  # the file or folder it was read from (error messages)

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"SAE architecture {self.architecture!r} is not supported; jaxinfer runs "
                             f"{', '.join(ARCHITECTURES)}")
        if self.normalize_activations not in NORMALIZATIONS:
            raise ValueError(f"normalize_activations {self.normalize_activations!r}: SAELens's options are "
                             f"{', '.join(NORMALIZATIONS)}")
        if self.architecture == "topk" and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1):
            raise ValueError(f"a topk SAE needs k >= 1 (features kept per token), got {self.k!r}")
        if self.rescale_acts_by_decoder_norm and self.architecture != "topk":
            raise ValueError("rescale_acts_by_decoder_norm belongs to topk SAEs")

    @property
    def writes_at(self) -> str:
        """The site its decoder's directions live in (a transcoder's output site, else its own)."""
        return self.out_site or self.site

    @property
    def transcoder(self) -> bool:
        return self.out_site is not None and self.out_site != self.site


@struct.dataclass
class SAE:
    """A sparse autoencoder: its arrays (data) and its `SAESpec` (static)."""

    w_enc: jax.Array  # [d_in, d_sae]
    w_dec: jax.Array  # [d_sae, d_in]
    b_enc: jax.Array  # [d_sae]
    b_dec: jax.Array  # [d_in]
    threshold: jax.Array  # [d_sae] jumprelu's thresholds (zeros for the other architectures)
    spec: SAESpec = struct.field(pytree_node=False)

    @property
    def d_in(self) -> int:
        return self.w_enc.shape[-2]

    @property
    def d_sae(self) -> int:
        return self.w_enc.shape[-1]

    @property
    def site(self) -> str:
        return self.spec.site

    @property
    def layer(self) -> int:
        return self.spec.layer

    def __repr__(self) -> str:
        s = self.spec
        return (f"SAE({s.architecture}{f' k={s.k}' if s.architecture == 'topk' else ''}, d_in={self.d_in}, "
                f"d_sae={self.d_sae}, {s.site} layer {s.layer}"
                + (f" -> {s.out_site}" if s.transcoder else "") + f", hook {s.hook_name!r})")


def _norm_in(spec: SAESpec, x: jax.Array) -> jax.Array:
    if spec.normalize_activations == "constant_norm_rescale":
        return x * (x.shape[-1] ** 0.5 / jnp.linalg.norm(x, axis=-1, keepdims=True))
    if spec.normalize_activations == "layer_norm":
        centred = x - x.mean(axis=-1, keepdims=True)
        return centred / (jnp.std(centred, axis=-1, ddof=1, keepdims=True) + LAYER_NORM_EPS)
    return x


def _norm_out(spec: SAESpec, y: jax.Array, x: Optional[jax.Array]) -> jax.Array:
    if spec.normalize_activations not in ("constant_norm_rescale", "layer_norm"):
        return y
    if x is None:
        raise ValueError(f"decode of an SAE with normalize_activations={spec.normalize_activations!r} needs the "
                         "input x it encoded (its norm statistics): decode(sae, f, x=x)")
    x = x.astype(jnp.float32)
    if spec.normalize_activations == "constant_norm_rescale":
        return y / (x.shape[-1] ** 0.5 / jnp.linalg.norm(x, axis=-1, keepdims=True))
    mu = x.mean(axis=-1, keepdims=True)
    return y * jnp.std(x - mu, axis=-1, ddof=1, keepdims=True) + mu


def pre_activations(sae: SAE, x: jax.Array) -> jax.Array:
    """x [..., d_in] -> the encoder's pre-activations h [..., d_sae] (float32)."""
    spec = sae.spec
    x = _norm_in(spec, x.astype(jnp.float32))
    if spec.apply_b_dec_to_input:
        x = x - sae.b_dec
    h = jnp.einsum("...d,dm->...m", x, sae.w_enc) + sae.b_enc  # m: the features
    if spec.rescale_acts_by_decoder_norm:
        h = h * jnp.linalg.norm(sae.w_dec, axis=-1)
    return h


def activate(spec: SAESpec, h: jax.Array, threshold: jax.Array) -> jax.Array:
    """The architecture's activation of pre-activations h [..., d_sae]."""
    if spec.architecture == "standard":
        return jax.nn.relu(h)
    if spec.architecture == "jumprelu":
        return jax.nn.relu(h) * (h > threshold).astype(h.dtype)
    vals, idx = jax.lax.top_k(h, spec.k)  # [..., k]
    flat_h, flat_v, flat_i = h.reshape(-1, h.shape[-1]), vals.reshape(-1, spec.k), idx.reshape(-1, spec.k)
    out = jax.vmap(lambda z, i, v: z.at[i].set(v))(jnp.zeros_like(flat_h), flat_i, jax.nn.relu(flat_v))
    return out.reshape(h.shape)


def encode(sae: SAE, x: jax.Array) -> jax.Array:
    """Feature activations: x [..., d_in] -> f [..., d_sae] float32."""
    return activate(sae.spec, pre_activations(sae, x), sae.threshold)


def decode(sae: SAE, f: jax.Array, x: Optional[jax.Array] = None) -> jax.Array:
    """The reconstruction from features f [..., d_sae] -> [..., d_in] float32.

    x: the input f was encoded from, needed only for normalize_activations constant_norm_rescale
    and layer_norm (the output is scaled back with the input's own statistics)."""
    f = f.astype(jnp.float32)
    if sae.spec.rescale_acts_by_decoder_norm:
        f = f / jnp.linalg.norm(sae.w_dec, axis=-1)
    y = jnp.einsum("...m,md->...d", f, sae.w_dec) + sae.b_dec
    return _norm_out(sae.spec, y, x)


def reconstruct(sae: SAE, x: jax.Array) -> jax.Array:
    """decode(encode(x)): x [..., d_in] -> [..., d_in]."""
    return decode(sae, encode(sae, x), x)


def error(sae: SAE, x: jax.Array) -> jax.Array:
    """The error term x - reconstruct(x) [..., d_in]: what the SAE misses."""
    return x.astype(jnp.float32) - reconstruct(sae, x)


def top_features(sae: SAE, x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k most active features of each token: x [..., d_in] -> (ids [..., k] int32, values
    [..., k] float32), largest first (features that do not fire appear with value 0)."""
    values, ids = jax.lax.top_k(encode(sae, x), k)
    return ids.astype(jnp.int32), values
