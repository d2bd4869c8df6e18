"""The model itself: config, params, the forward pass, the KV cache, and weight transforms.

  config.py    ModelConfig (frozen, hashable) and presets
  params.py    param_specs: every weight described once (shape, logical axes, init)
  forward.py   `Model` and forward(params, tokens, positions, cache, cfg) -> (logits, cache)
  cache.py     KVCache, an immutable pytree; bytes_per_token
  layout.py    the CPU decode layout (one array per layer, fused projections)
  quantize.py  int8 / int4 weight-only quantization
"""
