"""SAE checkpoints' names for where they read -> jaxinfer's sites, and the check against a model.

SAELens names its input with TransformerLens hooks; Gemma Scope 2 with transformers module paths
(`config.json`'s `hf_hook_point_in` / `hf_hook_point_out`). Each maps to a site of
`jaxinfer.model.sites` at one layer:

  TransformerLens                  transformers (Gemma Scope 2)                 jaxinfer site
  blocks.L.hook_resid_pre          model.layers.L.input                         resid_pre
  blocks.L.hook_resid_mid          -                                            resid_mid
  blocks.L.hook_resid_post         model.layers.L.output                        resid_post
  blocks.L.hook_attn_out           model.layers.L.post_attention_layernorm.output  attn_out
  blocks.L.attn.hook_z             model.layers.L.self_attn.o_proj.input        attn_heads (N*H flattened)
  blocks.L.hook_mlp_out            model.layers.L.post_feedforward_layernorm.output  mlp_out
  -                                model.layers.L.pre_feedforward_layernorm.output   mlp_in (transcoders)

(`model.language_model.layers...`, Gemma 3's multimodal path, is read as `model.layers...`.)
Gemma's attn_out and mlp_out sites are after the post-attention / post-feedforward norms, where
Gemma Scope reads them. Any other name is refused, naming it. A site this jaxinfer lacks (mlp_in
until the forward has it) is refused by name too.
"""

from __future__ import annotations

import math
import re

from jaxinfer.model import sites as sites_lib
from jaxinfer.model.config import ModelConfig

_TL = [(re.compile(r"blocks\.(\d+)\.hook_resid_pre"), "resid_pre"),
       (re.compile(r"blocks\.(\d+)\.hook_resid_mid"), "resid_mid"),
       (re.compile(r"blocks\.(\d+)\.hook_resid_post"), "resid_post"),
       (re.compile(r"blocks\.(\d+)\.hook_attn_out"), "attn_out"),
       (re.compile(r"blocks\.(\d+)\.attn\.hook_z"), "attn_heads"),
       (re.compile(r"blocks\.(\d+)\.hook_mlp_out"), "mlp_out")]
_HF = [(re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.input"), "resid_pre"),
       (re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.output"), "resid_post"),
       (re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.post_attention_layernorm\.output"), "attn_out"),
       (re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.self_attn\.o_proj\.input"), "attn_heads"),
       (re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.post_feedforward_layernorm\.output"), "mlp_out"),
       (re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.pre_feedforward_layernorm\.output"), "mlp_in")]
KNOWN = ("blocks.L.hook_resid_pre, blocks.L.hook_resid_mid, blocks.L.hook_resid_post, blocks.L.hook_attn_out, "
         "blocks.L.attn.hook_z, blocks.L.hook_mlp_out; model.layers.L.input, .output, "
         ".post_attention_layernorm.output, .self_attn.o_proj.input, .post_feedforward_layernorm.output, "
         ".pre_feedforward_layernorm.output")


def site_of(hook_name: str, source: str = "") -> tuple[str, int]:
    """A checkpoint's hook name -> (jaxinfer site, layer).

    Raises:
      ValueError: naming the hook when jaxinfer has no site for it (or not yet: mlp_in).
    """
    where = f" ({source})" if source else ""
    if not isinstance(hook_name, str) or not hook_name:
        raise ValueError(f"the SAE{where} names no hook it reads (hook_name); pass hook=... (e.g. "
                         "'blocks.12.hook_resid_post')")
    for pattern, site in _TL + _HF:
        m = pattern.fullmatch(hook_name)
        if m is None:
            continue
        if site not in sites_lib.SITES:
            raise ValueError(f"the SAE{where} reads {hook_name!r}, jaxinfer's {site} site, which this version's "
                             f"forward does not have (its sites: {', '.join(sites_lib.SITES)})")
        return site, int(m.group(1))
    raise ValueError(f"the SAE{where} reads {hook_name!r}, a hook jaxinfer has no site for; the hooks it maps are "
                     f"{KNOWN} (L a layer)")


def site_width(site: str, cfg: ModelConfig) -> int:
    """The width an SAE at `site` reads per token: D, or N*H at attn_heads."""
    return math.prod(sites_lib.site_shape(site, cfg))


def check(sae, model) -> None:
    """Refuse an SAE that does not fit `model` (a Model or its ModelConfig) before anything compiles.

    Raises:
      ValueError: naming the SAE, its hook and what differs (layer out of range, a width that is
        not the site's).
    """
    cfg = getattr(model, "config", model)
    spec = sae.spec
    trained = f" (trained on {spec.model_name})" if spec.model_name else ""
    what = f"the SAE {spec.source or ''} at {spec.hook_name!r}{trained}".replace("  ", " ")
    if not 0 <= spec.layer < cfg.n_layers:
        raise ValueError(f"{what} reads layer {spec.layer}; {cfg.name} has layers 0..{cfg.n_layers - 1}: "
                         "an SAE for another model")
    for site, d in ((spec.site, sae.d_in), (spec.writes_at, sae.w_dec.shape[-1])):
        want = site_width(site, cfg)
        if d != want:
            shape = "N*H" if site == "attn_heads" else "D"
            raise ValueError(f"{what} has width {d}; {cfg.name}'s {site} is {want} wide ({shape}): an SAE for "
                             "another model")


_SITE_HOOK = {"resid_pre": "blocks.{L}.hook_resid_pre", "resid_mid": "blocks.{L}.hook_resid_mid",
              "resid_post": "blocks.{L}.hook_resid_post", "attn_out": "blocks.{L}.hook_attn_out",
              "attn_heads": "blocks.{L}.attn.hook_z", "mlp_out": "blocks.{L}.hook_mlp_out",
              "mlp_in": "model.layers.{L}.pre_feedforward_layernorm.output"}


def hook_name_of(site: str, layer: int) -> str:
    """The hook name `site_of` reads back as (site, layer): TransformerLens's where it has one."""
    if site not in _SITE_HOOK:
        raise ValueError(f"jaxinfer's SAEs read {', '.join(_SITE_HOOK)}; got the site {site!r}")
    return _SITE_HOOK[site].format(L=layer)
