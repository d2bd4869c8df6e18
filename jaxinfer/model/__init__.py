"""The model itself: config, params, the forward pass, the KV cache, and weight transforms.

  config.py     ModelConfig (frozen, hashable), presets, and the shape letters
  params.py     param_specs: every weight described once (shape, logical axes, init)
  model.py      `Model`: config + params + tokenizer
  forward.py    forward(params, tokens, positions, cache, cfg) -> ForwardOut (logits, cache, ...)
  sites.py      the named sites inside each layer; Hooks: what the forward captures and changes there
  interventions.py  Intervention and the built-ins (add, ablate, patch, project_out) -> Hooks
  attention.py  causal masks, dense attention, paged attention over the cache's blocks
  cache.py      KVCache: the paged pool, page tables and lengths, an immutable pytree; bytes_per_token
  rope.py       rotary inverse frequencies (plain, linear, llama3 scaling)
  layout.py     the two params layouts (stacked on L; per_layer: one array per layer, fused projections)
  quantize.py   int8 / int4 weight-only quantization
"""
